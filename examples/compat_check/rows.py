"""The results files: columns, the version stack, reading any file in the public schema, writing our rows.

The results mirror the public dataset aws-neuron/torch-neuronx-model-support: one Parquet file per
combination of compiler (neuronx-cc) and library (transformers) versions, one row per model and task,
in the dataset's columns (`PUBLIC_COLUMNS`) plus a few of ours (`EXTRA_COLUMNS`).

Reading takes any file in that schema as it comes: columns missing (some public files lack
`exclusion`), nulls, NaN, empty strings, or a column stored with another type (numbers as text,
booleans as 0/1). `read_table` returns every column, each in one known type, so that nothing
downstream meets a value it does not expect. `run_py` is only ever shown, never run.
"""
from __future__ import annotations

import math
import os
import platform
import re
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from common.errors import UserError
from common.results import atomic_path

# In the order the public dataset lists them. The names are the dataset's: hbm_*_gb hold GiB (2**30 bytes).
PUBLIC_COLUMNS = (
    "model_id", "library", "tp", "runner", "result", "notes", "error", "exclusion", "wall_s",
    "hbm_peak_gb", "hbm_capacity_gb", "cpu_match", "english", "neuronx_cc", "library_version",
    "transformers", "accelerate", "torch_neuronx", "torch", "nki", "python", "neuron_driver",
    "tested_at", "run_py",
)
# Ours, after the public ones: what the protocol measures or needs to be reproduced.
EXTRA_COLUMNS = (
    "device", "compile_s", "prompt", "generated_text", "judge", "task",
    "image",  # image-text-to-text: the image file and its sha256
    "compile_cache",  # where the compiled graphs were cached (NEFF cache on Trainium, inductor's elsewhere)
    "packages",  # JSON {name: version}: the other packages the run used
    "run_args",  # the flags that rerun this model with this row's settings
    "timings",  # JSON {load_s, generate_s, reference_s, judge_s}: where the time went
    "unavailable",  # true: the model could not be fetched; no verdict, a rerun tries it again
    "train_losses", "train_tokens_per_s", "export_max_abs_logit_diff",  # --task train
)
COLUMNS = PUBLIC_COLUMNS + EXTRA_COLUMNS
# A row's task. Files in the public schema have no `task` column: their rows read as text-generation.
TASKS = ("text-generation", "image-text-to-text", "train")
# A row's result: PASS, FAIL (with `error` set where the run crashed, timed out or was non-finite) or EXCLUDED.
VERSION_COLUMNS = ("neuronx_cc", "library_version", "transformers", "accelerate", "torch_neuronx",
                   "torch", "nki", "python", "neuron_driver")
FLOAT_COLUMNS = ("tp", "wall_s", "hbm_peak_gb", "hbm_capacity_gb", "compile_s", "train_tokens_per_s",
                 "export_max_abs_logit_diff")
BOOL_COLUMNS = ("cpu_match", "english", "unavailable")


def _arrow_schema():
    import pyarrow as pa

    types = {c: pa.float64() for c in FLOAT_COLUMNS} | {c: pa.bool_() for c in BOOL_COLUMNS}
    types |= {"tp": pa.int64(), "tested_at": pa.timestamp("us", tz="UTC")}
    return pa.schema([(c, types.get(c, pa.string())) for c in COLUMNS])


# ------------------------------------------------------------------------------------------ versions
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def neuron_driver_version() -> str | None:
    """The Neuron kernel driver's version, as the aws-neuronx-dkms module reports it (None off Trainium)."""
    path = Path("/sys/module/neuron/version")
    return path.read_text().strip() if path.is_file() else None


def stack_versions() -> dict[str, str | None]:
    """The version columns of a row: compiler, library and everything else the run depended on."""
    transformers = _version("transformers")
    return {
        "neuronx_cc": _version("neuronx-cc"), "library": "transformers", "library_version": transformers,
        "transformers": transformers, "accelerate": _version("accelerate"),
        "torch_neuronx": _version("torch-neuronx"), "torch": _version("torch"), "nki": _version("nki"),
        "python": platform.python_version(), "neuron_driver": neuron_driver_version(),
    }


