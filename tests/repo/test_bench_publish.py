"""``python -m benchmarks --publish``: the result tables go to BENCHMARKS.md only; the README gets the
headline line alone and docs/api.md the trainer paragraph, each between its markers."""

from __future__ import annotations

import pathlib

import pytest

from benchmarks import run
from benchmarks.configs import CONFIGS


def test_publish_writes_the_tables_to_benchmarks_md_and_one_headline_line_to_the_readme(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("intro\n<!-- bench:cpu -->\nold\n<!-- /bench:cpu -->\nrest\n")
    (tmp_path / "docs" / "api.md").write_text("api\n<!-- trainer:cpu -->\nold\n<!-- /trainer:cpu -->\n")
    png = tmp_path / "bench_cpu.png"
    png.write_bytes(b"png")
    monkeypatch.setattr(run, "ROOT", tmp_path)
    tables = "**the headline**\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![plot](bench_cpu.png)\n"
    written = run.publish(CONFIGS["cpu"], tables, png, "**the headline**", "the trainer paragraph\n")
    readme = (tmp_path / "README.md").read_text()
    assert readme == "intro\n<!-- bench:cpu -->\n**the headline**\n<!-- /bench:cpu -->\nrest\n"
    assert (tmp_path / "docs" / "api.md").read_text() == "api\n<!-- trainer:cpu -->\nthe trainer paragraph\n<!-- /trainer:cpu -->\n"
    results = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| 1 | 2 |" in results and "](docs/bench_cpu.png)" in results
    assert (tmp_path / "docs" / "bench_cpu.png").read_bytes() == b"png"
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {"docs/bench_cpu.png", "BENCHMARKS.md", "README.md", "docs/api.md"}


def test_the_readme_carries_the_headline_and_no_result_table() -> None:
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- bench:cpu -->\n", 1)[1].split("<!-- /bench:cpu -->", 1)[0]
    assert block.startswith("**lean vs stock:") and block.count("\n") == 1, block
