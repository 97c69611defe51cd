"""What copying each example drags in: the repository files its imports reach, transitively, and their lines,
with the core alone and with everything.

The core alone leaves out what an example imports only where it is there: an import under an `if` that asks
`find_spec` first (the guards of common/harness/) or inside a `try` that catches ModuleNotFoundError (the
compatibility check's lookup and rankings), and anything under common/harness/. A copy of those files runs the example's main job: a training example trains and exports.

    python -m tools.closure            # one row per example: lines and files, core alone and with everything
    python -m tools.closure --files    # and the files, one per line
    python -m tools.closure --table    # docs/layout.md's table rows

Imports are read from the source (ast), wherever they stand (inside functions too), as are the
"common.x.y" strings the override registry imports. The example itself is not counted.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_file(name: str, base: Path) -> Path | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        stem = base.joinpath(*parts[:k])
        for path in (stem.with_suffix(".py"), stem / "__init__.py"):
            if path.is_file():
                return path.resolve()
    return None


def _optional(tree: ast.AST) -> set[int]:
    """The import statements made only where their modules are there: inside a `try` whose handlers catch
    ModuleNotFoundError or ImportError, or inside an `if` that asks `find_spec` first (an example's choice of the
    guards, `if importlib.util.find_spec("common.harness"):`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ModuleNotFoundError", "ImportError")
                for h in node.handlers):
            body = node.body
        elif isinstance(node, ast.If) and any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("find_spec")
                                              for n in ast.walk(node.test)):
            body = node.body
        else:
            continue
        found |= {id(n) for stmt in body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def local_imports(path: Path, core_only: bool = False) -> set[Path]:
    """Repository files one source file imports. Absolute names resolve as the examples run them: from the
    repository root (each example puts it on sys.path) or from examples/ (the script's own folder).
    `core_only`: not the optional ones."""
    names = []
    tree = ast.parse(path.read_text())
    optional = _optional(tree) if core_only else set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = path.relative_to(ROOT).parent.parts
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names += [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("common."):
            names.append(node.value.rsplit(".", 1)[0])  # override-registry import strings
    found = {f for name in names for base in (ROOT, ROOT / "examples") if (f := _module_file(name, base))}
    return {f for f in found if ROOT in f.parents and f != path.resolve()}


HARNESS = ROOT / "common" / "harness"


def closure(example: Path, core_only: bool = False) -> list[Path]:
    """The repository files `example` reaches; `core_only`: not through optional imports or common/harness/."""
    seen, todo = set(), list(local_imports(example, core_only))
    while todo:
        f = todo.pop()
        if f not in seen and not (core_only and HARNESS in f.parents):
            seen.add(f)
            todo += local_imports(f, core_only)
    return sorted(seen)


def count_lines(files: list[Path]) -> int:
    return sum(len(f.read_text().splitlines()) for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", action="store_true", help="list the files of each closure")
    parser.add_argument("--table", action="store_true", help="the rows of docs/layout.md's table of copy sizes")
    args = parser.parse_args(argv)
    if args.table:
        for example in sorted((ROOT / "examples").glob("*.py")):
            core, full = count_lines(closure(example, core_only=True)), count_lines(closure(example))
            print(f"| `examples/{example.name}` | {core:,} | {full:,} |")
        return 0
    print(f"{'example':28s} {'core alone':>20s} {'with everything':>20s}")
    for example in sorted((ROOT / "examples").glob("*.py")):
        core, full = closure(example, core_only=True), closure(example)
        print(f"{example.name:28s} {count_lines(core):6d} lines, {len(core):2d} files "
              f"{count_lines(full):6d} lines, {len(full):2d} files")
        for f in full if args.files else ():
            print(f"    {f.relative_to(ROOT)}  {len(f.read_text().splitlines())}" + ("" if f in core else "  (harness)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