def other_packages(task: str) -> dict[str, str | None]:
    """The packages besides the version stack that a row's run used (shown as its extra packages)."""
    names = ["tokenizers", "safetensors", "huggingface-hub", "numpy", "wordfreq"]
    if task == "image-text-to-text":
        names += ["pillow", "torchvision"]
    if task == "train":
        names += ["torchtitan", "datasets"]
    return {n: _version(n) for n in names}


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


def normalize(df):
    """Every column of COLUMNS present, each in one type: float64 (NaN for null or unreadable),
    object bool/None, UTC timestamps (NaT), or object str/None."""
    import pandas as pd

    df = df.copy()
    df.columns = [str(c) for c in df.columns]
    for col in COLUMNS:
        if col not in df.columns:
            df[col] = None
        values = df[col].astype(object)
        if col in FLOAT_COLUMNS:
            df[col] = pd.to_numeric(values.map(_float), errors="coerce").astype("float64")
        elif col in BOOL_COLUMNS:
            df[col] = values.map(_bool).astype(object)
        elif col == "tested_at":
            df[col] = pd.to_datetime(values.map(lambda v: v if isinstance(v, (datetime, pd.Timestamp)) else _text(v)),
                                     errors="coerce", utc=True, format="mixed")
        else:
            df[col] = values.map(_text).astype(object)
    df["task"] = df["task"].map(task_of)
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


def read_table(path: str | os.PathLike):
    """One results file as a normalized DataFrame (see `normalize`). UserError if it is not a readable Parquet file."""
    import pyarrow.parquet as pq

    try:
        df = pq.read_table(path).to_pandas()
    except Exception as e:  # noqa: BLE001  pyarrow raises many types for a bad file; each becomes one line
        raise UserError(f"{path} is not a readable Parquet file: {type(e).__name__}: {str(e)[:300]}") from None
    return normalize(df)


def recorded(path: Path, model_id: str, stack: dict, tasks: tuple[str, ...]) -> dict | None:
    """The verdict already recorded for `model_id` (one of `tasks`) with exactly this version stack, or None.
    A row whose model could not be fetched is no verdict: it is tried again."""
    if not path.is_file():
        return None
    df = read_table(path)
    rows = df[(df["model_id"] == model_id) & df["task"].isin(tasks) & (df["unavailable"] != True)]  # noqa: E712
    for _, row in rows.iterrows():
        if all(row[c] == stack.get(c) for c in VERSION_COLUMNS):
            return row.to_dict()
    return None


# ------------------------------------------------------------------------------------------ writing
def write_row(path: Path, row: dict) -> None:
    """Add (or replace) one model's row for its task, atomically: the file is rewritten beside itself and renamed,
    so a run killed at any moment leaves the previous complete file, and every finished row readable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    row = {c: row.get(c) for c in schema.names}
    row["tested_at"] = row["tested_at"] or datetime.now(timezone.utc)
    new = pa.Table.from_pylist([row], schema=schema)
    if path.is_file():
        old = pq.read_table(path)
        def column(name):
            return old.column(name).to_pylist() if name in old.column_names else [None] * len(old)
        key = (row["model_id"], task_of(row["task"]))
        # The row it replaces, and any "not fetched" row of the same model (its task was a guess then).
        keep = [i for i, (m, t, gone) in enumerate(zip(column("model_id"), column("task"), column("unavailable")))
                if (m, task_of(t)) != key and not (m == row["model_id"] and gone is True)]
        old = old.take(pa.array(keep, type=pa.int64()))  # typed: an empty list would infer null
        old = old.select([c for c in schema.names if c in old.column_names])
        for c in schema.names:
            if c not in old.column_names:
                old = old.append_column(schema.field(c), pa.nulls(len(old), schema.field(c).type))
        try:
            old = old.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise UserError(f"{path} was not written by this script (its columns do not cast: {e}); "
                            "choose another --out_dir") from None
        new = pa.concat_tables([old, new])
    with atomic_path(path) as tmp:
        pq.write_table(new, tmp)
