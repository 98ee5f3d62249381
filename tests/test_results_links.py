"""The benchmark results' links: every ``benchmarks/...`` path the docs name exists, the notebook
archive's file links survive its move, and ``benchmarks/results/`` holds only what today's
tables cite (the rest lives under ``benchmarks/archive/results/``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
ARCHIVE = ROOT / "benchmarks" / "archive" / "RESULTS-history.md"
DOCS = (RESULTS, ROOT / "README.md", ROOT / "CONTRIBUTING.md")

# a repository path as the docs write it: a file, a folder (trailing /) or a glob (* [..])
PATH = re.compile(r"benchmarks/[\w.*/\[\]-]*")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def named_paths(text: str, prefix: str = "benchmarks/") -> set[str]:
    """The repository paths under ``prefix`` that ``text`` names, sentence punctuation off."""
    return {m.group(0).rstrip(".:,") for m in PATH.finditer(text) if m.group(0).startswith(prefix)}


def matches(path: str) -> list[Path]:
    """The files or folders ``path`` (a path or a glob relative to the root) names."""
    if any(c in path for c in "*["):
        return sorted(ROOT.glob(path))
    full = ROOT / path
    return [full] if full.exists() else []


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_named_paths_reads_files_folders_and_globs():
    text = "see `benchmarks/results/h200/session26_*`, benchmarks/e2e.py. and benchmarks/results/"
    assert named_paths(text) == {
        "benchmarks/results/h200/session26_*",
        "benchmarks/e2e.py",
        "benchmarks/results/",
    }
    assert named_paths(text, "benchmarks/results/h200") == {"benchmarks/results/h200/session26_*"}
    assert matches("benchmarks/no_such_file.json") == []
    assert matches("benchmarks/e2e.py") == [ROOT / "benchmarks/e2e.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_benchmarks_path_the_docs_name_exists(doc: Path):
    missing = sorted(p for p in named_paths(doc.read_text()) if not matches(p))
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_archive_links_to_files_that_exist():
    text = ARCHIVE.read_text()
    links = named_paths(text, "benchmarks/results/") | named_paths(text, "benchmarks/archive/")
    assert len(links) > 20  # the notebook cites its raw files throughout
    missing = sorted(p for p in links if not matches(p))
    assert not missing, f"the archive names raw files that do not exist: {missing}"


@pytest.mark.parametrize("doc", (RESULTS, ARCHIVE), ids=lambda p: p.name)
def test_relative_markdown_links_resolve(doc: Path):
    text = doc.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for target, _ in MD_LINK.findall(text):
        if not target.startswith(("http:", "https:")):
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in anchors, f"{doc.name}: no heading for #{anchor}"


def test_results_holds_only_what_todays_tables_cite():
    """A raw file stays in benchmarks/results/ while RESULTS.md (or README) cites it; when its
    table is replaced it moves to benchmarks/archive/results/ with the old table."""
    cited: set[Path] = set()
    for doc in (RESULTS, ROOT / "README.md"):
        for path in named_paths(doc.read_text(), "benchmarks/results/"):
            if path.rstrip("/") == "benchmarks/results":
                continue
            for hit in matches(path):
                cited.update(hit.rglob("*") if hit.is_dir() else [hit])
    files = {p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()}
    assert files, "benchmarks/results/ is empty"
    uncited = sorted(str(p.relative_to(ROOT)) for p in files - cited)
    assert not uncited, f"uncited raw files (move them to benchmarks/archive/results/): {uncited}"
