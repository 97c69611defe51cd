"""The harness every benchmark in bench/ shares: alternating repeats, medians, ratios, the machine's
description and peak, the training-run launcher, a table, and results.json.

Why alternate: on a shared 2-core machine, load from other processes comes and goes over minutes.
Running baseline and candidate back to back inside each round (A B, then B A in the next round)
spreads that drift over both, and the median over rounds drops the rounds a burst hit. Warm-up
rounds (first call: allocator, lazy imports, op registration) are run and thrown away.
Every ratio is computed from medians measured in the same run, never against a stored number.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.results import atomic_write_text, replace_dir, versions, write_results  # noqa: E402


def save_log(path: Path, proc: subprocess.CompletedProcess) -> None:
    """A finished subprocess's stdout and stderr, in one file written atomically."""
    atomic_write_text(path, proc.stdout + "\n--- stderr\n" + proc.stderr)


# ------------------------------------------------------------------------------ alternating repeats

def alternate(candidates: dict[str, Callable[[], float]], *, repeats: int, warmup: int = 1,
              log: Callable[[str], None] | None = print) -> dict[str, list[float]]:
    """Call every candidate once per round, `warmup` + `repeats` rounds, the order reversed every
    other round (A B C, C B A, ...). Each call returns one sample (seconds, or any figure where
    lower is better); warm-up rounds are discarded. Returns {name: [samples]}."""
    names = list(candidates)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            value = candidates[name]()
            if r >= warmup:
                samples[name].append(value)
            if log:
                tag = "warm-up" if r < warmup else f"round {r - warmup + 1}/{repeats}"
                log(f"[bench] {tag} {name}: {value:.6g}")
    return samples


