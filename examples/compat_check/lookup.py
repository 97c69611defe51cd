"""The `lookup` subcommand of generate_compat_check.py: search our results and files in the public schema.

    python examples/generate_compat_check.py lookup runs/compat --name qwen3            # a table
    python examples/generate_compat_check.py lookup runs/compat --name tiny-qwen3 --run_py   # one row's script
    python examples/generate_compat_check.py lookup runs/compat public/ --html page.html     # the static page

A file that cannot be read is reported on one line and skipped; the others are still shown. A folder is searched
for *.parquet files (a Spark-style `x.parquet/` folder counts by its part files, once; hidden and `_`-prefixed
entries such as Spark's `_temporary/` are not read), and a file named twice is read once. Only the columns a view
needs are read: the table never reads `run_py`, `--run_py` reads it for the one matching row, and the page reads
it as a dictionary of its distinct texts, so a 200,000-row public file stays a few hundred megabytes.
`run_py` is printed or shown as text, never run. Every string from a file or a path reaches the terminal as
printable text (`printable`), error lines included. `--html` never writes over a file it reads or over an
existing file that is not a page it wrote (page.check_target).
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from common.errors import ArgumentParser, UserError
from compat_check import page
from compat_check.rows import COLUMNS, TASKS, read_cell, read_table


def _hidden(path: Path, top: Path) -> bool:
    """A file or folder under `top` whose name starts with '.' or '_' (a temp file, Spark's _temporary/ and
    _SUCCESS), as Spark and pyarrow datasets skip them."""
    return any(part.startswith((".", "_")) for part in path.relative_to(top).parts)


def find_result_files(sources: Iterable[str | os.PathLike]) -> list[Path]:
    """The Parquet files of `sources`: files as given, and every *.parquet file below a folder. Only files: a
    Spark-style `x.parquet/` folder is read through its part files, never also as a whole. A file reached twice
    (named twice, or inside a folder also named) is listed once."""
    sources = list(sources)
    files, seen = [], set()
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not _hidden(f, p))
        elif p.is_file():
            found = [p]
        else:
            raise UserError(f"{src} is neither a Parquet file nor a folder of them")
        for f in found:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                files.append(f)
    if not files:
        raise UserError(f"no .parquet files in {', '.join(map(str, sources))}")
    return files


# The columns each view reads (run_py apart: see lookup_main).
FILTER_COLUMNS = ("model_id", "task", "result", "neuronx_cc", "transformers", "library_version")
PAGE_READS = tuple(c for c in COLUMNS if c != "run_py")


def load_results(sources: Iterable[str | os.PathLike], columns: tuple[str, ...] | None = None,
                 dictionary: tuple[str, ...] = ()):
    """(every row of every readable file, columns unioned and normalized; one line per file that was not read).
    `columns`/`dictionary`: as rows.read_table (default: every column). Each row keeps its file (`source_file`)
    and its place in it (`source_row`), to read a large cell of it later (rows.read_cell)."""
    import pandas as pd

    frames, problems = [], []
    for f in find_result_files(sources):
        try:
            df = read_table(f, columns, dictionary)
        except UserError as e:
            problems.append(str(e))
            continue
        df["source_file"] = str(f)
        df["source_row"] = range(len(df))
        frames.append(df)
    if not frames:
        raise UserError("no readable results file: " + "; ".join(problems))
    return pd.concat(frames, ignore_index=True), problems


def filter_results(df, name: str | None = None, compiler: str | None = None, transformers: str | None = None,
                   task: str | None = None):
    if task:
        df = df[df["task"] == task]
    if name:
        df = df[df["model_id"].fillna("").str.contains(name, case=False, regex=False)]
    if compiler:
        df = df[df["neuronx_cc"].fillna("none").str.startswith(compiler)]
    if transformers:
        df = df[df["transformers"].fillna(df["library_version"]).fillna("").str.startswith(transformers)]
    return df


SHOW = (("model_id", "model_id", 50), ("task", "task", 18), ("result", "result", 8), ("tp", "cores", 5),
        ("runner", "runner", 16), ("wall_s", "wall_s", 8), ("hbm_peak_gb", "hbm_peak_gb", 11),
        ("cpu_match", "cpu_match", 9), ("english", "english", 7), ("neuronx_cc", "neuronx_cc", 12),
        ("transformers", "transformers", 12), ("exclusion", "exclusion", 50), ("error", "error", 60))


def printable(text: str, keep: str = "") -> str:
    """`text` with every character that is not printable (newline, CR, ESC, other controls; all but `keep`)
    replaced by U+FFFD, so a value cannot add lines, hide text, move the cursor or recolour the terminal."""
    return "".join(ch if ch.isprintable() or ch in keep else "\N{REPLACEMENT CHARACTER}" for ch in text)


def _shown(value, col: str) -> str:
    """One cell as a single printable line: '-' for null, NaN or empty; control characters replaced, so a
    value cannot move the cursor or recolour the terminal."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.0f}" if col == "tp" else f"{value:.2f}" if col == "hbm_peak_gb" else f"{value:.1f}"
    lines = [line for line in str(value).strip().splitlines() if line.strip()]
    return printable(lines[0] if lines else "-")


