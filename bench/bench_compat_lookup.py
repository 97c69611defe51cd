"""Benchmark: the lookup with the Hub's rankings at scale, as a user runs it: 100,000 rows and 100,000 ranked
records, in the terminal (the Trending view) and with the page (`--html`).

The rows are bench_compat_page's generated rows (seeded), each with the `run_args` the check writes for it (its own
`--models`, so every row's rerun command is distinct text); the rankings file holds `--ranked` records over both
tasks, half of them models with rows, the rest models nobody tested. Each sample is the example's own command in a
subprocess, timed from outside (wall seconds, and the CPU seconds the process used, which load from other jobs
inflates less):
    terminal   `generate_compat_check.py lookup ROWS --rankings FILE`              (the Trending view's table)
    html       `generate_compat_check.py lookup ROWS --rankings FILE --html PAGE`  (the table, then the page)
    start-up   the terminal command on one row and one ranked record: interpreter, imports, reading the files
The ratio printed is each command's median over start-up's, measured in the same rounds (alternating, the order
reversed every other round): how many start-ups the records cost.

    python bench/bench_compat_lookup.py --out_dir runs/bench/compat_lookup          # about 1 min on 2 cores
    python bench/bench_compat_lookup.py --preset tiny --out_dir runs/bench/lookup   # 500 rows and records (tests)
"""
from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from bench.bench_compat_page import generated_rows, write_rows  # noqa: E402
from common import cli  # noqa: E402
from common.results import atomic_write_text  # noqa: E402

SCRIPT = cb.ROOT / "examples" / "generate_compat_check.py"


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/compat_lookup", metadata={"help": "results.json, inputs, the page"})
    rows: int = field(default=100_000, metadata={"help": "generated rows", **cli.bounds(1, 1_000_000)})
    ranked: int = field(default=100_000, metadata={"help": "ranked records in the rankings file",
                                                   **cli.bounds(1, 1_000_000)})
    repeats: int = field(default=3, metadata={"help": "alternating rounds (medians reported)",
                                              **cli.bounds(1, 100)})


def default() -> Config:
    """100,000 rows and 100,000 ranked records, 3 rounds."""
    return Config()


def tiny() -> Config:
    """Harness check: 500 rows and records, 1 round."""
    return replace(Config(), rows=500, ranked=500, repeats=1)


PRESETS = {"default": default, "tiny": tiny}


def inputs(folder: Path, n_rows: int, n_ranked: int, seed: int = 0) -> tuple[Path, Path]:
    """A results file of `n_rows` generated rows (with their run_args) and a rankings file of `n_ranked` records."""
    rows = generated_rows(n_rows, seed)
    for r in rows:  # as the check writes them (generate_compat_check.rerun_args)
        r["run_args"] = f"--models {r['model_id']} --task {r['task']} --device cpu --cores {r['tp']} --no_compile"
    results = write_rows(folder / "rows" / "generated.parquet", rows)
    rng = random.Random(seed + 1)
    ids = {task: [r["model_id"] for r in rows if r["task"] == task] for task in ("text-generation",
                                                                                 "image-text-to-text")}
    models = []
    for i in range(n_ranked):
        task = ("text-generation", "image-text-to-text")[i % 2]
        tested = ids[task] and rng.random() < 0.5
        models.append({"model_id": rng.choice(ids[task]) if tested else f"hub/untested-{i:06d}", "task": task,
                       "downloads_rank": i // 2 + 1, "trending_rank": i // 2 + 1 if rng.random() < 0.8 else None,
                       "downloads": rng.randint(0, 10**7), "trending_score": rng.randint(0, 100),
                       "likes": rng.randint(0, 5000), "fetched_at": "2026-12-01T10:00:00+00:00"})
    ranks = folder / "rankings.json"
    atomic_write_text(ranks, json.dumps({"fetched_at": "2026-12-01T10:00:00+00:00",
                                         "tasks": ["text-generation", "image-text-to-text"], "models": models}))
    return results, ranks


def timed(args: list[str], log: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `generate_compat_check.py ARGS`, which must exit 0."""
    cmd = [sys.executable, str(SCRIPT), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cb.ROOT, env=cb.training_env(), capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cb.save_log(log, proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    t0 = time.perf_counter()
    results, ranks = inputs(out_dir / "inputs", cfg.rows, cfg.ranked)
    small_results, small_ranks = inputs(out_dir / "inputs_start_up", 1, 1)
    print(f"[bench] {cfg.rows:,} rows, {cfg.ranked:,} ranked records written in {time.perf_counter() - t0:.1f} s")
    page = out_dir / "page.html"
    commands = {"start-up": [str(small_results), "--rankings", str(small_ranks)],
                "terminal": [str(results), "--rankings", str(ranks)],
                "html": [str(results), "--rankings", str(ranks), "--html", str(page)]}
    cpu: dict[str, list[float]] = {name: [] for name in commands}

    def one(name: str):
        def call() -> float:
            wall, used = timed(["lookup", *commands[name]], out_dir / f"{name}.log")
            cpu[name].append(used)
            return wall
        return call

    samples = cb.alternate({name: one(name) for name in commands}, repeats=cfg.repeats, warmup=1)
    start = cb.summary(samples["start-up"])["median"]
    start_cpu = cb.summary(cpu["start-up"][1:])["median"]  # the warm-up round's sample left out, as for wall
    rows = []
    for name in commands:
        wall, used = cb.summary(samples[name])["median"], cb.summary(cpu[name][1:])["median"]
        rows.append({"command": name, "wall_s": wall, "cpu_s": used, "over_start_up": cb.ratio(wall, start),
                     "cpu_over_start_up": cb.ratio(used, start_cpu)})
    table = cb.format_table(rows, [("command", "command", ""), ("wall_s", "wall s (median)", ".2f"),
                                   ("cpu_s", "CPU s (median)", ".2f"), ("over_start_up", "wall / start-up", ".2f"),
                                   ("cpu_over_start_up", "CPU / start-up", ".2f")])
    table += (f"\n{cfg.rows:,} rows, {cfg.ranked:,} ranked records (terminal and html); start-up: 1 row, 1 ranked "
              f"record; medians of {cfg.repeats} alternating round(s); page {page.stat().st_size / 1e6:.1f} MB")
    out = {"config": cfg, "rows": rows, "page_bytes": page.stat().st_size,
           "baseline": "the same lookup on 1 row and 1 ranked record (start-up), measured in the same rounds",
           "method": {"repeats": cfg.repeats, "order": "alternating commands per round", "statistic": "median"},
           "samples": {name: {"wall_s": samples[name], "cpu_s": cpu[name]} for name in commands}}
    cb.write(out_dir, "compat_lookup", out, table)
    return out


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
