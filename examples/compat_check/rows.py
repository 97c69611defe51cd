"""The results files: columns, the version stack, reading any file in the public schema, writing our rows.

The results mirror the public dataset aws-neuron/torch-neuronx-model-support: one Parquet file per
combination of compiler (neuronx-cc) and library (transformers) versions, one row per model and task,
in the dataset's columns (`PUBLIC_COLUMNS`) plus a few of ours (`EXTRA_COLUMNS`).

Reading takes any file in that schema as it comes: columns missing (some public files lack
`exclusion`), nulls, NaN, empty strings, or a column stored with another type (numbers as text,
booleans as 0/1). `read_table` returns the columns asked for (every column by default), each in one
known type, so that nothing downstream meets a value it does not expect; it reads only those columns,
and a large text column (`run_py`, ~20 KB a row) can be read as a dictionary of its distinct texts or
for one row alone (`read_cell`). A file that names a column twice is refused in one line.
`run_py` is only ever shown, never run.

Writing gives the public columns the public dataset's own types (`_arrow_schema`), so that a row of ours appends to a
public file without a cast; what those types drop (the measured seconds behind the whole `wall_s`) is kept in a
column of ours (`wall_s_precise`). A file this check wrote with its earlier types (int64, float64, booleans,
microseconds) is converted when a row is added to it; reading takes both forms.

Writing is a locked read-modify-write (`locked`: a lock file beside the results file, held while the
file is read, a row added and the file replaced atomically), so two checks writing into one --out_dir
lose no row. The lock file is never a symbolic link or anything but a regular file (`check_lock`).
"""
from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import stat
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from common.errors import UserError
from common.results import atomic_path, installed_version

# In the order the public dataset lists them. The names are the dataset's: hbm_*_gb hold GiB (2**30 bytes).
PUBLIC_COLUMNS = (
    "model_id", "library", "tp", "runner", "result", "notes", "error", "exclusion", "wall_s",
    "hbm_peak_gb", "hbm_capacity_gb", "cpu_match", "english", "neuronx_cc", "library_version",
    "transformers", "accelerate", "torch_neuronx", "torch", "nki", "python", "neuron_driver",
    "tested_at", "run_py",
)
# Ours, after the public ones: what the protocol measures or needs to be reproduced.
EXTRA_COLUMNS = (
    "device", "compile_s",
    "wall_s_precise",  # the measured wall time in seconds (float64); wall_s holds it rounded, as the public dataset
    "prompt", "generated_text", "judge", "task",
    "image",  # image-text-to-text: the image file and its sha256
    "compile_cache",  # where the compiled graphs were cached (NEFF cache on Trainium, inductor's elsewhere)
    "compile_cache_url",  # the shared compile cache holding them (tools/compile_cache.py's URL); null: none recorded
    "packages",  # JSON {name: version}: the other packages the run used
    "run_args",  # the flags that rerun this model with this row's settings
    "timings",  # JSON {load_s, generate_s, reference_s, judge_s}: where the time went
    "unavailable",  # true: the model could not be fetched; no verdict, a rerun tries it again
    "train_losses", "train_tokens_per_s", "export_max_abs_logit_diff",  # --task train
    # The compile audit (compile_audit.py): graphs Dynamo hands the compiler over the generation, recompilations
    # after the first decode step and graph breaks, as integers, each with its reasons beside it (JSON lists);
    # compile_audit: JSON {mode, phases, forward_calls, seconds, compiles_once, ...}. Null where not audited.
    "compile_graphs", "compile_recompiles", "compile_recompile_reasons", "compile_graph_breaks",
    "compile_graph_break_reasons", "compile_audit",
)
COLUMNS = PUBLIC_COLUMNS + EXTRA_COLUMNS
# A row's task. Files in the public schema have no `task` column: their rows read as text-generation.
TASKS = ("text-generation", "image-text-to-text", "train")
# A row's result: PASS, FAIL (with `error` set where the run crashed, timed out or was non-finite) or EXCLUDED.
VERSION_COLUMNS = ("neuronx_cc", "library_version", "transformers", "accelerate", "torch_neuronx",
                   "torch", "nki", "python", "neuron_driver")
