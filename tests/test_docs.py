"""The repository documents itself: code cites docs/ in this repo, and what it cites exists.

A comment that cites a document users do not have (the design notes and specs the project was
built from) tells a reader nothing; a citation of a doc or section that was renamed sends them
nowhere. Citations read `docs/NAME.md` or `docs/NAME.md, Section heading`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("ds4", "tests", "tools")
SUFFIXES = {".py", ".cu", ".cuh", ".md", ".txt", ".toml", ".cfg"}
OWN_DOCS = ("ARCHITECTURE.md", "MODEL.md", "PROTOCOLS.md")
# Ways the code used to cite the outside documents: their paths and file names, section signs,
# and "spec 3.4" / "spec encoding" style references.
OUTSIDE = re.compile(
    r"(?<!docs/)\b(?:encoding|server|model)\.md\b|spec/|\.\./shared|DESIGN\.md|§"
    r"|\bspec\s*(?:\d|encoding\b|server\b|model\b)|\bthe spec\b|\bspec's\b")
CITATION = re.compile(r"docs/([A-Za-z_]+\.md)(?:, (.*))?")
HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)
# `ds4/server/app.py:build_app`, `ds4/engine.py:Session.snapshot` in the docs' prose
CODE_REF = re.compile(r"\b((?:ds4|tools|tests)/[\w/]+\.py):([A-Za-z_][\w.]*)")


def scanned_files() -> list[Path]:
    """Text files of ds4/, tests/ and tools/ (this file names the patterns it looks for)."""
    here = Path(__file__).resolve()
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*")
                  if p.is_file() and p.suffix in SUFFIXES and p.resolve() != here)


def lines_of(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a file."""
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


def headings(doc: Path) -> list[str]:
    """Every heading of a Markdown file, without its #s."""
    return HEADING.findall(doc.read_text(encoding="utf-8"))


def names_a_heading(rest: str, titles: list[str]) -> bool:
    """True when `rest` (what follows "docs/X.md, ") starts with one of the titles as a whole."""
    rest = rest.strip().strip('"')
    return any(rest.startswith(t) and not rest[len(t):len(t) + 1].isalnum() for t in titles)


def defines(source: str, name: str) -> bool:
    """True when a def, class or assignment of `name` appears in the source."""
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]",
                     source, re.MULTILINE) is not None


def test_no_file_cites_a_document_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in scanned_files() for n, line in lines_of(p) if OUTSIDE.search(line)]
    assert not found, "cite docs/ARCHITECTURE.md, MODEL.md or PROTOCOLS.md instead:\n" + \
        "\n".join(found)


def test_every_cited_doc_and_section_exists():
    broken = []
    for p in scanned_files():
        for n, line in lines_of(p):
            for match in CITATION.finditer(line):
                doc = ROOT / "docs" / match.group(1)
                where = f"{p.relative_to(ROOT)}:{n}"
                if not doc.is_file():
                    broken.append(f"{where}: no docs/{match.group(1)}")
                elif match.group(2) and not names_a_heading(match.group(2), headings(doc)):
                    broken.append(f"{where}: docs/{match.group(1)} has no section "
                                  f"{match.group(2)!r}")
    assert not broken, "\n".join(broken)


def test_there_are_citations_to_check():
    cited = {m.group(1) for p in scanned_files() for _, line in lines_of(p)
             for m in CITATION.finditer(line)}
    assert set(OWN_DOCS) <= cited


@pytest.mark.parametrize("name", OWN_DOCS)
def test_code_a_doc_names_exists(name):
    """Each `path.py:name` a doc mentions is a file defining that name (and its method)."""
    missing = []
    for path, dotted in CODE_REF.findall((ROOT / "docs" / name).read_text(encoding="utf-8")):
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
            continue
        source = file.read_text(encoding="utf-8")
        missing += [f"{path}:{dotted}" for part in dotted.split(".") if not defines(source, part)]
    assert not missing, f"docs/{name} names code that is not there:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", OWN_DOCS)
def test_a_doc_s_quoted_sections_exist(name):
    """`OTHER.md, "Section"` inside a doc names a heading of that doc."""
    text = (ROOT / "docs" / name).read_text(encoding="utf-8")
    wrong = [f"{doc}, {title!r}" for doc, title in
             re.findall(r"\b([A-Z]+\.md), \"([^\"]+)\"", text)
             if title not in headings(ROOT / "docs" / doc)]
    wrong += [f"{title!r}" for title in re.findall(r"\(see \"([^\"]+)\"\)", text)
              if title not in headings(ROOT / "docs" / name)]
    assert not wrong, f"docs/{name} cites sections that do not exist: {wrong}"
