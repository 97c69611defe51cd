"""How cost grows: step time against model size and against process count, measured side by side
with train_native_qwen3.py.

Runs (processes alternate, order reversed every round, `--repeats` of each):
  - `tiny_1p`: the tiny Qwen3 from set-up (2 layers, dim 64, real vocabulary), 1 process: the baseline;
  - one run per larger size in `--sizes` (`small`: 4 layers, dim 128; `medium`: 4 layers, dim 256),
    1 process: a seeded random Qwen3 HF folder written into OUT_DIR/models at start (Qwen3ForCausalLM
    with the tiny model's vocabulary and tokenizer), trained with `--hf_checkpoint`;
  - `tiny_2p`: the tiny model on 2 processes (torchrun, FSDP over gloo).
Every run has the same global batch (`--global_batch` sequences of `--seq_len` tokens): the 2-process
run splits it (strong scaling), so the same tokens are processed per step and step times compare
directly. Step time: per-step timestamps (bench/timed_train.py), step 1 excluded, median over steps,
then over repeats. Ratios against tiny_1p: `step_over_tiny` (size: compare with `flops_over_tiny`,
torchtitan's FLOPs per token ratio; processes: 0.5 would be perfect scaling), `speedup` and
`parallel_efficiency` (= speedup / processes) for the 2-process run.

    python bench/bench_scaling.py --out_dir runs/bench/scaling                 # about 4 minutes on a 2-core machine
    python bench/bench_scaling.py --preset tiny --out_dir runs/bench/scaling_tiny   # tests (--no-load_check)

On a 2-core machine two processes share the two cores with each other (and with anything else
running), so the 2-process figure shows the cost of FSDP over gloo more than any gain.
results.json: `rows` (one per run), `sizes`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli, paths  # noqa: E402
from common.errors import UserError  # noqa: E402

# Larger dense Qwen3 shapes, the rest as the tiny Qwen3's config.json (vocabulary, rope, tied embeddings).
SIZES = {
    "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32},
    "medium": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 32},
}


@dataclass
class Config(cb.TrainingBench):
    out_dir: str = field(default="runs/bench/scaling",
                         metadata={"help": "results.json, models/, logs/, timings/ go here"})
    sizes: str = field(default="small", metadata={"help": "comma-separated larger sizes besides tiny: small, medium"})
    processes: int = field(default=2, metadata={"help": "process count of the multi-process run (1: none)",
                                                **cli.bounds(1, 1024)})
    global_batch: int = field(default=4, metadata={"help": "sequences per step, split over the processes",
                                                   **cli.bounds(1, 65536)})
    seq_len: int = field(default=128, metadata={
        "help": "tokens per sequence",
        **cli.bounds(8, 2**16, multiple_of=8, why="torchtitan's chunked loss splits each sequence into 8")})
    extra_args: str = field(default="", metadata={
        "help": "flags added to every training command (e.g. '--no-load_check': the example's comparison with "
                "transformers before step 1, untimed)"})

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if self.global_batch % self.processes:
            raise UserError(f"--global_batch {self.global_batch} is not a multiple of --processes {self.processes}")


def default() -> Config:
    """tiny and small at 1 process, tiny at 2 processes, global batch 4 x 128 tokens, 6 steps, 2 repeats."""
    return Config()


def tiny() -> Config:
    """Harness check: tiny and small at 1 process, tiny at 2, global batch 2 x 32 tokens, 3 steps, 1 repeat,
    without the examples' load check (a transformers process per run, inside the untimed step 1)."""
    return replace(Config(), steps=3, repeats=1, global_batch=2, seq_len=32, extra_args="--no-load_check")


PRESETS = {"default": default, "tiny": tiny}


def write_model(size: str, folder: Path) -> Path:
    """A seeded random Qwen3 HF folder of the given size, with the tiny model's tokenizer files."""
    return cb.seeded_qwen3(folder, SIZES[size])


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    sizes = [s for s in cfg.sizes.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        raise UserError(f"--sizes takes a comma-separated subset of {', '.join(SIZES)}, got {cfg.sizes!r}")
    common = ["--steps", str(cfg.steps), "--no-export", "--seq_len", str(cfg.seq_len), *cfg.extra_args.split()]
    one = ["--local_batch_size", str(cfg.global_batch)]
    models = {"tiny": paths.asset_dir("tiny_qwen3"), **{s: write_model(s, out_dir / "models" / s) for s in sizes}}
    runs = {f"{m}_1p": cb.TrainingRun("ours", "train_native_qwen3.py", ["--hf_checkpoint", str(folder), *common, *one])
            for m, folder in models.items()}
    if cfg.processes > 1:
        split = ["--local_batch_size", str(cfg.global_batch // cfg.processes),
                 "--global_batch_size", str(cfg.global_batch)]
        runs[f"tiny_{cfg.processes}p"] = cb.TrainingRun("ours", "train_native_qwen3.py",
                                                        ["--hf_checkpoint", str(models["tiny"]), *common, *split],
                                                        cfg.processes)
    stats = cb.alternate_training(runs, repeats=cfg.repeats, threads=cfg.threads, out_dir=out_dir)
    s = {k: cb.training_summary(v) for k, v in stats.items()}
    base = s["tiny_1p"]
    rows = []
    for name, run in runs.items():
        nproc = run.nproc
        model = name.rsplit("_", 1)[0]
        step, fpt = s[name]["step_s"]["median"], s[name]["flops_per_token"]
        row = {"run": name, "model": model, "processes": nproc, "step_ms": step * 1e3,
               "cpu_step_ms": s[name]["cpu_step_s"]["median"] * 1e3, "tokens_per_s": s[name]["tokens_per_s"]["median"],
               "flops_per_token": fpt, "step_over_tiny": cb.ratio(step, base["step_s"]["median"]),
               "flops_over_tiny": cb.ratio(fpt or 0, base["flops_per_token"] or 0),
               "speedup": cb.ratio(base["step_s"]["median"], step) if model == "tiny" else None,
               "summary": s[name]}
        row["parallel_efficiency"] = row["speedup"] / nproc if row["speedup"] is not None else None
        rows.append(row)
    table = cb.format_table(rows, [("run", "run", ""), ("processes", "processes", ""), ("step_ms", "ms/step", ".0f"),
                                   ("step_over_tiny", "step / tiny_1p", ".2f"),
                                   ("flops_over_tiny", "FLOPs / tiny", ".2f"),
                                   ("tokens_per_s", "tok/s", ".0f"), ("speedup", "speedup", ".2f"),
                                   ("parallel_efficiency", "efficiency", ".2f")])
    table += f"\nglobal batch {cfg.global_batch} x {cfg.seq_len} tokens in every run; sizes: " + \
        "; ".join(f"{m}: {json.loads((f / 'config.json').read_text())['num_hidden_layers']} layers, dim "
                  f"{json.loads((f / 'config.json').read_text())['hidden_size']}" for m, f in models.items())
    results = {"config": cfg, "sizes": {m: str(f) for m, f in models.items()},
               "baseline": "tiny_1p: the tiny Qwen3, one process, same global batch",
               "method": {"threads_per_process": cfg.threads, "repeats": cfg.repeats, "steps": cfg.steps,
                          "order": "alternating processes",
                          "statistic": "median over processes of the median step interval, step 1 excluded"},
               "rows": rows}
    cb.write(out_dir, "scaling", results, table)
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
