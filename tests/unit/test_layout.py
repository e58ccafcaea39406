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
    upward = [(f, n) for f, n in _package_imports("runtime") if n.startswith(("mtp_hooks.features", "mtp_hooks.hooks", "mtp_hooks.preflight", "mtp_hooks.api", "mtp_hooks.handle"))]
    assert not upward, f"mtp_hooks/runtime imports {upward}"


def test_features_never_import_the_switchboard() -> None:
    """Each option module is called by ``hooks`` and ``preflight``; none of them calls back up into them (or the face)."""
    above = ("mtp_hooks.hooks", "mtp_hooks.preflight", "mtp_hooks.api", "mtp_hooks.handle")
    upward = [(f, n) for f, n in _package_imports("features") if n.startswith(above)]
    assert not upward, f"mtp_hooks/features imports {upward}"


# What every forward and every micro-batch needs, whatever the options. An option keeps its own
# per-forward state in its ``features`` module (a field of ``hooks.InFlight``), never here.
RUNTIME_FIELDS = {
    "Forward": {
        "model", "kwargs", "thread", "exception", "targets", "recompute", "window", "main_pending", "block_output",
        "mtp_layer_calls", "swaps",
    },
    "MicroBatch": {"labels", "loss_mask", "loss_scale", "used", "entered", "seen", "read", "thread"},
}


def test_runtime_state_names_no_option() -> None:
    """``runtime.forward.Forward`` and ``runtime.micro_batch.MicroBatch`` hold the runtime's own fields only."""
    import dataclasses

    from mtp_hooks.runtime.forward import Forward
    from mtp_hooks.runtime.micro_batch import MicroBatch

    for cls in (Forward, MicroBatch):
        fields = {field.name for field in dataclasses.fields(cls)}
        extra, missing = fields - RUNTIME_FIELDS[cls.__name__], RUNTIME_FIELDS[cls.__name__] - fields
        assert not extra, (
            f"{cls.__name__} has fields {sorted(extra)} beyond the runtime's own: an option's state belongs in its "
            "features module (a field of hooks.InFlight); a field every forward needs goes in RUNTIME_FIELDS"
        )
        assert not missing, f"RUNTIME_FIELDS lists {sorted(missing)}, which {cls.__name__} no longer has"


def test_api_imports_no_feature() -> None:
    """``attach`` reaches the options' checks through ``preflight`` (the one check phase), no feature directly."""
    features = [name for name in imported_modules(PACKAGE / "api.py") if name.startswith("mtp_hooks.features")]
    assert not features, f"mtp_hooks/api.py imports {features}; attach-time checks go through mtp_hooks.preflight"


def test_no_library_module_is_over_300_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines: {long}"


MAX_LINE = 120


def test_no_library_line_is_over_120_characters() -> None:
    long = [
        f"mtp_hooks/{path.relative_to(PACKAGE)}:{number} ({len(line)})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"{len(long)} lines over {MAX_LINE} characters (wrap them):\n" + "\n".join(long)


def test_attach_takes_exactly_the_options() -> None:
    """``attach``'s keyword parameters are ``Options``' fields, with the same defaults (``attach``
    builds ``Options`` from its arguments by these names)."""
    import dataclasses
    import inspect

    import mtp_hooks
    from mtp_hooks.options import Options

    parameters = {n: p.default for n, p in inspect.signature(mtp_hooks.attach).parameters.items() if n != "model"}
    fields = {f.name: f.default for f in dataclasses.fields(Options)}
    assert parameters.pop("engine") is None  # a profile that fills some of the options, never one itself
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


def _imported_names(path: pathlib.Path) -> list[str]:
    """Every ``mtp_hooks`` name ``path`` imports, in full: ``from mtp_hooks import _mcore`` is ``mtp_hooks._mcore``,
    ``from mtp_hooks.export import hf_weights`` is ``mtp_hooks.export.hf_weights`` (type-checking imports too)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] == "mtp_hooks"]


def _wing_imports(folder: str) -> list[tuple[str, str]]:
    """(module file, imported name) for every ``mtp_hooks`` import of the modules in ``folder`` and its subfolders."""
    return [(str(path.relative_to(PACKAGE)), name) for path in sorted((PACKAGE / folder).rglob("*.py")) for name in _imported_names(path)]


def _public_names(package: str) -> set[str]:
    """``package``'s ``__all__``, read from its ``__init__.py`` (nothing is imported)."""
    for node in ast.parse((PACKAGE / package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"mtp_hooks/{package}/__init__.py has no __all__")


def test_testing_builds_from_public_faces() -> None:
    """``testing`` (tiny models, twins, engine checkpoints) imports no option module, not the mcore seam, and of
    ``export`` only the names ``mtp_hooks.export.__all__`` lists, through ``mtp_hooks.export`` itself."""
    export = {f"mtp_hooks.export.{name}" for name in _public_names("export")}
    inside = [
        (f, n) for f, n in _wing_imports("testing")
        if n.startswith(("mtp_hooks.features", "mtp_hooks._mcore")) or (n.startswith("mtp_hooks.export.") and n not in export)
    ]
    assert not inside, f"mtp_hooks/testing imports internals {inside}; use public names (mtp_hooks.export's __all__, ...)"


def test_engine_imports_only_errors_and_itself() -> None:
    """``engine`` runs in a vLLM worker, which has no megatron-core: it imports the exception types and its own
    modules only (not even the ``mtp_hooks`` face)."""
    foreign = [(f, n) for f, n in _wing_imports("engine") if not n.startswith(("mtp_hooks.errors", "mtp_hooks.engine"))]
    assert not foreign, f"mtp_hooks/engine imports {foreign}; it may import only mtp_hooks.errors and mtp_hooks.engine.*"


def test_predict_reaches_the_hooks_through_public_seams() -> None:
    """``predict`` reads the hooks' plan from the handle (``MTPHooks.draft_plan()``) and an MTP layer's body from
    ``models.mtp_layer_body``: no option module, not the switchboard, not the mcore seam."""
    inside = [(f, n) for f, n in _wing_imports("predict") if n.startswith(("mtp_hooks.features", "mtp_hooks._mcore", "mtp_hooks.hooks"))]
    assert not inside, f"mtp_hooks/predict imports {inside}"