def format_results(df) -> str:
    if df.empty:
        return "(no matching rows)"
    cells = [[_shown(v, col) for v, (col, _, _) in zip(values, SHOW)]
             for values in df[[c for c, _, _ in SHOW]].itertuples(index=False)]
    cells = [[c if len(c) <= w else c[: w - 1] + "\N{HORIZONTAL ELLIPSIS}" for c, (_, _, w) in zip(row, SHOW)]
             for row in cells]
    header = [title for _, title, _ in SHOW]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *cells])


def summary_line(df) -> str:
    counts = df["result"].value_counts()
    return (f"{len(df)} row(s): {counts.get('PASS', 0)} PASS, {counts.get('FAIL', 0)} FAIL, "
            f"{counts.get('EXCLUDED', 0)} EXCLUDED (not failures)")


def lookup_main(argv: list[str] | None = None, *, prog: str = "lookup", selected: tuple[str, ...] = (),
                rerun=None) -> int:
    """The subcommand. `selected`: the curated list the page shows first; `rerun(run_args)`: the argv that reruns
    a row, or None where its run_args are not a plain list of the script's flags (page.page_data)."""
    p = ArgumentParser(
        prog=prog, description="Search compatibility results: ours (runs/...) and files in the public schema.")
    p.add_argument("sources", nargs="+", help="Parquet files or folders holding them")
    p.add_argument("--name", help="case-insensitive substring of model_id")
    p.add_argument("--compiler", help="neuronx-cc version prefix ('none': runs without Neuron)")
    p.add_argument("--transformers", help="transformers version prefix")
    p.add_argument("--task", choices=TASKS, help="only rows of this task (default: all)")
    p.add_argument("--run_py", action="store_true",
                   help="print the run_py (script source) of the one matching row instead of the table; "
                        "it is printed, never executed")
    p.add_argument("--html", metavar="FILE", help="also write the matching rows as one self-contained HTML page")
    args = p.parse_args(argv)
    try:
        files = find_result_files(args.sources)
        if args.html:  # before anything is read: the page never replaces an input or a file it did not write
            page.check_target(args.html, files)
        if args.html:  # every column the page shows; run_py as its distinct texts
            columns, dictionary = PAGE_READS + ("run_py",), ("run_py",)
        else:  # the table, or --run_py's one row: run_py is read for that row alone, below
            columns, dictionary = tuple(dict.fromkeys(FILTER_COLUMNS + tuple(c for c, _, _ in SHOW))), ()
        df, problems = load_results(files, columns, dictionary)
        for problem in problems:
            print(printable(f"skipped: {problem}"), file=sys.stderr)
        df = filter_results(df, args.name, args.compiler, args.transformers, args.task)
        if args.run_py:
            if len(df) != 1:
                ids = ", ".join(f"{m} ({f})" for m, f in zip(df["model_id"], df["source_file"]))
                raise UserError(f"--run_py needs exactly one matching row, found {len(df)}"
                                + (f": {ids}; narrow --name/--compiler/--transformers/--task" if ids else ""))
            source = read_cell(df["source_file"].iloc[0], int(df["source_row"].iloc[0]), "run_py")
            if not source:
                raise UserError(f"the row for {df['model_id'].iloc[0]} holds no run_py")
            source = source.replace("\r\n", "\n")
            hidden = sum(not (ch.isprintable() or ch in "\t\n") for ch in source)
            sys.stdout.write(printable(source if source.endswith("\n") else source + "\n", keep="\t\n"))
            if hidden:  # a carriage return or an escape sequence could hide lines of a script users save
                print(f"warning: run_py holds {hidden} control character(s) (escape sequences, carriage returns), "
                      "printed as \N{REPLACEMENT CHARACTER}: the stored text differs from what is shown; read it "
                      "before saving it", file=sys.stderr)
            return 0
        print(format_results(df))
        print(summary_line(df))
        if args.html:
            try:
                path = page.write_page(df, args.html, selected, [str(s) for s in args.sources], rerun)
            except OSError as e:
                raise UserError(f"--html {args.html} cannot be written: {e.strerror or e}") from None
            print(printable(f"page: {path} ({len(df)} rows)"))
    except UserError as e:
        print(printable(f"error: {e}"), file=sys.stderr)
        return 2
    return 0
