"""Every figure the documents show or name says, beside it, the date and the commit that made it: a reader can tell
how old a picture is and find the code and command behind it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("**/*.md"))]
#: A figure: a markdown image, or a picture's path in a link or in backticks.
PICTURE = r"\.(?:png|svg|jpe?g|gif)"
FIGURE = re.compile(rf"!\[[^\]]*\]\(([^)\s]+)\)|\]\(([^)\s]+{PICTURE})\)|`([^`\s]+{PICTURE})`")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: "commit 25c8cbc", "commits 25c8cbc", "committed with its data in 8488815": the word, then a hash of 7 hex digits or
#: more, with no other number between them.
COMMIT = re.compile(r"\bcommit\w*\D{0,40}?\b[0-9a-f]{7,40}\b")


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """The text's paragraphs (separated by blank lines), each with its first line's number."""
    out, start, lines = [], 1, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            lines = []
    if lines:
        out.append((start, "\n".join(lines)))
    return out


def _figures(document: Path) -> list[tuple[str, str, str]]:
    """``(where, path, nearby)`` of every figure in ``document`` that is a file of the repository (a picture a run
    writes, the quickstart's ``gravac.png``, is none): ``nearby`` is its paragraph and the one before."""
    paragraphs = _paragraphs(document.read_text())
    found = []
    for i, (line, paragraph) in enumerate(paragraphs):
        for match in FIGURE.finditer(paragraph):
            path = next(group for group in match.groups() if group)
            image = match.group(0).startswith("!")
            file = next((f for f in (document.parent / path, ROOT / path) if f.is_file()), None)
            if file is None and not image and not path.startswith(("benchmarks/", "../benchmarks/", "docs/")):
                continue
            assert file is not None, f"{document.name}:{line}: {path} is not a file of the repository"
            before = paragraphs[i - 1][1] if i else ""
            name = document.relative_to(ROOT) if document.is_relative_to(ROOT) else document.name
            found.append((f"{name}:{line}", path, f"{before}\n{paragraph}"))
    return found


FIGURES = [figure for document in DOCUMENTS for figure in _figures(document)]


def test_the_documents_show_figures():
    assert len(FIGURES) >= 4  # the README's and docs/benchmarks.md's matrix, the earlier matrix, the bandwidth plot


@pytest.mark.parametrize(("where", "path", "nearby"), FIGURES, ids=[f"{w} {p}" for w, p, _ in FIGURES])
def test_every_figure_says_the_date_and_commit_that_made_it(where, path, nearby):
    assert DATE.search(nearby), f"{where}: {path} without the date that made it nearby"
    assert COMMIT.search(nearby), f"{where}: {path} without the commit that made it nearby ('commit <7+ hex>')"


def test_a_figure_without_its_date_and_commit_is_found(tmp_path):
    document = tmp_path / "page.md"
    document.write_text(
        "Made on 2026-11-27, commit 25c8cbc.\n\n![the matrix](figure.png)\n\nLater text.\n\n![again](figure.png)\n"
    )
    (tmp_path / "figure.png").write_bytes(b"")
    (first, second) = [nearby for _, _, nearby in _figures(document)]
    assert DATE.search(first) and COMMIT.search(first)
    assert not (DATE.search(second) or COMMIT.search(second))
