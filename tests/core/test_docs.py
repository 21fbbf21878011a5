"""The docs hold together: docs/architecture.md maps every module and folder of the code and
names only paths that exist, every relative link of the README and docs/ reaches a file of the
repository (and a heading, where it names one), every citation of the contract names a section
of docs/contract.md, and nothing points outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAP = DOCS / "architecture.md"
CONTRACT = DOCS / "contract.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# The folders whose every module and subfolder the map must name.
MAPPED = ("attnreg", "backends", "shaders", "kernels_cl")
# Where the project's own text lives (ci/results holds measured outputs, kept as they were).
TEXT_ROOTS = ("attnreg", "backends", "shaders", "kernels_cl", "tests", "bench", "ci", "docs")
TEXT_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".wgsl", ".cl", ".js", ".html", ".c", ".sh", ".toml", ".json", ""}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# `attnreg/spec.py`, `ci/results/`: a repository path named in backticks
NAMED_PATH = re.compile(r"`((?:attnreg|backends|shaders|kernels_cl|tests|bench|ci|docs)/[^`\s*<>]*)`")
# docs/contract.md "Section", contract.md, "Section" (a citation may wrap across comment lines)
CITATION = re.compile(r'contract\.md,?\s+"([^"]+)"')


def _skipped(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info") for p in parts)


def _code_paths() -> set[str]:
    """Every module (any file) and folder under the mapped folders, repository-relative."""
    found = set()
    for top in MAPPED:
        for p in (ROOT / top).rglob("*"):
            if not _skipped(p) and p.suffix != ".pyc":
                found.add(p.relative_to(ROOT).as_posix())
        found.add(top)
    return found


def _links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link on a page (the path '' for one on the page itself)."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a linked heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _headings(page: Path) -> list[str]:
    """The headings of a markdown page (not the comment lines of its code blocks)."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return HEADING.findall(prose)


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _headings(page)}


def _repo_relative(page: Path, path: str) -> str:
    return (page.parent / path).resolve().relative_to(ROOT).as_posix().rstrip("/")


def _text_files() -> list[Path]:
    files = [ROOT / n for n in TEXT_FILES]
    for top in TEXT_ROOTS:
        for p in (ROOT / top).rglob("*"):
            rel = p.relative_to(ROOT).as_posix()
            if p.is_file() and not _skipped(p) and p.suffix in TEXT_SUFFIXES \
                    and not rel.startswith("ci/results/") and p != Path(__file__).resolve():
                files.append(p)
    return files


def test_the_map_names_every_module_and_folder() -> None:
    linked = {_repo_relative(MAP, path) for path, _ in _links(MAP)
              if path and ROOT in (MAP.parent / path).resolve().parents}
    missing = sorted(_code_paths() - linked)
    assert not missing, f"docs/architecture.md does not map: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_reach_files_and_headings(page: Path) -> None:
    broken = []
    for path, anchor in _links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or ROOT not in (target, *target.parents):
            broken.append(f"{path} (no such file in the repository)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{path}#{anchor} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(page: Path) -> None:
    missing = [p for p in NAMED_PATH.findall(page.read_text()) if not (ROOT / p).exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_contract_citations_name_sections() -> None:
    sections = set(_headings(CONTRACT))
    bad = []
    for f in _text_files():
        for cited in CITATION.findall(f.read_text(errors="replace")):
            # a citation wrapped over comment lines: join it back into one line
            name = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", cited).strip()
            if name not in sections:
                bad.append(f"{f.relative_to(ROOT)}: {name!r}")
    assert not bad, f"citations of sections docs/contract.md does not have: {bad}"


def test_nothing_points_outside_the_repository() -> None:
    # The contract lives in docs/contract.md; the old name and the folder outside the
    # repository it came from must not come back.
    old = re.compile(r"\bCONTRACT\b|\.\./shared\b|/work/shared\b")
    hits = []
    for f in _text_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if old.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "cite docs/contract.md instead:\n" + "\n".join(hits)
