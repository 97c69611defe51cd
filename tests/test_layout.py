"""The copy rule: each example's header lists exactly the repository files its imports reach, none of
them set-up tooling, and example lines stay readable (at most 120 characters)."""
from __future__ import annotations

import os
import re

import pytest

from conftest import ROOT
from tools.closure import closure

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def header_files(example, core_only: bool = False) -> set:
    """The files the '# Copy with this file' comment block names; 'folder/ (...)' stands for its .py files.
    `core_only`: its first list, the core (up to the line '# and ...' that names what the guards add)."""
    lines = []
    for line in example.read_text().splitlines():
        if not line.startswith("#") or (core_only and lines and line.startswith("# and")):
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
    core, listed = set(closure(example, core_only=True)), header_files(example, core_only=True)
    assert rel(core - listed) == [], "the core alone imports it, but the header's core list lacks it"
    assert rel(listed - core) == [], "in the header's core list, but only the guards import it"


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


def _import_graph(folder) -> dict:
    from tools.closure import local_imports

    return {p.resolve(): {f for f in local_imports(p) if folder in f.parents}
            for p in sorted(folder.rglob("*.py")) if "__pycache__" not in p.parts}


def test_the_core_never_imports_the_harness():
    """common/ without common/harness/ is the core: a copy of an example with it alone must run, so no core module
    imports the harness (at its top, inside a function, or as an override-registry string)."""
    harness = (ROOT / "common" / "harness").resolve()
    graph = _import_graph((ROOT / "common").resolve())
    found = sorted(f"{p.relative_to(ROOT)} -> {f.relative_to(ROOT)}" for p, fs in graph.items()
                   if harness not in p.parents for f in fs if harness in f.parents)
    assert found == []


def test_no_import_circle_in_common():
    """The modules of common/ import each other in one direction (a circle hides which one is the base)."""
    graph = _import_graph((ROOT / "common").resolve())
    state, circles = {}, []

    def visit(p, path):
        state[p] = "open"
        for f in sorted(graph.get(p, ())):
            if f.name == "__init__.py":  # a package's own __init__ runs first anyway
                continue
            if state.get(f) == "open":
                circles.append(" -> ".join(str(x.relative_to(ROOT)) for x in path[path.index(f):] + [f]))
            elif f not in state:
                visit(f, path + [f])
        state[p] = "done"

    for p in graph:
        if p not in state:
            visit(p, [p])
    assert circles == []


def test_the_copy_sizes_in_docs_layout_are_the_closures():
    """docs/layout.md's table of copy sizes is what `python -m tools.closure` counts now."""
    from tools.closure import closure, count_lines

    text = (ROOT / "docs" / "layout.md").read_text()
    for example in sorted((ROOT / "examples").glob("*.py")):
        core, full = closure(example, core_only=True), closure(example)
        row = f"| `examples/{example.name}` | {count_lines(core):,} | {count_lines(full):,} |"
        assert row in text, f"docs/layout.md has no row {row}: run python -m tools.closure and copy its figures"


@pytest.mark.parametrize("script, package", [("train_hf_backend.py", "hf_backend"),
                                             ("generate_compat_check.py", "compat_check")])
def test_a_copy_without_its_package_beside_the_script_says_where_it_goes(tmp_path, script, package):
    """A flat project (the script at its root, the header's examples/PACKAGE/ mirrored as examples/PACKAGE/): one
    `error:` line naming the folder and where it goes, exit 2, not a ModuleNotFoundError traceback."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "common", tmp_path / "common")
    shutil.copytree(ROOT / "examples" / package, tmp_path / "examples" / package)
    shutil.copy(ROOT / "examples" / script, tmp_path / script)
    proc = subprocess.run([sys.executable, script, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == (f"error: {package} not found: put the folder {package}/ (examples/{package}/ in "
                                   f"the repository) in the folder of this script, {tmp_path.resolve()}")
