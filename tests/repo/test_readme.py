"""The README starts short: under 12 KB, the rest in docs/, and every link from it (and from the docs it
hands its longer parts to) reaches a file of this repository and, where it names one, a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT_BYTES = 12 * 1024
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", markdown, re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def test_readme_is_under_12_kb() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size < README_LIMIT_BYTES, f"README.md is {size:,} bytes, over {README_LIMIT_BYTES:,}: move detail to docs/"


@pytest.mark.parametrize("page", ["README.md", "docs/install.md", "docs/quickstart.md"])
def test_links_reach_a_file_and_its_heading(page: str) -> None:
    source = ROOT / page
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page}: " + "; ".join(broken)