# Read as float64, whatever a file stores them as (NaN where not recorded).
FLOAT_COLUMNS = ("tp", "wall_s", "hbm_peak_gb", "hbm_capacity_gb", "compile_s", "wall_s_precise",
                 "train_tokens_per_s", "export_max_abs_logit_diff", "compile_graphs", "compile_recompiles",
                 "compile_graph_breaks")
# Read as True/False/None, from booleans or text.
BOOL_COLUMNS = ("cpu_match", "english", "unavailable")
# The types a row is written with (`_arrow_schema`). The public columns take the public dataset's, as its viewer
# reports them: tp and wall_s int32, hbm_peak_gb and hbm_capacity_gb float64, tested_at timestamp[ms, UTC], and every
# other public column a string, cpu_match and english among them (written "true"/"false": TEXT_BOOL_COLUMNS). Ours:
# the whole counts int64 (INT_COLUMNS), the other numbers float64, unavailable a boolean, the rest strings.
INT_COLUMNS = ("compile_graphs", "compile_recompiles", "compile_graph_breaks")
TEXT_BOOL_COLUMNS = ("cpu_match", "english")


def _arrow_schema():
    import pyarrow as pa

    types = {c: pa.float64() for c in FLOAT_COLUMNS} | {c: pa.int64() for c in INT_COLUMNS}
    types |= {"unavailable": pa.bool_(), "tp": pa.int32(), "wall_s": pa.int32(),
              "tested_at": pa.timestamp("ms", tz="UTC")}  # the public dataset's types
    return pa.schema([(c, types.get(c, pa.string())) for c in COLUMNS])


# ------------------------------------------------------------------------------------------ versions
def neuron_driver_version() -> str | None:
    """The Neuron kernel driver's version, as the aws-neuronx-dkms module reports it (None off Trainium)."""
    path = Path("/sys/module/neuron/version")
    return path.read_text().strip() if path.is_file() else None


def stack_versions() -> dict[str, str | None]:
    """The version columns of a row: compiler, library and everything else the run depended on."""
    transformers = installed_version("transformers")
    return {
        "neuronx_cc": installed_version("neuronx-cc"), "library": "transformers", "library_version": transformers,
        "transformers": transformers, "accelerate": installed_version("accelerate"),
        "torch_neuronx": installed_version("torch-neuronx"), "torch": installed_version("torch"),
        "nki": installed_version("nki"),
        "python": platform.python_version(), "neuron_driver": neuron_driver_version(),
    }


def other_packages(task: str) -> dict[str, str | None]:
    """The packages besides the version stack that a row's run used (shown as its extra packages)."""
    names = ["tokenizers", "safetensors", "huggingface-hub", "numpy", "wordfreq"]
    if task == "image-text-to-text":
        names += ["pillow", "torchvision"]
    if task == "train":
        names += ["torchtitan", "datasets"]
    return {n: installed_version(n) for n in names}


def results_file(out_dir: str | os.PathLike, stack: dict) -> Path:
    """One file per compiler + library versions, as in the public dataset. Off Trainium there is no
    neuronx-cc, and the name says so ("none") rather than pretending to a compiler version."""
    def clean(v):
        return re.sub(r"[^A-Za-z0-9.+-]", "_", str(v or "none"))
    return Path(out_dir) / (f"neuronx-cc-{clean(stack['neuronx_cc'])}__{stack['library']}-"
                            f"{clean(stack['library_version'])}.parquet")


# ------------------------------------------------------------------------------------------ reading
def _text(v) -> str | None:
    """A cell as text: None for null and NaN; bytes decoded; anything else as str()."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if type(v).__name__ in ("NAType", "NaTType"):
        return None
    return v if isinstance(v, str) else str(v)


def _bool(v) -> bool | None:
    """true/false from a bool, 0/1, or the text true/false/yes/no/1/0; anything else is unknown (None)."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(v.strip().lower())
    return None


