"""The package's layout rule: the kernels in ``mtp_hooks/ops`` know nothing of the hook runtime.

A module of ``ops`` imports the standard library, torch, megatron-core, other modules of ``ops``
and ``mtp_hooks.errors`` (the exception types, which import nothing of the package), so a kernel
can be replaced or reused without the hooks. Read from the source, nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mtp_hooks"
OPS_MAY_IMPORT = ("torch", "megatron", "mtp_hooks.ops", "mtp_hooks.errors")


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports (absolute names; ``from . import x`` resolved against its package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base] if node.module else [f"{base}.{alias.name}" for alias in node.names]
    return names


def _allowed(name: str, allowed: tuple[str, ...]) -> bool:
    top = name.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names or any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("path", sorted((PACKAGE / "ops").glob("*.py")), ids=lambda p: p.name)
def test_ops_modules_import_nothing_of_the_hook_runtime(path: pathlib.Path) -> None:
    foreign = [name for name in imported_modules(path) if not _allowed(name, OPS_MAY_IMPORT)]
    assert not foreign, f"mtp_hooks/ops/{path.name} imports {foreign}; ops may import only {OPS_MAY_IMPORT} and the standard library"


def test_errors_imports_nothing_of_the_package() -> None:
    own = [name for name in imported_modules(PACKAGE / "errors.py") if name.split(".")[0] == "mtp_hooks"]
    assert not own, f"mtp_hooks/errors.py imports {own}; ops relies on it being a leaf"


def _package_imports(folder: str) -> list[tuple[str, str]]:
    """(module file, imported name) for every ``mtp_hooks`` import of the modules in ``folder``."""
    return [
        (path.name, name)
        for path in sorted((PACKAGE / folder).glob("*.py"))
        for name in imported_modules(path)
        if name.split(".")[0] == "mtp_hooks"
    ]


def test_runtime_names_no_option() -> None:
    """``runtime`` holds the forward's shared mechanics: it imports no option module, nor the switchboard."""
    upward = [(f, n) for f, n in _package_imports("runtime") if n.startswith(("mtp_hooks.features", "mtp_hooks.hooks", "mtp_hooks.api", "mtp_hooks.handle"))]
    assert not upward, f"mtp_hooks/runtime imports {upward}"


def test_features_never_import_the_switchboard() -> None:
    """Each option module is called by ``hooks``; none of them calls back up into it (or the face)."""
    upward = [(f, n) for f, n in _package_imports("features") if n.startswith(("mtp_hooks.hooks", "mtp_hooks.api", "mtp_hooks.handle"))]
    assert not upward, f"mtp_hooks/features imports {upward}"


def test_no_library_module_is_over_300_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines: {long}"


def test_attach_takes_exactly_the_options() -> None:
    """``attach``'s keyword parameters are ``Options``' fields, with the same defaults (``attach``
    builds ``Options`` from its arguments by these names)."""
    import dataclasses
    import inspect

    import mtp_hooks
    from mtp_hooks.options import Options

    parameters = {n: p.default for n, p in inspect.signature(mtp_hooks.attach).parameters.items() if n != "model"}
    fields = {f.name: f.default for f in dataclasses.fields(Options)}
    assert parameters == fields


# ``attach`` takes one keyword per option (``Options``' fields, above); every other signature groups
# what travels together into small typed objects (``KernelSpec``, ``DraftRule``, ``MTPBatch`` ...).
MANY_PARAMETERS_ALLOWED = {("api.py", "attach")}


def test_no_function_takes_more_than_8_parameters() -> None:
    """Counted without ``self`` / ``cls`` / an autograd ``ctx`` and ``**kwargs`` (which the testing models'
    mcore-built modules take and pass on), over every function and method of the package."""
    crowded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]] + ([arguments.vararg.arg] if arguments.vararg else [])
                count = len([name for name in names if name not in ("self", "cls", "ctx")])
                if count > 8 and (str(path.relative_to(PACKAGE)), node.name) not in MANY_PARAMETERS_ALLOWED:
                    crowded.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({count})")
    assert not crowded, f"functions over 8 parameters: {crowded}"
