"""Step time of torchtitan's Transformers backend against torchtitan's native Qwen3, on the same
Qwen3 model, the same weights, data and batch, measured side by side.

Both start from the tiny Qwen3 HF folder made at set-up (2 layers, dim 64, the real 151,936-token
vocabulary), which is what `train_hf_backend.py`'s CPU preset trains; the native path reads the
same folder with `--hf_checkpoint`, so the model is the same (the README shows the first losses
agree within 2e-6). Processes alternate (native, hf, then hf, native, ...), `--repeats` of each:
    native: python examples/train_native_qwen3.py --hf_checkpoint TINY --steps N --no-export
    hf:     python examples/train_hf_backend.py --steps N --no-export
Step time: per-step timestamps from the same hook (bench/timed_train.py), step 1 excluded, median
over steps, then over repeats. `hf_over_native` = median step time hf / native (> 1: the
Transformers backend is slower).

    python bench/bench_hf_vs_native.py --out_dir runs/bench/hf_vs_native       # about 4 minutes on 2 cores
    python bench/bench_hf_vs_native.py --preset tiny --out_dir runs/bench/hf_vs_native_tiny   # tests (--no-load_check)

results.json: `rows` (native and hf medians), `hf_over_native`, `first_losses`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import paths  # noqa: E402
from common import cli  # noqa: E402

COMPARED_WITH = "torchtitan's native Qwen3 on the same model, weights, data and batch = 1.00; above 1: hf is slower"


@dataclass
class Config(cb.TrainingBench):
    out_dir: str = field(default="runs/bench/hf_vs_native",
                         metadata={"help": "results.json, logs/, timings/ go here"})
    steps: int = field(default=8, metadata={"help": "training steps per process (step 1 is not timed)",
                                            **cli.bounds(3, 10**5, why="step 1 is warm-up, untimed")})
    repeats: int = field(default=3, metadata={"help": "processes of each path, alternating", **cli.bounds(1, 100)})
    extra_args: str = field(default="", metadata={"help": "flags added to both training commands"})


def default() -> Config:
    """The CPU presets as they are (batch 2 x 128 tokens), 8 steps, 3 alternating repeats."""
    return Config()


def tiny() -> Config:
    """Harness check: 3 steps of 1 x 32 tokens, 1 repeat, without the examples' load check (a transformers
    process per run, inside the untimed step 1)."""
    return replace(Config(), steps=3, repeats=1, extra_args="--seq_len 32 --local_batch_size 1 --no-load_check")


PRESETS = {"default": default, "tiny": tiny}


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    tiny_dir = paths.asset_dir("tiny_qwen3")
    args = ["--steps", str(cfg.steps), "--no-export", *cfg.extra_args.split()]
    runs = {"native": cb.TrainingRun("ours", "train_native_qwen3.py", ["--hf_checkpoint", str(tiny_dir), *args]),
            "hf": cb.TrainingRun("ours", "train_hf_backend.py", ["--hf_checkpoint", str(tiny_dir), *args])}
    stats = cb.alternate_training(runs, repeats=cfg.repeats, threads=cfg.threads, out_dir=out_dir)
    s = {k: cb.training_summary(v) for k, v in stats.items()}
    rows = [{"path": name, "script": runs[name][1], "step_ms": s[name]["step_s"]["median"] * 1e3,
             "cpu_step_ms": s[name]["cpu_step_s"]["median"] * 1e3, "tokens_per_s": s[name]["tokens_per_s"]["median"],
             "flops_per_token": s[name]["flops_per_token"], "process_s": s[name]["process_wall_s"]["median"],
             "first_losses": s[name]["first_losses"], "summary": s[name]} for name in runs]
    hf_over_native = cb.ratio(s["hf"]["step_s"]["median"], s["native"]["step_s"]["median"])
    hf_over_native_cpu = cb.ratio(s["hf"]["cpu_step_s"]["median"], s["native"]["cpu_step_s"]["median"])
    rows[1]["over_native"], rows[1]["over_native_cpu"] = hf_over_native, hf_over_native_cpu
    rows[0]["over_native"], rows[0]["over_native_cpu"] = 1.0, 1.0
    table = cb.format_table(rows, [("path", "path", ""), ("step_ms", "ms/step", ".0f"),
                                   ("over_native", "/ native", ".3f"), ("cpu_step_ms", "CPU ms/step", ".0f"),
                                   ("over_native_cpu", "/ native (CPU time)", ".3f"),
                                   ("tokens_per_s", "tok/s", ".0f"), ("process_s", "process s", ".0f")])
    table += (f"\nmodel: {tiny_dir.name} (both paths load it); hf / native step time {hf_over_native:.3f} "
              f"({COMPARED_WITH})")
    results = {"config": cfg, "model": str(tiny_dir),
               "baseline": "train_native_qwen3.py --hf_checkpoint (torchtitan's native Qwen3) on the same HF folder",
               "compared_with": f"hf_over_native: {COMPARED_WITH}",
               "method": {"threads_per_process": cfg.threads, "repeats": cfg.repeats, "steps": cfg.steps,
                          "order": "alternating native/hf processes",
                          "statistic": "median over processes of the median step interval, step 1 excluded"},
               "rows": rows, "hf_over_native": hf_over_native, "hf_over_native_cpu": hf_over_native_cpu}
    cb.write(out_dir, "hf_vs_native", results, table)
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