def task_of(value) -> str:
    """A row's task; rows without one (public files, older files) are text generation."""
    value = _text(value)
    if not value or value == "generate":  # "generate": an earlier name of the task in this schema
        return "text-generation"
    return value


def normalize(df, columns: tuple[str, ...] = COLUMNS):
    """Every column of `columns` present (all of COLUMNS by default), each in one type: float64 (NaN for null or
    unreadable), object bool/None, UTC timestamps (NaT), or object str/None. Other columns are kept as they are.
    `wall_s` is the measured seconds (`wall_s_precise`) where the frame has them, else the file's whole seconds."""
    import pandas as pd
    from pandas.api.types import infer_dtype

    df = df.copy()
    df.columns = [str(c) for c in df.columns]
    for col in columns:
        if col not in df.columns:
            df[col] = None
        if col in FLOAT_COLUMNS and df[col].dtype.kind in "fiu":  # numbers already: as _float makes each of them
            df[col] = df[col].astype("float64")
            continue
        values = df[col].astype(object)  # a categorical's rows share its texts: nothing is copied
        if col in FLOAT_COLUMNS:
            df[col] = pd.to_numeric(values.map(_float), errors="coerce").astype("float64")
        elif col in BOOL_COLUMNS:
            df[col] = values.map(_bool).astype(object)
        elif col == "tested_at":
            df[col] = pd.to_datetime(values.map(lambda v: v if isinstance(v, (datetime, pd.Timestamp)) else _text(v)),
                                     errors="coerce", utc=True, format="mixed")
        elif infer_dtype(values, skipna=True) in ("string", "empty"):  # text already: only missing becomes None
            df[col] = values.where(values.notna(), None).astype(object)
        else:
            df[col] = values.map(_text).astype(object)
    if "task" in columns:
        df["task"] = df["task"].map(task_of)
    if "wall_s" in columns and "wall_s_precise" in df.columns:  # the measured seconds where a row has them
        precise = pd.to_numeric(df["wall_s_precise"].astype(object).map(_float), errors="coerce").astype("float64")
        df["wall_s"] = precise.where(precise.notna(), df["wall_s"])
    return df


def _float(v):
    if isinstance(v, bool) or v is None:
        return math.nan
    if isinstance(v, (int, float)) or type(v).__module__ == "numpy":
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan
    try:
        return float(_text(v) or "nan")
    except ValueError:
        return math.nan


def _duplicates(names: list[str]) -> list[str]:
    return [name for name, n in Counter(names).items() if n > 1]


def _check_columns(path, names: list[str]) -> None:
    if dup := _duplicates(names):
        raise UserError(f"{path} names the column(s) {', '.join(map(repr, dup))} more than once: a results file "
                        "names each column once (rewrite it with one column of each name)")


def read_table(path: str | os.PathLike, columns: tuple[str, ...] | None = None, dictionary: tuple[str, ...] = ()):
    """One results file as a normalized DataFrame (see `normalize`): `columns` (default: every column of COLUMNS
    and any other the file has), and nothing else read from the file (but `wall_s_precise` with `wall_s`). Columns
    in `dictionary` are read as pandas categoricals of their distinct texts (a run writes the same `run_py` into
    every row: one copy, not one per row). The file is opened once, so a writer replacing it meanwhile cannot mix
    two versions. UserError if it is not a readable Parquet file, or names a column twice."""
    import pyarrow.parquet as pq

    try:
        with open(path, "rb") as f:
            meta = pq.read_metadata(f)
            names = meta.schema.to_arrow_schema().names
            _check_columns(path, names)
            wanted = names if columns is None else [c for c in names if c in columns]
            if "wall_s" in wanted and "wall_s_precise" in names and "wall_s_precise" not in wanted:
                wanted.append("wall_s_precise")  # wall_s as measured (normalize), where the file has it
            # closed here, not at interpreter exit, and read on this thread (no Arrow thread pool started): a reader
            # or pool left to the final teardown can abort the process after its work is done (apache/arrow#34314,
            # "terminate called without an active exception"); one file of rows is no faster read in parallel
            with pq.ParquetFile(f, metadata=meta, read_dictionary=[c for c in dictionary if c in wanted]) as pf:
                table = pf.read(columns=wanted, use_threads=False)
        df = table.to_pandas(use_threads=False)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  pyarrow raises many types for a bad file; each becomes one line
        raise UserError(f"{path} is not a readable Parquet file: {type(e).__name__}: {str(e)[:300]}") from None
    df = normalize(df, COLUMNS if columns is None else columns)
    if columns is not None and "wall_s_precise" not in columns and "wall_s_precise" in df.columns:
        df = df.drop(columns="wall_s_precise")
    return df


