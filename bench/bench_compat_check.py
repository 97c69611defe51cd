"""Benchmark: where the compatibility check's time goes, per model, as a user runs it.

Each sample is the example's own command, `python examples/generate_compat_check.py --models M --redo
--new_tokens N [--no_compile] --out_dir OUT/runs`, in a subprocess, timed from outside (process_s). The
stage split comes from the row the command writes (its Parquet `wall_s_precise`, `compile_s` and `timings`,
measured inside the run by the script itself):
    load_s        model load, tokenizer or processor, inputs (the device run)
    compile_s     torch.compile (Dynamo + inductor; 0 with --no_compile, the default here)
    generation_s  32 greedy tokens, static cache, minus compile_s
    reference_s   the CPU eager run that `cpu_match` compares against (load + generate)
    judging_s     the English judge (its model load included: once per command)
    other_s       process_s minus the stages: interpreter start, imports, spawning the model's process,
                  the Parquet and results.json writes
Models alternate in rounds (order reversed every other round), `--repeats` rounds, medians per figure.
The ratio printed is stages_s / process_s: the share of the whole command (the baseline, measured in the
same round) that the protocol's own stages take.

    python bench/bench_compat_check.py --out_dir runs/bench/compat                # about 4 minutes on 2 cores
    python bench/bench_compat_check.py --preset tiny --out_dir runs/bench/compat_tiny   # tests

Compiling with inductor on CPU costs about 90 s per model the first time (`--compile` to include it).
results.json: `rows` (one per model: medians in s, shares, the ratio), `samples`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402

SCRIPT = cb.ROOT / "examples" / "generate_compat_check.py"
STAGES = ("load_s", "compile_s", "generation_s", "reference_s", "judging_s")


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/compat", metadata={"help": "results.json and runs/ go here"})
    models: str = field(default="tiny-qwen3,tiny-qwen3-moe,smollm2-135m-instruct,tiny-qwen-vl",
                        metadata={"help": "comma-separated offline asset names or HF folders"})
    new_tokens: int = field(default=32, metadata={"help": "greedy tokens generated per model", **cli.bounds(1, 4096)})
    compile: bool = field(default=False, metadata={"help": "compile the forward with inductor (~90 s per model)"})
    repeats: int = field(default=3, metadata={"help": "alternating rounds", **cli.bounds(1, 100)})

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if not [m for m in self.models.split(",") if m.strip()]:
            raise UserError("--models is empty")


def default() -> Config:
    """The four offline models, eager, 32 tokens, 3 rounds."""
    return Config()


def tiny() -> Config:
    """Harness check: tiny-qwen3 only, 4 tokens, 1 round."""
    return replace(Config(), models="tiny-qwen3", new_tokens=4, repeats=1)


PRESETS = {"default": default, "tiny": tiny}


def run_check(cfg: Config, model: str, out_dir: Path) -> dict:
    """The example's command for one model, timed from outside; the figures from the row it wrote."""
    import pyarrow.parquet as pq

    cmd = [sys.executable, str(SCRIPT), "--models", model, "--new_tokens", str(cfg.new_tokens), "--redo",
           "--out_dir", str(out_dir)] + ([] if cfg.compile else ["--no_compile"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cb.ROOT, env=cb.training_env(), capture_output=True, text=True, timeout=3600)
    process_s = time.perf_counter() - t0
    cb.save_log(out_dir / f"{Path(model).name}.log", proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    (path,) = json.loads((out_dir / "results.json").read_text())["files"]
    (row,) = [r for r in pq.read_table(path).to_pylist() if r["model_id"] == model]
    if row["result"] != "PASS":
        raise RuntimeError(f"{model}: {row['result']} ({row.get('error') or row.get('exclusion')}): see {out_dir}")
    t = json.loads(row["timings"])
    compile_s = row["compile_s"] or 0.0
    stages = {"load_s": t["load_s"], "compile_s": compile_s, "generation_s": t["generate_s"] - compile_s,
              "reference_s": t.get("reference_s", 0.0), "judging_s": t.get("judge_s", 0.0)}
    cpu_match = {"true": True, "false": False}.get(row["cpu_match"])  # text, as in the public dataset
    return {**stages, "script_wall_s": row["wall_s_precise"], "process_s": process_s,
            "other_s": process_s - sum(stages.values()), "cpu_match": cpu_match, "task": row["task"]}


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    models = [m.strip() for m in cfg.models.split(",") if m.strip()]
    samples: dict[str, list[dict]] = {m: [] for m in models}

    def one(model):
        def call() -> float:
            r = run_check(cfg, model, out_dir / "runs")
            samples[model].append(r)
            return r["process_s"]
        return call

    cb.alternate({m: one(m) for m in models}, repeats=cfg.repeats, warmup=0)
    rows = []
    for model, runs in samples.items():
        med = {k: cb.summary([r[k] for r in runs])["median"]
               for k in (*STAGES, "script_wall_s", "process_s", "other_s")}
        stages = sum(med[k] for k in STAGES)
        rows.append({"model": model, "task": runs[-1]["task"], **med, "stages_s": stages,
                     **{k.replace("_s", "_share"): cb.ratio(med[k], stages) for k in STAGES},
                     "stages_over_process": cb.ratio(stages, med["process_s"]), "cpu_match": runs[-1]["cpu_match"]})
    table = cb.format_table(rows, [
        ("model", "model", ""), ("task", "task", ""), ("load_s", "load s", ".2f"), ("compile_s", "compile s", ".2f"),
        ("generation_s", "generation s", ".2f"), ("reference_s", "CPU reference s", ".2f"),
        ("judging_s", "judging s", ".2f"), ("other_s", "other s", ".2f"), ("process_s", "command s", ".1f"),
        ("stages_over_process", "stages / command", ".2f")])
    table += (f"\nstages / command: the protocol's stages against the whole command measured in the same round "
              f"(medians of {cfg.repeats}); {'compiled (inductor)' if cfg.compile else 'eager (--no_compile)'}; "
              f"{cfg.new_tokens} new tokens")
    results = {"config": cfg, "skipped": None,
               "baseline": "the example's whole command per model (process time, same round)",
               "method": {"repeats": cfg.repeats, "order": "alternating models per round", "statistic": "median"},
               "rows": rows, "samples": samples}
    cb.write(out_dir, "compat_check", results, table)
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
