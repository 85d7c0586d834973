"""The README is the front door and the manual lives in docs/: the README starts with the two commands and stays
short, every link it makes lands on a file and a heading that exist, and mkdocs.yml's nav holds every page of the
manual (`make docs` checks the links between pages: mkdocs --strict)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300
#: A Markdown link's target: [text](target), not an image's.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (code spans count as their text), outside fenced code."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            found.add(slugify(heading.group(1).replace("`", ""), "-"))
    return found


def test_the_readme_starts_with_the_two_commands_and_stays_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the manual is docs/"
    first_block = lines[lines.index("```sh") + 1:lines.index("```")]
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]
    assert lines.index("```sh") < 5


def test_every_link_of_the_readme_lands_on_a_file_and_a_heading() -> None:
    targets = LINK.findall(README.read_text())
    assert any(t.startswith("docs/") for t in targets)  # the front door points into the manual
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        if re.match(r"\w+://", target) or not path:
            continue
        page = ROOT / path
        if not page.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(page):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"README.md links to what is not there: {broken}"


def test_the_nav_holds_every_page_of_the_manual() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = [page for entry in nav for page in entry.values()]
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md")), "mkdocs.yml's nav against docs/*.md"
    assert listed[0] == "index.md"


def test_the_anchor_reader_sees_what_mkdocs_makes() -> None:
    assert {"a-real-card-make-gpu-check", "benchmarks"} <= anchors(DOCS / "benchmarks.md")
