"""Every link in README.md, deploy/README.md and docs/*.md points at something: a relative link
at a file or folder of the repository (and, with a #fragment, at a heading of that file);
an external link is a well-formed https address (the tests run offline)."""

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from support import ROOT

DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "deploy" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"(?<!`)!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, code blocks and inline code left out."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            found += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            out.add(slug)
    return out


def broken(path: Path, target: str) -> str | None:
    if target.startswith(("http://", "https://")):
        parts = urlparse(target)
        return None if parts.scheme == "https" and parts.netloc else "not an https address"
    if target.startswith("mailto:"):
        return None
    file_part, _, fragment = target.partition("#")
    destination = (path.parent / unquote(file_part)).resolve() if file_part else path
    if not destination.exists():
        return "no such file"
    if fragment and destination.suffix == ".md" and fragment not in anchors(destination):
        return f"no heading #{fragment}"
    return None


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_the_document_resolves(path):
    bad = [(t, why) for t in links(path) if (why := broken(path, t)) is not None]
    assert bad == []


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Title\n\n[ok](#title) [gone](b.md) [no heading](#nothing) `[code](x.md)`\n")
    assert [(t, broken(doc, t)) for t in links(doc)] == [
        ("#title", None),
        ("b.md", "no such file"),
        ("#nothing", "no heading #nothing"),
    ]


def test_the_readme_fits_on_a_screen_or_two():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
