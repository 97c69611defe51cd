"""Plumbing for examples/generate_compat_check.py: sizing, the Parquet results, the English judge, the lookup.

The results mirror the public dataset aws-neuron/torch-neuronx-model-support: one Parquet file per
combination of compiler (neuronx-cc) and library (transformers) versions, one row per model, in the
dataset's columns (`PUBLIC_COLUMNS`) plus a few of ours (`EXTRA_COLUMNS`). The public files differ
slightly in their columns (some lack `exclusion`), so every reader here takes the union of columns
and fills what a file lacks with nulls.

    python -m compat_check.rows lookup --name qwen3 runs/compat          # search our files and public ones
    python -m compat_check.rows lookup --name tiny-qwen3 --run_py runs/compat   # print a row's script

`run_py` holds the exact source of the script that produced a row. It is only ever printed, never run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from common import device
from common.errors import UserError


# ------------------------------------------------------------------------------------------ columns
# In the order the public dataset lists them (see ../shared/docs/neuron-notes.md).
PUBLIC_COLUMNS = (
    "model_id", "library", "tp", "runner", "result", "notes", "error", "exclusion", "wall_s",
    "hbm_peak_gb", "hbm_capacity_gb", "cpu_match", "english", "neuronx_cc", "library_version",
    "transformers", "accelerate", "torch_neuronx", "torch", "nki", "python", "neuron_driver",
    "tested_at", "run_py",
)
# Ours, after the public ones: what the protocol measures but the public files do not hold.
EXTRA_COLUMNS = ("device", "compile_s", "prompt", "generated_text", "judge",
                 # --task train (training compatibility): a few steps of the HF-backend recipe
                 "task", "train_losses", "train_tokens_per_s", "export_max_abs_logit_diff")
TASKS = ("generate", "train")  # a row's task; files in the public schema hold generation rows only
VERSION_COLUMNS = ("neuronx_cc", "library_version", "transformers", "accelerate", "torch_neuronx",
                   "torch", "nki", "python", "neuron_driver")
RESULTS = ("PASS", "FAIL", "EXCLUDED")  # FAIL with `error` set: the run crashed or timed out


def _arrow_schema():
    import pyarrow as pa

    types = {"tp": pa.int64(), "wall_s": pa.float64(), "hbm_peak_gb": pa.float64(),
             "hbm_capacity_gb": pa.float64(), "cpu_match": pa.bool_(), "english": pa.bool_(),
             "tested_at": pa.timestamp("us", tz="UTC"), "compile_s": pa.float64(),
             "train_tokens_per_s": pa.float64(), "export_max_abs_logit_diff": pa.float64()}
    return pa.schema([(c, types.get(c, pa.string())) for c in PUBLIC_COLUMNS + EXTRA_COLUMNS])


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


def results_file(out_dir: str | os.PathLike, stack: dict) -> Path:
    """One file per compiler + library versions, as in the public dataset. Off Trainium there is no
    neuronx-cc, and the name says so ("none") rather than pretending to a compiler version."""
    def clean(v):
        return re.sub(r"[^A-Za-z0-9.+-]", "_", str(v or "none"))
    return Path(out_dir) / (f"neuronx-cc-{clean(stack['neuronx_cc'])}__{stack['library']}-"
                            f"{clean(stack['library_version'])}.parquet")


# ------------------------------------------------------------------------------------------ Parquet I/O
def read_table(path: str | os.PathLike):
    """One results file as a DataFrame holding every public and extra column (nulls where the file lacks one)."""
    import pandas as pd
    import pyarrow.parquet as pq

    try:
        df = pq.read_table(path).to_pandas()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{path} is not a readable Parquet file: {e}") from None
    for col in PUBLIC_COLUMNS + EXTRA_COLUMNS:
        if col not in df.columns:
            df[col] = pd.Series([None] * len(df), dtype="object")
    return df


def _task(value) -> str:
    return value if isinstance(value, str) and value else "generate"


def recorded(path: Path, model_id: str, stack: dict, task: str = "generate") -> dict | None:
    """The row already recorded for `model_id` and `task` with exactly this version stack, or None."""
    if not path.is_file():
        return None
    df = read_table(path)
    rows = df[(df["model_id"] == model_id) & (df["task"].map(_task) == task)]
    for _, row in rows.iterrows():
        if all((row[c] if isinstance(row[c], str) else None) == stack.get(c) for c in VERSION_COLUMNS):
            return row.to_dict()
    return None


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
        tasks = old.column("task").to_pylist() if "task" in old.column_names else [None] * len(old)
        key = (row["model_id"], _task(row["task"]))
        keep = [i for i, (m, t) in enumerate(zip(old.column("model_id").to_pylist(), tasks)) if (m, _task(t)) != key]
        old = old.take(pa.array(keep, type=pa.int64()))  # typed: an empty list would infer null
        # Our own files always have this schema; cast anyway so a hand-edited file fails loudly here.
        old = old.select([c for c in schema.names if c in old.column_names])
        for c in schema.names:
            if c not in old.column_names:
                old = old.append_column(schema.field(c), pa.nulls(len(old), schema.field(c).type))
        new = pa.concat_tables([old.select(schema.names).cast(schema), new])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(new, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------ sizing
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def weight_bytes(ckpt_dir: str | os.PathLike, run_dtype_bytes: int | None = None) -> int:
    """Bytes of the weights, from the safetensors headers alone (nothing is loaded). With
    run_dtype_bytes, floating-point tensors count at the dtype the run casts them to."""
    from common.checkpoint import checkpoint_tensors

    total = 0
    for shape, dtype in checkpoint_tensors(ckpt_dir).values():
        if dtype not in _DTYPE_BYTES:
            raise UserError(f"{ckpt_dir}: safetensors dtype {dtype} is not known to the sizing code")
        per = run_dtype_bytes if (run_dtype_bytes and dtype in _FLOAT_DTYPES) else _DTYPE_BYTES[dtype]
        total += math.prod(shape) * per
    return total


def min_cores(n_bytes: int, core_memory_gib: float) -> int:
    """The fewest cores whose memory holds the weights."""
    return max(1, math.ceil(n_bytes / (core_memory_gib * device.GIB)))


@dataclass(frozen=True)
class Plan:
    runner: str | None  # "single", "tp", "ep", or None when the model is excluded
    cores: int
    exclusion: str | None = None


def num_experts(config) -> int:
    """Experts per MoE layer (0 for a dense model), under the names transformers' configs use."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def choose_plan(config, need: int, max_cores: int, sharding: str = "auto", forced_cores: int = 0) -> Plan:
    """The protocol: the fewest cores that hold the weights; tensor parallel when the model has a TP
    plan, expert parallel alone for an MoE model without one, else no sharding plan.

    A TP degree must divide the attention and key/value head counts (transformers splits q/k/v
    projections by heads; SmolLM2's 9 heads fail on 2 ranks), and an EP degree the expert count,
    so the core count is the smallest valid degree at or above what memory needs."""
    if forced_cores:
        need = forced_cores
    if need > max_cores:
        return Plan(None, need, f"needs {need} cores for its weights, more than --max_cores {max_cores}")
    if need == 1:  # `sharding` chooses how to shard, never whether: one core is never sharded
        return Plan("single", 1)
    tp_plan = bool(getattr(config, "base_model_tp_plan", None))
    ep_plan = bool(getattr(config, "base_model_ep_plan", None))
    experts = num_experts(config)
    if sharding == "tp" or (sharding == "auto" and tp_plan):
        if not tp_plan:
            return Plan(None, need, f"no tensor-parallel plan ({type(config).__name__}.base_model_tp_plan is empty)")
        heads = getattr(config, "num_attention_heads", None) or 1
        kv = getattr(config, "num_key_value_heads", None) or heads
        divides = lambda n: heads % n == 0 and kv % n == 0  # noqa: E731
        what = f"{heads} attention and {kv} key/value heads"
        runner = "tp"
    elif sharding == "ep" or (sharding == "auto" and experts and ep_plan):
        if not (experts and ep_plan):
            return Plan(None, need, f"no expert-parallel plan (experts: {experts}, "
                                    f"{type(config).__name__}.base_model_ep_plan: {ep_plan})")
        divides = lambda n: experts % n == 0  # noqa: E731
        what = f"{experts} experts"
        runner = "ep"
    else:
        return Plan(None, need, f"no sharding plan: {type(config).__name__} has no tensor-parallel plan"
                                + (" and no expert-parallel plan" if experts else " and is not a mixture of experts"))
    candidates = [need] if forced_cores else range(need, max_cores + 1)
    for n in candidates:
        if divides(n):
            return Plan(runner, n)
    return Plan(None, need, f"no core count in {list(candidates)} divides its {what}")


