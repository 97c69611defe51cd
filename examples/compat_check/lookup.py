"""The `lookup` subcommand of generate_compat_check.py: search our results and files in the public schema.

    python examples/generate_compat_check.py lookup runs/compat --name qwen3            # a table
    python examples/generate_compat_check.py lookup runs/compat --name tiny-qwen3 --run_py   # one row's script
    python examples/generate_compat_check.py lookup runs/compat public/ --html page.html     # the static page
    python examples/generate_compat_check.py lookup runs/compat --rankings rankings.json --view downloads
    python examples/generate_compat_check.py lookup runs/compat --compiles_once   # audited, no decode recompile

A file that cannot be read is reported on one line and skipped; the others are still shown. A folder is searched
for *.parquet files (a Spark-style `x.parquet/` folder counts by its part files, once; hidden and `_`-prefixed
entries such as Spark's `_temporary/` are not read), and a file named twice is read once. Only the columns a view
needs are read: the table never reads `run_py`, `--run_py` reads it for the one matching row, and the page reads
it as a dictionary of its distinct texts, so a 200,000-row public file stays a few hundred megabytes.
`run_py` is printed or shown as text, never run. Every string from a file or a path reaches the terminal as
printable text (`common.errors.one_line`), error lines included. `--html` never writes over a file it reads or over an
existing file that is not a page it wrote (page.check_target).

With `--rankings FILE` (written by the `rankings` subcommand: rankings.py) the Trending and Downloads views list one
task's ranked models in the file's order, each with its rows, and a ranked model without a row as "not tested"
(neither PASS nor FAIL, not a failure), with its rank and downloads; the page holds both views. The compile audit's
counts (graphs, recompiles, graph breaks) are columns of the table; `--compiles_once` keeps the rows audited with no
recompile after the first decode step. The table's `pull` column marks each row whose stack has a shared compile cache
recorded (`compile_cache_url`) with the number of the command under the table that pulls its compiled graphs for its
compiler (`python -m tools.compile_cache pull URL --device D --key KEY`, quoted as the page quotes it); a line then
says how many rows have no shared compile cache recorded.
"""
from __future__ import annotations

import math
import os
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from common.errors import ArgumentParser, UserError, one_line
from compat_check import page, rankings as ranking
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
                   task: str | None = None, compiles_once: bool = False):
    if compiles_once:  # audited, and no recompile after the first decode step (NaN: not audited)
        df = df[df["compile_recompiles"] == 0]
    if task:
        df = df[df["task"] == task]
    if name:
        df = df[df["model_id"].fillna("").str.contains(name, case=False, regex=False)]
    if compiler:
        df = df[df["neuronx_cc"].fillna("none").str.startswith(compiler)]
    if transformers:
        df = df[df["transformers"].fillna(df["library_version"]).fillna("").str.startswith(transformers)]
    return df


AUDIT_SHOW = (("compile_graphs", "graphs", 6), ("compile_recompiles", "recompiles", 10),
              ("compile_graph_breaks", "graph_breaks", 12))
SHOW = (("model_id", "model_id", 50), ("task", "task", 18), ("result", "result", 8), ("tp", "cores", 5),
        ("runner", "runner", 16), ("wall_s", "wall_s", 8), ("hbm_peak_gb", "hbm_peak_gb", 11),
        ("cpu_match", "cpu_match", 9), ("english", "english", 7), *AUDIT_SHOW, ("neuronx_cc", "neuronx_cc", 12),
        ("transformers", "transformers", 12), ("exclusion", "exclusion", 50), ("error", "error", 60))
# The Trending and Downloads views: rank first, the Hub's figures, then what the rows say ("not tested": none).
RANKED_SHOW = (("rank", "rank", 5), ("model_id", "model_id", 50), ("result", "result", 10),
               ("downloads", "downloads", 11), ("trending_score", "trending", 8), ("likes", "likes", 7),
               ("tp", "cores", 5), ("wall_s", "wall_s", 8), *AUDIT_SHOW, ("neuronx_cc", "neuronx_cc", 12),
               ("transformers", "transformers", 12), ("exclusion", "exclusion", 40), ("error", "error", 50))
WHOLE = ("tp", "rank", "downloads", "trending_score", "likes", "compile_graphs", "compile_recompiles",
         "compile_graph_breaks")  # shown without decimals


FIRST_LINE = ("error", "exclusion")  # prose (a traceback, a reason): its first line stands for it in a cell
# The least a figure can be in a row a run wrote: below it (a hand-edited or corrupt row) it is no measurement, and
# shows as '-', as tools/report.py leaves a figure outside its range out.
AT_LEAST = {"tp": 1, "rank": 1, "wall_s": 0, "hbm_peak_gb": 0, "downloads": 0, "trending_score": 0, "likes": 0,
            "compile_graphs": 0, "compile_recompiles": 0, "compile_graph_breaks": 0}


