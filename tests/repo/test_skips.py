"""The skips docs/install.md quotes for the test command are the suite's, reason by reason.

The table there gives, on the default stack, how many tests skip for each reason and where they run
instead; the counts line above it (a recorded run) quotes the total. One subprocess counts what the whole
suite would skip without running it (``tests/repo/skip_census.py``): the skips decided when the tests are
collected, exactly, and the few tests that skip from their own body, by running those alone (a few seconds).
A skip raised anywhere else at run time would escape that count, so the suite is checked to have none.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch

import megatron.core

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # about 30 s on 2 idle cores: the whole suite's collection, then a dozen tests

# Where a skipped test runs instead, by what its reason names (the table's last column).
OWN_ENVIRONMENTS = ("make test-megatron-bridge", "make test-bridges", "make test-engine", "make test-verl")
OTHER_RELEASES = "make matrix"
CUDA = "a machine with a GPU"


def _default_stack_missing() -> Optional[str]:
    """Why this environment is not the default stack the table describes, or None."""
    pinned = re.search(r"^megatron-core==(\S+)", (ROOT / "requirements" / "py311.txt").read_text(), re.M)
    if pinned is None or megatron.core.__version__ != pinned.group(1):
        return f"megatron-core {megatron.core.__version__}, not the default stack's"
    if torch.cuda.is_available():
        return "a CUDA device is visible"
    for module in ("mbridge", "verl", "vllm"):
        if importlib.util.find_spec(module) is not None:
            return f"{module} is installed"
    if importlib.util.find_spec("megatron.bridge") is not None:
        return "megatron-bridge is installed"
    return None


DEFAULT_STACK_MISSING = _default_stack_missing()
on_default_stack = pytest.mark.skipif(
    DEFAULT_STACK_MISSING is not None,
    reason="docs/install.md's skips are the default stack's (megatron-core on CPU, no bridges, verl or vLLM): "
    f"{DEFAULT_STACK_MISSING}",
)


def where(reason: str) -> str:
    """The table row a skip's reason belongs to."""
    for target in OWN_ENVIRONMENTS:
        if target in reason:
            return target
    if "CUDA" in reason:
        return CUDA
    if "megatron-core" in reason:
        return OTHER_RELEASES
    raise AssertionError(f"a skip docs/install.md's table has no row for: {reason!r}")


def printed_section() -> str:
    """docs/install.md's "What the test command prints"."""
    text = (ROOT / "docs" / "install.md").read_text()
    return text.split("\n## What the test command prints\n", 1)[1].split("\n## ", 1)[0]


def install_doc() -> str:
    return " ".join(printed_section().split())


def quoted_table() -> dict[str, int]:
    """``{where: tests}`` from the table of docs/install.md's "What the test command prints"."""
    section = printed_section()
    rows = re.findall(r"^\| (.+?) \| (\d+) \| (.+?) \|$", section, re.M)
    table: dict[str, int] = {}
    for _, tests, column in rows:
        target = re.fullmatch(r"`(make [a-z0-9-]+)`", column)
        key = target.group(1) if target else column
        assert key not in table, f"two rows for {key}"
        table[key] = int(tests)
    return table


def census(tmp_path: Path) -> dict[str, Counter[str]]:
    """What the whole suite skips here, by reason, decided when collected and while running."""
    out = tmp_path / "skip-census.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SKIP_CENSUS_OUT"] = str(out)
    for name in ("MTP_HOOKS_ENGINE_TESTS", "PYTHONWARNINGS"):  # the engine's switch; warnings as a user gets them
        env.pop(name, None)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # its own process group
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.repo.skip_census", "tests"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    found = json.loads(out.read_text())
    return {when: Counter(found[when]) for when in ("collected", "running")}


@on_default_stack
def test_the_quoted_skips_are_the_suites(tmp_path: Path) -> None:
    table, text = quoted_table(), install_doc()
    counts = re.search(r"`(\d+) passed, (\d+) skipped, (\d+) xfailed(?:, \d+ warnings)? in [^`]+`", text)
    assert counts, "docs/install.md quotes no counts of the test command"
    assert sum(table.values()) == int(counts.group(2)), (table, counts.group(0))
    assert set(table) == {*OWN_ENVIRONMENTS, OTHER_RELEASES, CUDA}, sorted(table)

    found = census(tmp_path)
    by_row: Counter[str] = Counter()
    releases = Counter()
    for when, reasons in found.items():
        for reason, n in reasons.items():
            by_row[where(reason)] += n
            if where(reason) == OTHER_RELEASES:
                releases[when] += n
    assert dict(by_row) == table, f"docs/install.md's table: {table}\nthe suite skips: {dict(by_row)}\n{found}"
    split = re.search(r"\((\d+) decided when collected, (\d+) while the test runs\)", text)
    assert split, "docs/install.md no longer says how many release skips are decided when collected"
    assert (int(split.group(1)), int(split.group(2))) == (releases["collected"], releases["running"]), releases


def _skip_calls(tree: ast.AST) -> list[tuple[ast.Call, list[str]]]:
    """Each ``pytest.skip(...)`` / ``pytest.importorskip(...)`` call with the names of the functions around it."""
    found = []

    def visit(node: ast.AST, functions: list[str]) -> None:
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest":
            if func.attr in ("skip", "importorskip"):
                found.append((node, functions))
        inner = functions + [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else functions
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, [])
    return found


def test_skips_at_run_time_come_only_from_test_bodies() -> None:
    """Every ``pytest.skip`` of the suite is decided at collection (module level, ``allow_module_level``)
    or in a test's own body, the two places the census sees; none hides in a fixture or a helper."""
    hidden = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for call, functions in _skip_calls(ast.parse(path.read_text(), filename=str(path))):
            module_level = any(k.arg == "allow_module_level" for k in call.keywords) or not functions
            if not module_level and not (len(functions) == 1 and functions[0].startswith("test")):
                hidden.append(f"{path.relative_to(ROOT)}:{call.lineno} (in {'.'.join(functions)})")
    assert not hidden, f"skips the census of docs/install.md's table cannot see: {hidden}"