def read_cell(path: str | os.PathLike, index: int, column: str) -> str | None:
    """One text cell, row `index` of the file (as read_table numbers them): only the row group holding it is
    read, that column alone, as a dictionary (a 20 KB run_py repeated over 200,000 rows stays one text)."""
    import pyarrow.parquet as pq

    try:
        with open(path, "rb") as f:
            meta = pq.read_metadata(f)
            names = meta.schema.to_arrow_schema().names
            _check_columns(path, names)
            if column not in names:
                return None
            with pq.ParquetFile(f, metadata=meta, read_dictionary=[column]) as pf:  # closed here, as in read_table
                start = 0
                for group in range(meta.num_row_groups):
                    n = meta.row_group(group).num_rows
                    if index < start + n:
                        cells = pf.read_row_group(group, columns=[column], use_threads=False).column(0)
                        return _text(cells[index - start].as_py())
                    start += n
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{path} is not a readable Parquet file: {type(e).__name__}: {str(e)[:300]}") from None
    raise UserError(f"{path} holds no row {index}: it changed while it was read")


def recorded(path: Path, model_id: str, stack: dict, tasks: tuple[str, ...]) -> dict | None:
    """The verdict already recorded for `model_id` (one of `tasks`) with exactly this version stack, or None.
    A row whose model could not be fetched is no verdict: it is tried again."""
    if not path.is_file():
        return None
    df = read_table(path, ("model_id", "task", "result", "unavailable", *VERSION_COLUMNS))
    rows = df[(df["model_id"] == model_id) & df["task"].isin(tasks) & (df["unavailable"] != True)]  # noqa: E712
    for row in rows.to_dict("records"):  # each value as normalize made it (None stays None, never NaN)
        if all(row[c] == stack.get(c) for c in VERSION_COLUMNS):
            return row
    return None


# ------------------------------------------------------------------------------------------ writing
def lock_file(path: str | os.PathLike) -> Path:
    """The lock file of a file that is read, changed and replaced under a lock (`locked`): `.<name>.lock` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def _not_a_lock(lock: Path) -> str | None:
    """What is at `lock` when it cannot be a lock file (the entry itself, never what a link points to): "a symbolic
    link", "a FIFO", "a folder", ...; None for a regular file or nothing."""
    try:
        mode = os.lstat(lock).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a folder" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")


def check_lock(path: str | os.PathLike) -> None:
    """UserError unless `path`'s lock file is a regular file or absent: a symbolic link (to a file of the user's, say)
    or a FIFO is never followed nor opened. The check calls it for its outputs before any model runs."""
    lock = lock_file(path)
    if kind := _not_a_lock(lock):
        raise UserError(f"{lock} is {kind}, not the lock file of {Path(path).name}: it is left alone (never followed "
                        "nor opened); remove it or choose another --out_dir")


