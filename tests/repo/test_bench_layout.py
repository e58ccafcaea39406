"""``benchmarks/`` holds three benchmarks with no import cycle: the cost benchmark (``benchmarks``) never
imports the acceptance benchmark (``benchmarks.acceptance``) nor the rollout-speed benchmark built on its word task
(``benchmarks.rollout_speed``), the acceptance benchmark never imports the rollout-speed one, and no module imports
another's private names. Read from the source (every ``import``, also inside functions), so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "benchmarks"
ACCEPTANCE = "benchmarks.acceptance"
ROLLOUT_SPEED = "benchmarks.rollout_speed"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imports(path: Path, known: set[str], roots: tuple[str, ...] = (PACKAGE,)) -> list[tuple[str, str]]:
    """``(module, name)`` for every import in ``path`` of a module under ``roots``; ``name`` is the
    imported attribute (``""`` for a module imported whole)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] in roots]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                out.append((submodule, "") if submodule in known else (node.module, alias.name))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target, _ in imports(path, set(known))} - {name} for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as the modules along it (empty if there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_benchmarks_have_no_import_cycle() -> None:
    edges = graph()
    assert len(edges) > 20 and any(ACCEPTANCE in target for target in edges[f"{ACCEPTANCE}.experiment"])
    assert cycle(edges) == []


def test_cost_benchmark_never_imports_the_acceptance_benchmark() -> None:
    wrong = {name: sorted(t for t in targets if t.startswith((ACCEPTANCE, ROLLOUT_SPEED)))
             for name, targets in graph().items() if not name.startswith((ACCEPTANCE, ROLLOUT_SPEED))}
    assert {name: targets for name, targets in wrong.items() if targets} == {}


def test_acceptance_benchmark_never_imports_the_rollout_speed_benchmark() -> None:
    edges = graph()
    assert any(ACCEPTANCE in target for target in edges[f"{ROLLOUT_SPEED}.run"])
    wrong = {name: sorted(t for t in targets if t.startswith(ROLLOUT_SPEED)) for name, targets in edges.items() if name.startswith(ACCEPTANCE)}
    assert {name: targets for name, targets in wrong.items() if targets} == {}


def test_no_benchmark_imports_a_private_name_of_another_module() -> None:
    """Neither of ``benchmarks`` nor of the library (``mtp_hooks``): what a benchmark needs is public."""
    known = modules()
    private = [f"{name}: {target} {attribute}".rstrip() for name, path in known.items()
               for target, attribute in imports(path, set(known), roots=(PACKAGE, "mtp_hooks"))
               if any(part.startswith("_") for part in (*target.split("."), attribute))]
    assert private == []