def summary(values: list[float]) -> dict:
    """Median and spread of samples (NaNs dropped); the median is the figure every ratio uses."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0, "samples": list(values)}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals),
            "samples": list(values)}


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and math.isfinite(denominator) else math.nan


def time_call(fn: Callable[[], object], *, iters: int) -> float:
    """Median seconds of one call of `fn` over `iters` calls (the benchmark's one sample)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------ the machine
def machine() -> dict:
    """What ran the benchmark: CPU model (lscpu), cores, threads torch uses, load at the start."""
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_model": _lscpu().get("Model name") or platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return info


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def nominal_peak_flops(cores: int | None = None) -> dict:
    """Float32 peak from the data sheet arithmetic: cores x clock x FLOPs per cycle per core
    (`cores`: the cores the run may use, e.g. its thread count; default all).
    FLOPs per cycle: 2 FMA pipes x (vector width / 32 bits) x 2 (a fused multiply-add is 2 FLOPs);
    vector width 512 with avx512f, 256 with avx2/fma, 128 otherwise. The clock is /proc/cpuinfo's
    `cpu MHz` (what the hypervisor reports, not a boost clock), so this is an estimate."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    mhz = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    flags = next((line.split(":")[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    width = 512 if "avx512f" in flags else 256 if ("avx2" in flags and "fma" in flags) else 128
    per_cycle = 2 * (width // 32) * 2
    cores = cores or os.cpu_count() or 1
    clock_hz = (statistics.median(mhz) if mhz else math.nan) * 1e6
    return {"flops": cores * clock_hz * per_cycle, "cores": cores, "clock_ghz": clock_hz / 1e9,
            "flops_per_cycle_per_core": per_cycle, "vector_bits": width,
            "how": f"{cores} cores x {clock_hz / 1e9:.2f} GHz (/proc/cpuinfo) x {per_cycle} FLOP/cycle "
                   f"(2 FMA pipes x {width // 32} fp32 lanes x 2)"}


def measured_matmul_flops(n: int = 2048, iters: int = 5) -> float:
    """Float32 FLOP/s of one large square matmul on torch's current threads (the best of `iters`):
    the practical peak the MFU figures are divided by, measured in the same run."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool, packing buffers
    best = min(_timed(lambda: a @ b) for _ in range(iters))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


THREADS_HELP = ("torch intra-op threads per process (0: torch's default, one per core). 1 by default: on a "
                "shared machine a second thread waits for a busy core at every op, which times the scheduler, "
                "not the code (measured here: 10x slower RoPE calls at 2 threads under load)")


@dataclass
class TrainingBench:
    """The flags of the benchmarks that time training processes; their Config adds its own."""
    preset: str = "default"
    steps: int = field(default=6, metadata={"help": "training steps per process (step 1 is not timed)",
                                            **cli.bounds(3, 10**5, why="step 1 is warm-up, untimed")})
    threads: int = field(default=1, metadata={"help": THREADS_HELP, **cli.bounds(0, 1024)})
    repeats: int = field(default=2, metadata={"help": "processes of each kind, alternating", **cli.bounds(1, 100)})


def write_call_bench(out_dir: Path, name: str, cfg, threads: int, table: str, *, baseline: str,
                     compared_with: str, **figures) -> dict:
    """results.json and the table of a benchmark that times calls (bench_moe, bench_rope); returns the results."""
    results = {"config": cfg, "baseline": baseline, "compared_with": compared_with,
               "method": {"torch_threads": threads, "repeats": cfg.repeats, "warmup_rounds": cfg.warmup,
                          "calls_per_sample": cfg.iters, "statistic": "median over rounds of the median call time"},
               **figures}
    write(out_dir, name, results, table)
    return results


def set_threads(threads: int) -> int:
    """Apply --threads to this process (0: keep torch's default); returns the count in use."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# --------------------------------------------------------------------------------- training runs
def training_env(threads: int = 0) -> dict:
    """Environment for a training subprocess: offline, unbuffered, no inherited launcher variables,
    OMP_NUM_THREADS from --threads (torch reads it at start; torchrun sets 1 per worker otherwise)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


# The training scripts a bench runs, by the names its --scripts flag takes.
TRAINING_SCRIPTS = {"native": "train_native_qwen3.py", "hf": "train_hf_backend.py", "moe": "train_moe_nki.py"}


def script_names(text: str) -> list[str]:
    """--scripts: a comma-separated subset of TRAINING_SCRIPTS' names (one UserError otherwise)."""
    names = [s for s in text.split(",") if s]
    if not names or any(s not in TRAINING_SCRIPTS for s in names):
        raise UserError(f"--scripts takes a comma-separated subset of {', '.join(TRAINING_SCRIPTS)}, got {text!r}")
    return names


class TrainingRun(NamedTuple):
    """One kind of training process: bench/timed_train.py's `mode` ('ours': the example's own CLI;
    'stock': torchtitan's entry point on the Trainer.Config the example builds), the example's file
    name in examples/, the example's flags, the process count, and timed_train.py's own flags
    (e.g. `--fix_hf_rotary`)."""
    mode: str
    script: str
    args: list[str]
    nproc: int = 1
    launcher_flags: tuple[str, ...] = ()
    env: dict | None = None  # variables set for this kind's processes (TORCHINDUCTOR_CACHE_DIR, say)


def run_training(mode: str, script: str, args: list[str], timing_file: Path, *, nproc: int = 1,
                 threads: int = 0, timeout: int = 1800, log_dir: Path | None = None,
                 launcher_flags: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """One training process (or `nproc` under torchrun) through bench/timed_train.py; returns the
    per-step timing record it wrote. `mode`: 'ours' (the example's own CLI) or 'stock' (torchtitan's
    entry point on the Trainer.Config the example builds); `launcher_flags`: timed_train.py's own."""
    launcher = str(ROOT / "bench" / "timed_train.py")
    inner = [launcher, "--mode", mode, *launcher_flags, "--timing_file", str(timing_file),
             str(ROOT / "examples" / script), *args]
    cmd = [sys.executable, *inner]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--local-ranks-filter=0", *inner]
    timing_file.unlink(missing_ok=True)
    t0, started = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**training_env(threads), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        save_log(log_dir / f"{timing_file.stem}.log", proc)
    if proc.returncode != 0 or not timing_file.exists():
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                           f"\n--- stderr\n{proc.stderr[-5000:]}")
    record = json.loads(timing_file.read_text())
    record["process_wall_s"] = wall
    record["to_first_step_s"] = record["first_step_end_wall"] - started  # the command to the end of step 1
    return record


def step_stats(record: dict) -> dict:
    """Step time of one run: the median of the per-step intervals, leaving out step 1 (warm-up:
    first-touch allocations, lazy initialisation), and tokens/s and FLOP/s from it."""
    times, tokens = record["times"], record["tokens_seen"]
    if len(times) < 3:
        raise RuntimeError("a timed run needs at least 2 steps (step 1 is warm-up)")
    # times[0] is the start of training; times[i] the end of step i.
    dts = [b - a for a, b in zip(times[1:], times[2:])]
    tokens_per_step = (tokens[-1] - tokens[0]) / (len(tokens) - 1)
    step_s = statistics.median(dts)
    cpu = record.get("cpu_times") or []
    cpu_step_s = statistics.median([b - a for a, b in zip(cpu[1:], cpu[2:])]) if len(cpu) >= 3 else math.nan
    return {"step_s": step_s, "cpu_step_s": cpu_step_s, "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_step / step_s,
            "flops_per_token": record.get("flops_per_token"), "steps_timed": len(dts),
            "losses": record.get("losses")}


def alternate_training(runs: dict[str, tuple], *, repeats: int, out_dir: Path, threads: int = 0,
                       warmup: int = 0) -> dict[str, list[dict]]:
    """Alternate whole training processes: runs = {name: TrainingRun or a tuple of its fields}. No
    warm-up round by default: each process already drops its own step 1. Returns {name: [step_stats]}."""
    stats: dict[str, list[dict]] = {n: [] for n in runs}
    counter = {n: 0 for n in runs}

    def one(name):
        def call() -> float:
            run = TrainingRun(*runs[name])
            counter[name] += 1
            tag = f"{name}.{counter[name]}"
            record = run_training(run.mode, run.script, [*run.args, "--out_dir", str(out_dir / "runs" / tag)],
                                  out_dir / "timings" / f"{tag}.json", nproc=run.nproc, threads=threads,
                                  log_dir=out_dir / "logs", launcher_flags=tuple(run.launcher_flags), env=run.env)
            s = step_stats(record)
            s["process_wall_s"], s["to_first_step_s"] = record["process_wall_s"], record["to_first_step_s"]
            stats[name].append(s)
            return s["step_s"]
        return call

    (out_dir / "timings").mkdir(parents=True, exist_ok=True)
    alternate({n: one(n) for n in runs}, repeats=repeats, warmup=warmup)
    if warmup:  # the warm-up processes' stats were appended too: drop them
        for n in stats:
            stats[n] = stats[n][warmup:]
    return stats


def training_summary(stats: list[dict]) -> dict:
    """Medians over the repeats of the per-run medians."""
    return {"step_s": summary([s["step_s"] for s in stats]),
            "cpu_step_s": summary([s["cpu_step_s"] for s in stats]),
            "tokens_per_s": summary([s["tokens_per_s"] for s in stats]),
            "process_wall_s": summary([s["process_wall_s"] for s in stats]),
            "to_first_step_s": summary([s["to_first_step_s"] for s in stats]),
            "tokens_per_step": stats[0]["tokens_per_step"], "flops_per_token": stats[0]["flops_per_token"],
            "first_losses": stats[0]["losses"][:3] if stats[0]["losses"] else None}


# ------------------------------------------------------------------------------- output
def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table; columns = [(key, header, format)], format as in format(value, fmt)."""
    def cell(row, key, fmt):
        v = row.get(key)
        if v is None:
            return "-"
        if isinstance(v, float) and not math.isfinite(v):
            return "nan"
        return format(v, fmt) if fmt else str(v)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def write(out_dir: Path, name: str, results: dict, table: str) -> Path:
    """results.json with the benchmark's name, machine, versions and the table text."""
    results = {"benchmark": name, "machine": machine(), "versions": versions(), **results, "table": table}
    path = write_results(out_dir, results)
    print(table)
    print(f"[bench] {name}: {path}")
    return path


def seeded_qwen3(folder: Path, overrides: dict) -> Path:
    """A seeded random Qwen3 HF folder: the tiny Qwen3's config.json with `overrides` (size keys), and
    its tokenizer files. Reused when the folder already holds that shape; written under a temp name."""
    import shutil

    import torch
    import transformers

    from common import checkpoint, paths

    tiny = paths.asset_dir("tiny_qwen3")  # checked against its manifest once
    base = {k: v for k, v in checkpoint.read_hf_config(tiny).items()
            if k not in ("layer_types", "transformers_version")}  # layer_types: one per layer of the tiny model
    if (folder / "model.safetensors").is_file() and all(checkpoint.read_hf_config(folder).get(k) == v
                                                        for k, v in overrides.items()):
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**base, **overrides})).save_pretrained(tmp)
    for name in checkpoint.TOKENIZER_FILES:  # the ones the tiny model's folder has (some are optional)
        if (tiny / name).is_file():
            shutil.copy2(tiny / name, tmp / name)
    replace_dir(tmp, folder)
    return folder