@contextlib.contextmanager
def locked(path: str | os.PathLike):
    """Held while `path` is read, changed and replaced: an exclusive flock(2) on `.<name>.lock` beside it (the lock
    file stays; the kernel releases the lock when its holder ends, however it ends). Two checks writing into one
    --out_dir take turns, so neither rewrites the file without the other's rows. The lock file is opened without
    following a link, without blocking on a FIFO, and used only if it is a regular file (`check_lock`)."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_lock(path)
    lock = lock_file(path)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:  # a link or FIFO put there since check_lock (ELOOP, ENXIO), a folder, no permission
        raise UserError(f"{lock}, the lock file of {path.name}, cannot be opened as a regular file "
                        f"({e.strerror or e}): it is left alone; remove it or choose another --out_dir") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{lock} is not a regular file, not the lock file of {path.name}: it is left alone; "
                            "remove it or choose another --out_dir")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _bool_text(value) -> str | None:
    """cpu_match and english as the public dataset stores them: text."""
    b = _bool(value)
    return None if b is None else "true" if b else "false"


def file_row(row: dict) -> dict:
    """A row as it is written: every column of COLUMNS, the public ones in the public dataset's types (tp and wall_s
    whole numbers, cpu_match and english "true"/"false", tested_at to the millisecond, now where not given), the
    measured wall time kept in wall_s_precise."""
    row = {c: row.get(c) for c in COLUMNS}
    wall = _float(row["wall_s"])
    if row["wall_s_precise"] is None and math.isfinite(wall):
        row["wall_s_precise"] = wall
    row["wall_s"] = round(wall) if math.isfinite(wall) else None
    row["tp"] = None if row["tp"] is None else int(row["tp"])
    for c in TEXT_BOOL_COLUMNS:
        row[c] = _bool_text(row[c])
    at = row["tested_at"] or datetime.now(timezone.utc)
    row["tested_at"] = at.replace(microsecond=at.microsecond // 1000 * 1000)
    return row


def _as_written(table, schema):
    """A results file read back (ours of any age, or one in the public types) in `schema`'s columns and types:
    columns it lacks are null; earlier files' float wall_s is rounded, its seconds kept in wall_s_precise; booleans
    become "true"/"false"; microseconds are cut to milliseconds. ArrowInvalid or ArrowNotImplementedError where a
    column does not convert."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def column(name, type_):
        return table.column(name) if name in table.column_names else pa.chunked_array([pa.nulls(len(table), type_)])

    columns = []
    for field in schema:
        col = column(field.name, field.type)
        if field.name == "wall_s_precise" and "wall_s" in table.column_names \
                and pa.types.is_floating(table.column("wall_s").type):  # earlier files: the seconds were wall_s,
            seconds = table.column("wall_s").cast(pa.float64())  # kept where a row has no wall_s_precise of its own
            col = seconds if field.name not in table.column_names else pc.coalesce(col.cast(pa.float64()), seconds)
        elif field.name == "wall_s" and pa.types.is_floating(col.type):
            col = pc.round(pc.if_else(pc.is_finite(col), col, pa.scalar(None, col.type)))
        elif field.name == "tested_at" and pa.types.is_timestamp(col.type):
            col = col.cast(field.type, safe=False)  # to the millisecond: the digits below are cut
        columns.append(col.cast(field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def write_row(path: Path, row: dict) -> None:
    """Add (or replace) one model's row for its task, atomically and under the file's lock (`locked`): the file is
    read and rewritten beside itself and renamed while no other writer can, so a run killed at any moment leaves
    the previous complete file, every finished row readable, and a concurrent check's rows kept. The file is written
    in the public types (file_row; a file of earlier types is converted: _as_written)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    row = file_row(row)
    new = pa.Table.from_pylist([row], schema=schema)
    with locked(path):
        if path.is_file():
            with open(path, "rb") as f:
                _check_columns(path, pq.read_schema(f).names)
                f.seek(0)
                old = pq.read_table(f, use_threads=False)  # as rows.read_table: no thread pool at exit
            def column(name):
                return old.column(name).to_pylist() if name in old.column_names else [None] * len(old)
            key = (row["model_id"], task_of(row["task"]))
            # The row it replaces, and any "not fetched" row of the same model (its task was a guess then).
            keep = [i for i, (m, t, gone) in enumerate(zip(column("model_id"), column("task"), column("unavailable")))
                    if (m, task_of(t)) != key and not (m == row["model_id"] and gone is True)]
            old = old.take(pa.array(keep, type=pa.int64()))  # typed: an empty list would infer null
            try:
                old = _as_written(old, schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise UserError(f"{path} was not written by this script (its columns do not cast: {e}); "
                                "choose another --out_dir") from None
            new = pa.concat_tables([old, new])
        with atomic_path(path) as tmp:
            pq.write_table(new, tmp)
