"""The install path the README documents: the floors in pyproject.toml are the versions CI runs.

``scripts/check_install.sh`` (run by ``.ci/run``) runs the README's install commands in a fresh
virtualenv; this test pins what they rely on without installing anything.
"""

from __future__ import annotations

import http.server
import importlib.util
import re
import socket
import socketserver
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest

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
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PYTHON +\?= python3\.11$", makefile, re.M), "the Makefile's default PYTHON is not python3.11"


def _readme_install() -> str:
    """The README's Install section."""
    return (ROOT / "README.md").read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def _bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block of ``text``, comments and blank lines dropped."""
    blocks = [block.split("```", 1)[0] for block in text.split("```bash\n")[1:]]
    commands = [[line.split("#")[0].strip() for line in block.splitlines()] for block in blocks]
    return [[command for command in block if command] for block in commands]


def _make_rule(target: str) -> str:
    """The Makefile rule of ``target``: its prerequisites line and recipe."""
    return (ROOT / "Makefile").read_text().split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]


def _default_torch_index() -> str:
    found = re.search(r"^TORCH_INDEX \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile sets no default TORCH_INDEX"
    return found.group(1)


def test_readme_install_starts_with_make_demo_and_make_test() -> None:
    """The Install section's first commands are the two make targets: the main job, then the suite; both
    build .venv first (make venv), and the pip path comes after them."""
    install = _readme_install()
    blocks = _bash_blocks(install)
    assert install.startswith("```bash\n") and blocks[0] == ["make demo", "make test"], install[:200]
    assert len(blocks) == 2 and blocks[1][0].startswith("python3.11 -m venv .venv"), blocks
    demo, test = _make_rule("demo"), _make_rule("test")
    assert demo.split("\n", 1)[0].split("##")[0].split() == ["venv"] and "-m benchmarks.demo" in demo, demo
    assert test.split("\n", 1)[0].split("##")[0].split() == ["venv"] and "-m pytest -q" in test, test
    assert "scripts/venv.sh" in (ROOT / "Makefile").read_text().split("/.installed:", 1)[1].split("\n\n", 1)[0]


def test_readme_install_installs_torch_first_and_constrains_to_ci_stack() -> None:
    """The pip path, exactly: torch CI's version from the CPU wheel index as an extra index (the index the
    make targets and scripts/check_install.sh default to), then mtp_hooks constrained to CI's stack, then the
    suite as ``make test`` runs it. ``make`` after it keeps that .venv (scripts/venv.sh checks the stack with
    scripts/check_stack.py first)."""
    install = _readme_install()
    torch_pin = _pins(ROOT / "requirements" / "py311.txt")["torch"]
    index = _default_torch_index()
    assert index == "https://download.pytorch.org/whl/cpu", index
    assert _bash_blocks(install)[1] == [
        "python3.11 -m venv .venv && . .venv/bin/activate",
        f"pip install torch=={torch_pin} --extra-index-url {index}",
        'pip install -e ".[test]" -c requirements/py311.txt',
        "python -m pytest -q",
    ], _bash_blocks(install)[1]
    for name in ("check_install.sh", "venv.sh"):
        script = (ROOT / "scripts" / name).read_text()
        assert f'TORCH_INDEX="${{TORCH_INDEX:-{index}}}"' in script, name
        assert '$("$PYTHON" scripts/torch_index.py "$TORCH_INDEX")' in script, name  # the index, where it answers
        assert '-e ".[test]" -c requirements/py311.txt' in script, name
        assert "scripts/check_stack.py" in script, name
    assert f"torch=={torch_pin}" in (ROOT / "scripts" / "check_install.sh").read_text()
    assert f'TORCH_VERSION="${{TORCH_VERSION:-{torch_pin}}}"' in (ROOT / "scripts" / "venv.sh").read_text()
    assert "scripts/venv.sh" in install and "scripts/check_stack.py" in install, "the README no longer says make keeps .venv"
    assert "make install-check" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/check_install.sh" in _make_rule("install-check")


def _documented_commands() -> list[tuple[str, str]]:
    """(command, what it does) for each row of docs/development.md's Commands table."""
    text = (ROOT / "docs" / "development.md").read_text()
    table = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(make [a-z0-9-]+)` \|(.*)\|$", table, re.M)


def test_ci_runs_every_documented_command() -> None:
    """Each command of docs/development.md's Commands table is run by .ci/run (quick forms where it has them),
    but those the table says CI does not run, which .ci/run then must not run either."""
    ci = (ROOT / ".ci" / "run").read_text()
    rows = _documented_commands()
    commands = sorted({command for command, _ in rows})
    assert {"make demo", "make test", "make bench", "make install-check"} <= set(commands), commands
    for command, what in rows:
        run = re.search(rf"^[^#]*{command}\b", ci, re.M)
        if "not run by CI" in what:
            assert not run, f"{command}: docs/development.md says CI does not run it, but .ci/run does"
        else:
            assert run, f"{command} is in docs/development.md's Commands table but .ci/run does not run it"
    assert 'BENCH_ARGS="--quick' in ci and 'ACCEPTANCE_ARGS="--quick' in ci


def test_every_make_command_the_readme_names_is_documented() -> None:
    """The README names a few make targets; each is a row of docs/development.md's Commands table."""
    named = set(re.findall(r"`(make [a-z0-9-]+)", (ROOT / "README.md").read_text()))
    documented = {command for command, _ in _documented_commands()}
    assert {"make demo", "make test"} <= named, named
    assert named <= documented, sorted(named - documented)


def _torch_index() -> Any:
    spec = importlib.util.spec_from_file_location("torch_index", ROOT / "scripts" / "torch_index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_index_is_passed_to_pip_where_it_answers_and_dropped_where_it_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``scripts/torch_index.py``: an index that answers (any HTTP status) is pip's extra index; one out of
    reach is dropped with a line saying so, so pip spends no retries on it."""
    torch_index = _torch_index()

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)  # an answer all the same
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Answer) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        try:
            assert torch_index.main_args(url) == ["--extra-index-url", url]
        finally:
            server.shutdown()
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}/whl/cpu"
    assert torch_index.main_args(gone) == []
    assert "out of reach" in capsys.readouterr().err
    assert torch_index.main_args("") == []
