"""The copy rule: each example's header lists exactly the repository files its imports reach, none of
them set-up tooling, and example lines stay readable (at most 120 characters)."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT
from tools.closure import closure

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def header_files(example) -> set:
    """The files the '# Copy with this file' comment block names; 'folder/ (...)' stands for its .py files."""
    lines = []
    for line in example.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    assert lines and lines[0].startswith("# Copy with this file"), f"{example.name} has no copy header"
    files = set()
    for token in re.findall(r"(?:common|examples)/[\w/.]*", "\n".join(ln for ln in lines[1:] if ln.startswith("#   "))):
        path = ROOT / token
        if token.endswith("/"):
            files |= {p.resolve() for p in path.glob("*.py")}
        elif token.endswith(".py"):
            files.add(path.resolve())
    return files


@pytest.mark.parametrize("name", EXAMPLES)
def test_header_lists_exactly_what_the_example_imports(name):
    example = ROOT / "examples" / name
    imported, listed = set(closure(example)), header_files(example)
    rel = lambda files: sorted(str(f.relative_to(ROOT)) for f in files)  # noqa: E731
    assert rel(imported - listed) == [], "imported but not in the header"
    assert rel(listed - imported) == [], "in the header but not imported"


@pytest.mark.parametrize("name", EXAMPLES)
def test_no_example_imports_set_up_tooling(name):
    assert not [f for f in closure(ROOT / "examples" / name) if (ROOT / "tools") in f.parents]


def test_example_lines_are_at_most_120_characters():
    long = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "examples").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert long == []


WORDS = ("README.md", "docs", "examples", "common", "bench", "tests", "tools")
TEXT_SUFFIXES = {".md", ".py", ".sh"}


def repository_texts():
    for name in WORDS:
        path = ROOT / name
        for p in sorted([path] if path.is_file() else path.rglob("*")):
            if p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                yield p


def test_named_repository_files_exist():
    """A path into the repository named in its text (README, docs, docstrings, comments) is a file that exists."""
    pattern = re.compile(r"(?<![\w/.])((?:examples|common|tools|bench|tests|docs)/[\w/.-]+\.(?:py|md|sh|txt))")
    missing = sorted({f"{p.relative_to(ROOT)}: {m}" for p in repository_texts() for m in pattern.findall(p.read_text())
                      if not (ROOT / m).exists() and m != "examples/X.py"})  # X: a placeholder for any example
    assert missing == []


def test_text_speaks_of_the_project_only():
    """No development history in the repository's words, and no paths outside it."""
    pattern = re.compile(r"session [0-9]|issue [0-9]|STYLE [0-9]|\.\./shared", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in repository_texts()
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
