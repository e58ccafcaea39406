"""The install path the README documents: the floors in pyproject.toml are the versions CI runs.

``scripts/check_install.sh`` (run by ``.ci/run``) runs the README's install commands in a fresh
virtualenv; this test pins what they rely on without installing anything.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", requirement.replace(" ", ""))
        assert match, f"dependency without a >= floor: {requirement!r}"
        floors[match.group(1).lower()] = match.group(2)
    return floors


def _requirements(requirements: list[str]) -> dict[str, str]:
    """``name>=floor`` entries of pyproject.toml, by lower-case name."""
    parsed = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.replace(" ", ""))
        assert match, f"requirement without a plain >= floor: {requirement!r}"
        parsed[match.group(1).lower()] = match.group(2)
    return parsed


def _same_release(floor: str, pin: str) -> bool:
    """``2.13`` names the same release as ``2.13.0``."""
    pad = lambda v: tuple(int(p) for p in v.split(".")) + (0,) * (3 - len(v.split(".")))  # noqa: E731
    return pad(floor) == pad(pin)


def test_torch_and_wrapt_floors_are_the_pinned_default_stack() -> None:
    floors, pins = _floors(), _pins(ROOT / "requirements" / "py311.txt")
    for name in ("torch", "wrapt"):
        assert _same_release(floors[name], pins[name]), (name, floors[name], pins[name])


def test_extras_floors_are_releases_of_the_pinned_default_stack() -> None:
    """``pytest>=9.2`` against ``pytest==9.2.0``: each extra's floor is the pinned release or a prefix of it."""
    pins = _pins(ROOT / "requirements" / "py311.txt")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        for name, floor in _requirements(requirements).items():
            if name in pins:
                assert pins[name] == floor or pins[name].startswith(floor + "."), (extra, name, floor, pins[name])


def test_test_extra_brings_every_pinned_package_the_suite_imports() -> None:
    """After the README's install (``pip install -e ".[test]"``) no test skips or fails for a missing
    package: each package of the pinned default stack that tests/ or the code they run (benchmarks/,
    examples/) imports or looks for (``find_spec``, ``importorskip``) is a dependency or in ``[test]``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    brought = {name.replace("-", "_") for name in set(_floors()) | set(_requirements(project["optional-dependencies"]["test"]))}
    pinned = {name.replace("-", "_") for name in _pins(ROOT / "requirements" / "py311.txt")}
    found = set()
    for folder in ("tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            found |= set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z0-9_]+)", text, re.M))
            found |= set(re.findall(r"""(?:find_spec|importorskip)\(\s*["']([A-Za-z0-9_]+)""", text))
    assert {"pytest", "tokenizers", "matplotlib"} <= found, "the scan no longer finds imports it must find"
    missing = sorted(name for name in found if name.lower() in pinned and name.lower() not in brought)
    assert not missing, f"the suite imports {missing}, which requirements/py311.txt pins but neither the dependencies nor [test] bring"


def test_megatron_core_floor_is_the_oldest_release_ci_runs() -> None:
    floors = _floors()
    tested = sorted(
        (tuple(int(p) for p in m.group(1).split(".")), m.group(1))
        for m in (re.fullmatch(r"mcore-([0-9.]+)\.txt", p.name) for p in (ROOT / "requirements").iterdir())
        if m
    )
    assert tested, "no requirements/mcore-<version>.txt"
    assert _same_release(floors["megatron-core"], tested[0][1]), (floors["megatron-core"], tested[0][1])
    assert tested[0][1] in (ROOT / ".ci" / "run").read_text()


def test_python_floor_is_the_default_stacks_python() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "PYTHON ?= python3.11" in (ROOT / "Makefile").read_text()


def test_readme_install_installs_torch_first_and_constrains_to_ci_stack() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    script = (ROOT / "scripts" / "check_install.sh").read_text()
    assert 'pip install -e ".[test]" -c requirements/py311.txt' in install
    assert '-e ".[test]" -c requirements/py311.txt' in script
    assert "torch" in install.split('pip install -e ".[test]"', 1)[0], "torch must come before mtp_hooks"
    assert "make install-check" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/check_install.sh" in (ROOT / "Makefile").read_text().split("install-check:", 1)[1].split("\n\n", 1)[0]


def test_ci_runs_every_readme_command() -> None:
    """Each command the README's Commands table names is run by .ci/run (quick forms where it has them)."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = sorted(set(re.findall(r"^\| `(make [a-z0-9-]+)", readme.split("## Commands", 1)[1].split("\n## ", 1)[0], re.M)))
    assert "make demo" in commands and "make bench" in commands, commands
    for command in commands:
        assert re.search(rf"^[^#]*{command}\b", ci, re.M), f"{command} is in the README's Commands table but .ci/run does not run it"
    assert 'BENCH_ARGS="--quick' in ci and 'ACCEPTANCE_ARGS="--quick' in ci


def test_readme_install_ends_with_the_test_command_and_its_skips_add_up() -> None:
    """The Install block's last command runs the suite as ``make test`` does, and the counts the README says
    it prints are consistent: the skips it accounts for add up to the skipped count it quotes."""
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    block = install.split("```bash", 1)[1].split("```", 1)[0]
    last = [line.split("#")[0].strip() for line in block.strip().splitlines()][-1]
    assert last == "python -m pytest -q", last
    make_test = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest -q" in make_test, make_test
    text = " ".join(install.split())
    counts = re.search(r"`(\d+) passed, (\d+) skipped, (\d+) xfailed(?:, \d+ warnings)? in [^`]+`", text)
    assert counts, "the README quotes no counts of the test command"
    skipped = int(counts.group(2))
    own_env = [int(n) for n in re.findall(r"\((\d+), `make test-[a-z-]+`\)", text)]
    others = re.search(r"Every skip prints its reason: (\d+) of them run in environments of their own", text)
    releases = re.search(r"(\d+) test what other megatron-core releases have", text)
    assert others and releases and len(own_env) == 4, text
    assert sum(own_env) == int(others.group(1)), (own_env, others.group(1))
    assert int(others.group(1)) + int(releases.group(1)) + 1 == skipped  # + the one needing a CUDA device