def _shown(value, col: str) -> str:
    """One cell as a single printable line: '-' for null, NaN or empty; control characters shown as U+FFFD
    (common.errors.one_line), so a value cannot add lines, move the cursor or recolour the terminal, and two ids
    that differ after a newline are shown different. An error or exclusion shows its first line."""
    if type(value) is str and col not in FIRST_LINE:  # most cells: text shown as it is, unless empty or not printable
        return one_line(value) if value else "-"
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and (not math.isfinite(value) or value < AT_LEAST.get(col, -math.inf)):
        return "-"
    if isinstance(value, (int, float)) and col in WHOLE:
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.2f}" if col == "hbm_peak_gb" else f"{value:.1f}"
    if col not in FIRST_LINE:
        return one_line(str(value))
    lines = [line for line in str(value).strip().splitlines() if line.strip()]
    return one_line(lines[0] if lines else "-")


def format_results(df, marks: list | None = None) -> str:
    """The rows view's table; with `marks` (pull_notes), a `pull` column before the prose columns."""
    records = [list(values) for values in df[[c for c, _, _ in SHOW]].itertuples(index=False)]
    if marks is None:
        return format_table(records, SHOW)
    at = [c for c, _, _ in SHOW].index("exclusion")
    show = SHOW[:at] + (("pull", "pull", 6),) + SHOW[at:]
    return format_table([r[:at] + [m] + r[at:] for r, m in zip(records, marks)], show)


def pull_notes(df) -> tuple[list, list[str]]:
    """Per row of `df` its mark in the table's `pull` column ("[1]": the first command below; None: none), and the
    lines under the table: each distinct command that pulls rows' compiled graphs from their shared compile cache
    for their compiler (page.pull_command), once, with how many rows it serves; then how many rows record none."""
    commands, keys = page.pull_cells(df)
    numbers: dict[str, int] = {}
    marks = [None if c is None else f"[{numbers.setdefault(c, len(numbers) + 1)}]" for c in commands]
    counts, key_of = Counter(commands), dict(zip(commands, keys))
    lines = [one_line(f"[{n}] {c}  ({counts[c]} row(s)"
                      + (")" if key_of[c] else "; their versions give no key: it pulls this host's)"))
             for c, n in numbers.items()]
    urls = df["compile_cache_url"].tolist() if "compile_cache_url" in df.columns else [None] * len(df)
    unusable = sum(c is None and isinstance(u, str) and bool(u) for c, u in zip(commands, urls))
    if unusable:
        lines.append(f"{unusable} row(s) record a shared compile cache that is not one printable line: no command")
    if counts[None] - unusable:
        lines.append(f"no shared compile cache recorded: {counts[None] - unusable} of {len(commands)} row(s)")
    return marks, lines


def format_table(records: list[list], show: tuple) -> str:
    """One printable line per record (its values in `show`'s order), under a header of `show`'s titles."""
    if not records:
        return "(no matching rows)"
    columns = []  # a column at a time: its cells, cut to its width, padded to its widest
    for i, (col, title, width) in enumerate(show):
        cells = [_shown(values[i], col) for values in records]
        cells = [c if len(c) <= width else c[: width - 1] + "\N{HORIZONTAL ELLIPSIS}" for c in cells]
        widest = max(len(title), max(map(len, cells)))
        columns.append([c.ljust(widest) for c in [title, *cells]])
    return "\n".join("  ".join(row).rstrip() for row in zip(*columns))


def ranked_lines(df, rankings: ranking.Rankings, view: str, task: str, name: str | None = None,
                 keep_untested: bool = True) -> list[dict]:
    """The Trending or Downloads view: `task`'s ranked models in the rankings' order, each with its rows in `df`
    (already filtered), or one "not tested" line (result None) where it has none. The rows are indexed by model
    once, from their columns; a row becomes a record only where a ranked model has it."""
    rows = df[df["task"] == task]
    names = [str(c) for c in rows.columns]
    records = list(zip(*(rows.iloc[:, i].tolist() for i in range(len(names)))))  # Python values, as to_dict gives
    by_model: dict[str, list[int]] = {}
    for i, model_id in enumerate(rows["model_id"].tolist()):
        by_model.setdefault(model_id, []).append(i)
    rank, lines, needle = ranking.ORDERS[view][1], [], name.lower() if name else None
    for e in rankings.ranked(view, task):
        if needle and needle not in e["model_id"].lower():
            continue
        hub = {"rank": e[rank], "downloads": e["downloads"], "trending_score": e["trending_score"],
               "likes": e["likes"], "model_id": e["model_id"], "task": task}
        found = by_model.get(e["model_id"], ())
        lines += [dict(zip(names, records[i]), **hub) for i in found]
        if not found and keep_untested:
            lines.append(dict(hub, result="not tested", tested=False))
    return lines


