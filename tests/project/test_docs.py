"""The README guides and the docs hold what it points to: every relative link of README, CONTRIBUTING and
docs/ reaches an existing file and heading, every figure of README's "Measured" table links to where it was
measured, and README's dependency list is pyproject's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever tests/ puts this file
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks (their ``#`` lines are not headings, their brackets not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("2b. The mmap threshold (quiet run, 2026-12-01 18:19–18:50 UTC)") == \
        "2b-the-mmap-threshold-quiet-run-2026-12-01-18191850-utc"
    assert slug("The `bigger_than_memory` recipe and benchmark") == "the-bigger_than_memory-recipe-and-benchmark"
    assert slug("Where an offloaded step's time goes (issue #14)") == "where-an-offloaded-steps-time-goes-issue-14"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_heading(page: Path):
    broken = []
    for text, target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"[{text}]({target}): no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"[{text}]({target}): no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def test_every_figure_of_the_measured_table_links_to_where_it_was_measured():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| what")]
    assert len(rows) >= 5
    for row in rows:
        measured = row.split(" | ")[1]  # the "measured" column: every figure in it is a link
        figures_outside_links = re.findall(r"\d", LINK.sub("", measured))
        assert LINK.search(measured) and not figures_outside_links, row
        assert all(target.startswith("docs/") for _, target in LINK.findall(measured)), row


def test_readme_dependencies_are_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = readme.split("**Dependencies**", 1)[1].split("\n\n", 1)[0]
    required, extras = paragraph.split("Extras:", 1)
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert set(re.findall(r"`([\w.-]+)`", required.split("):", 1)[1])) == names
    assert set(re.findall(r"`(\w+)` \(", extras)) == set(project["optional-dependencies"])