def needs_remote_code(ckpt_dir: Path) -> bool:
    """A config.json with an auto_map asks transformers to import code shipped with the checkpoint."""
    try:
        return "auto_map" in json.loads((Path(ckpt_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ measurements
def compile_seconds() -> float | None:
    """Seconds this process spent in torch.compile (Dynamo tracing plus the backend compiler).

    Reads torch._dynamo.utils.compilation_time_metrics (private in torch 2.14; "_compile.compile_inner"
    times each frame compilation, backend included). Returns None when a torch release drops it."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    times = compilation_time_metrics.get("_compile.compile_inner")
    return float(sum(times)) if times is not None else None


# ------------------------------------------------------------------------------------------ judge
@dataclass(frozen=True)
class JudgeLimits:
    """What the English verdict asks of a generation. Calibrated with SmolLM2-135M as the judge: a
    simple fluent sentence scores 10-80, Austen passages cut mid-sentence 60-235 (measured on the
    offline corpus), keyboard gibberish 600-1,100, word-shuffled text 5,000+ (offline-assets.md).
    Repetition ("the the the") scores deceptively low, hence the word-level signals beside it."""
    max_perplexity: float = 250.0
    min_words: int = 8
    max_oov_rate: float = 0.15  # share of words wordfreq does not know in English
    min_distinct_bigrams: float = 0.6  # distinct word bigrams / all word bigrams (repetition)


class EnglishJudge:
    """A small causal LM on CPU that scores a continuation for fluent English."""

    def __init__(self, model_dir: str | os.PathLike, limits: JudgeLimits = JudgeLimits()):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.limits = str(model_dir), limits
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # Start-of-document marker: <|endoftext|> where the vocabulary has one (SmolLM2: id 0).
        eot = self.tok.convert_tokens_to_ids("<|endoftext|>")
        self.start_id = eot if isinstance(eot, int) and eot != self.tok.unk_token_id else (
            self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id)

    def perplexity(self, text: str, context: str = "") -> float:
        """Perplexity of `text` given `context` (the prompt), over the text's tokens only."""
        import torch

        ctx = [self.start_id, *self.tok.encode(context, add_special_tokens=False)]
        ids = self.tok.encode(text, add_special_tokens=False)
        if not ids:
            return float("inf")
        inp = torch.tensor([ctx + ids])
        labels = torch.tensor([[-100] * len(ctx) + ids])
        with torch.no_grad():
            return float(self.model(inp, labels=labels).loss.exp())

    def judge(self, text: str, prompt: str = "") -> dict[str, Any]:
        import wordfreq

        words = wordfreq.tokenize(text, "en")
        alpha = [w for w in words if any(ch.isalpha() for ch in w)]
        oov = sum(wordfreq.zipf_frequency(w, "en") == 0 for w in alpha) / max(len(alpha), 1)
        bigrams = list(zip(words, words[1:]))
        distinct = len(set(bigrams)) / len(bigrams) if bigrams else 0.0
        ppl = self.perplexity(text, prompt)
        lim = self.limits
        reasons = []
        if len(words) < lim.min_words:
            reasons.append(f"{len(words)} words < {lim.min_words}")
        if not ppl <= lim.max_perplexity:
            reasons.append(f"perplexity {ppl:.1f} > {lim.max_perplexity}")
        if oov > lim.max_oov_rate:
            reasons.append(f"out-of-vocabulary words {oov:.0%} > {lim.max_oov_rate:.0%}")
        if distinct < lim.min_distinct_bigrams:
            reasons.append(f"distinct bigrams {distinct:.2f} < {lim.min_distinct_bigrams} (repetition)")
        return {"english": not reasons, "perplexity": ppl, "words": len(words), "oov_rate": oov,
                "distinct_bigrams": distinct, "reasons": reasons, "judge_model": self.model_dir}


# ------------------------------------------------------------------------------------------ lookup
def find_result_files(sources: Iterable[str | os.PathLike]) -> list[Path]:
    files = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files += sorted(p.rglob("*.parquet"))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"{src} is neither a Parquet file nor a folder of them")
    if not files:
        raise UserError(f"no .parquet files in {', '.join(map(str, sources))}")
    return files


def load_results(sources: Iterable[str | os.PathLike]):
    """Every row of every file, columns unioned (a file without `exclusion` gets nulls there)."""
    import pandas as pd

    frames = []
    for f in find_result_files(sources):
        df = read_table(f)
        df["source_file"] = str(f)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def filter_results(df, name: str | None = None, compiler: str | None = None, transformers: str | None = None,
                   task: str | None = None):
    if task:
        df = df[df["task"].map(_task) == task]
    if name:
        df = df[df["model_id"].astype(str).str.contains(name, case=False, regex=False)]
    if compiler:
        df = df[df["neuronx_cc"].fillna("none").astype(str).str.startswith(compiler)]
    if transformers:
        tv = df["transformers"].fillna(df["library_version"]).fillna("").astype(str)
        df = df[tv.str.startswith(transformers)]
    return df


SHOW = ("model_id", "task", "result", "tp", "runner", "wall_s", "hbm_peak_gb", "cpu_match", "english",
        "neuronx_cc", "transformers", "exclusion", "error")


def format_results(df) -> str:
    if df.empty:
        return "(no matching rows)"
    import pandas as pd

    view = df[list(SHOW)].copy()
    view["task"] = view["task"].map(_task)
    view["wall_s"] = view["wall_s"].round(1)
    view["hbm_peak_gb"] = view["hbm_peak_gb"].round(2)
    view["error"] = view["error"].map(lambda e: str(e).strip().splitlines()[0][:60] if isinstance(e, str) else e)
    view["exclusion"] = view["exclusion"].map(lambda e: str(e)[:50] if isinstance(e, str) else e)
    view = view.astype(object).where(view.notna(), "-")  # one mark for "not recorded", whatever the column type
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_colwidth", 60):
        return view.rename(columns={"tp": "cores"}).to_string(index=False)


def lookup_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="lookup", description="Search compatibility results: ours (runs/...) and files in the public schema.")
    p.add_argument("sources", nargs="+", help="Parquet files or folders holding them")
    p.add_argument("--name", help="case-insensitive substring of model_id")
    p.add_argument("--compiler", help="neuronx-cc version prefix ('none': runs without Neuron)")
    p.add_argument("--transformers", help="transformers version prefix")
    p.add_argument("--task", choices=TASKS, help="generation rows or training rows (default: both)")
    p.add_argument("--run_py", action="store_true",
                   help="print the run_py (script source) of the one matching row instead of the table; "
                        "it is printed, never executed")
    args = p.parse_args(argv)
    try:
        df = filter_results(load_results(args.sources), args.name, args.compiler, args.transformers, args.task)
        if args.run_py:
            if len(df) != 1:
                ids = ", ".join(f"{m} ({f})" for m, f in zip(df["model_id"], df["source_file"]))
                raise UserError(f"--run_py needs exactly one matching row, found {len(df)}"
                                + (f": {ids}; narrow --name/--compiler/--transformers" if ids else ""))
            source = df["run_py"].iloc[0]
            if not isinstance(source, str) or not source:
                raise UserError(f"the row for {df['model_id'].iloc[0]} holds no run_py")
            sys.stdout.write(source if source.endswith("\n") else source + "\n")
        else:
            print(format_results(df))
            print(f"{len(df)} row(s)")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "lookup":
        print("usage: python -m compat_check.rows lookup SOURCES... [--name N] [--compiler V] [--transformers V] [--run_py]",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(lookup_main(sys.argv[2:]))