def ranked_summary(lines: list[dict], rankings: ranking.Rankings, view: str, task: str) -> str:
    counts = {k: sum(line.get("result") == k for line in lines) for k in ("PASS", "FAIL", "EXCLUDED")}
    untested = sum(line.get("tested") is False for line in lines)
    return (f"{view} for {task} ({len({line['model_id'] for line in lines})} ranked model(s), {rankings.source}, "
            f"fetched {rankings.fetched_at or 'at an unrecorded time'}): {counts['PASS']} PASS, {counts['FAIL']} "
            f"FAIL, {counts['EXCLUDED']} EXCLUDED, {untested} not tested (neither PASS nor FAIL; EXCLUDED and not "
            "tested are not failures)")


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
    p.add_argument("--compiles_once", action="store_true",
                   help="only rows whose compile audit found no recompile after the first decode step")
    p.add_argument("--rankings", metavar="FILE", help="the Hub's rankings (the rankings subcommand writes them): "
                   "the Trending and Downloads views, here and on the page")
    p.add_argument("--view", choices=("rows", "trending", "downloads"),
                   help="rows: the table of rows (default without --rankings); trending, downloads: one task's "
                        "ranked models in the rankings' order, untested ones as 'not tested' (default with "
                        "--rankings: trending; the task: --task, else the rankings' first)")
    args = p.parse_args(argv)
    try:
        view = args.view or ("trending" if args.rankings else "rows")
        if view != "rows" and not args.rankings:
            raise UserError(f"--view {view} needs --rankings FILE: {ranking.HOW}")
        if args.run_py and view != "rows":
            raise UserError("--run_py prints one row's script: leave --view and --rankings out")
        files = find_result_files(args.sources)
        if args.html:  # before anything is read: the page never replaces an input or a file it did not write
            page.check_target(args.html, files + ([Path(args.rankings)] if args.rankings else []))
        ranks = ranking.read_rankings(args.rankings) if args.rankings else None
        if ranks is not None and ranks.skipped:
            print(f"skipped: {ranks.skipped} record(s) of the rankings without a model id or task", file=sys.stderr)
        if args.html:  # every column the page shows; run_py as its distinct texts
            columns, dictionary = PAGE_READS + ("run_py",), ("run_py",)
        else:  # the table, or --run_py's one row: run_py is read for that row alone, below
            columns = tuple(dict.fromkeys(FILTER_COLUMNS + tuple(c for c, _, _ in SHOW) + page.PULL_READS))
            dictionary = ()
        df, problems = load_results(files, columns, dictionary)
        for problem in problems:
            print(one_line(f"skipped: {problem}"), file=sys.stderr)
        if view != "rows":  # one task's ranked models; the filters apply to their rows
            task = args.task or (ranks.tasks[0] if ranks.tasks else "text-generation")
            rows = filter_results(df, None, args.compiler, args.transformers, task, args.compiles_once)
            lines = ranked_lines(rows, ranks, view, task, args.name, keep_untested=not args.compiles_once)
            print(format_table([[line.get(c) for c, _, _ in RANKED_SHOW] for line in lines], RANKED_SHOW))
            print(one_line(ranked_summary(lines, ranks, view, task)))
            if task not in ranks.tasks:
                print(one_line(f"note: the rankings hold no {task} models (they hold: "
                                f"{', '.join(ranks.tasks) or 'none'})"), file=sys.stderr)
            if args.html:
                write_page_or_fail(filter_results(df, args.name, args.compiler, args.transformers, args.task,
                                                  args.compiles_once), args, selected, rerun, ranks)
            return 0
        df = filter_results(df, args.name, args.compiler, args.transformers, args.task, args.compiles_once)
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
            sys.stdout.write(one_line(source if source.endswith("\n") else source + "\n", keep="\t\n"))
            if hidden:  # a carriage return or an escape sequence could hide lines of a script users save
                print(f"warning: run_py holds {hidden} control character(s) (escape sequences, carriage returns), "
                      "printed as \N{REPLACEMENT CHARACTER}: the stored text differs from what is shown; read it "
                      "before saving it", file=sys.stderr)
            return 0
        marks, notes = pull_notes(df)
        print(format_results(df, marks))
        for note in notes:
            print(note)
        print(summary_line(df))
        if args.html:
            write_page_or_fail(df, args, selected, rerun, ranks)
    except UserError as e:
        print(one_line(f"error: {e}"), file=sys.stderr)
        return 2
    return 0


def write_page_or_fail(df, args, selected: tuple[str, ...], rerun, ranks) -> None:
    try:
        path = page.write_page(df, args.html, selected, [str(s) for s in args.sources], rerun, ranks)
    except OSError as e:
        raise UserError(f"--html {args.html} cannot be written: {e.strerror or e}") from None
    print(one_line(f"page: {path} ({len(df)} rows)"))
