"""Step time and tokens/s of each training script's CPU preset against the same model, data and
batch run through torchtitan's stock entry point, measured side by side; and model FLOPs
utilisation against this machine's peak.

For each script (train_native_qwen3.py, train_hf_backend.py, train_moe_nki.py), two kinds of
process alternate (ours, stock, then stock, ours, ...), `--repeats` of each:
  - `ours`: the script's own command line, `python examples/X.py --steps N --no-export` (the HF export
    comes after the last step, so it is left out of both);
  - `stock`: `torchtitan.train.main()`, the function `python -m torchtitan.train` runs, given the very
    Trainer.Config the script's `build_trainer_config` returns for the same flags, with only the
    CPU workarounds torchtitan cannot do without (see bench/timed_train.py: device routed before
    import, launcher variables for one process, SDPA document attention, gloo SUM, no CUDA graphs;
    for the HF backend the rotary-buffer fix, timed_train.py's `--fix_hf_rotary`). For
    train_moe_nki.py the baseline is torchtitan's own MoE and RoPE (`--stock`: what the stock entry
    point would run); ours has the grouped-expert op and NKIRoPE, with the preset's float32 expert
    matmuls (torchtitan's experts run bfloat16).
Time to step 1: the command's start (the process spawned) to the end of step 1, the same hook's first call;
`ours_over_stock_to_first_step` is what the script's checks, plan and load check add before training (the plan is
cached per configuration: a repeat after the first finds it).
Step time: per-step timestamps from the same hook in both (`MetricsProcessor.log`, called once at
the end of every step), step 1 left out (warm-up), the median over the remaining steps of a
process, then the median over the repeats. tokens/s = tokens per step / step time.
`ours_over_stock` = median step time of ours / of stock, compared with torchtitan's own entry point
on the same Trainer.Config (= 1.00: no overhead; above 1: ours is slower). `ours_over_stock_cpu`: the
same from the process CPU time per step (all threads), which other processes on a shared machine
disturb less than wall time.

MFU = torchtitan's FLOPs per token (its `get_nparams_and_flops`: 6 x parameters + the attention
term) x tokens/s / peak. Peak, two ways, both in results.json, for the cores a training process
uses (`--threads`, 1 by default): `measured` = the best of 5 float32 2048x2048 matmuls on that many
threads, timed before and after the runs (their median; the practical peak); `nominal` = threads x
/proc/cpuinfo clock x FLOPs per cycle (2 FMA pipes x vector lanes x 2). The MFU column uses the
measured peak.

    python bench/bench_train_overhead.py --scripts native --out_dir runs/bench/train_native  # one script, ~2 min
    python bench/bench_train_overhead.py --out_dir runs/bench/train_overhead                 # all three scripts
    python bench/bench_train_overhead.py --preset tiny --out_dir runs/bench/train_tiny       # tests: 3 short steps

Compiled (`--compiled`, backend `--compile_backend`, inductor by default): each script's ours and stock also run with
`--compile` (torchtitan's compile of each block and the loss), alternating with the eager ones, all sharing one
inductor cache (the first compiled process compiles it; step 1 is not in the step time): `ours_over_stock_compiled`,
`ours_compiled_over_eager`. Then two more of ours compiled, each a new host with an empty inductor cache of its own,
sharing one `--compile_cache` folder: the first compiles cold and pushes what it compiled, the second pulls it before
step 1 (`cold_first_step_s` / `pulled_first_step_s`, the compile audit's `cold_compile_s` / `pulled_compile_s`,
`pulled_entries`).

    python bench/bench_train_overhead.py --compiled --out_dir runs/bench/train_compiled   # ~25 min on 2 cores

Each process costs about 30 s on a 2-core machine (most of it import and set-up): one script
(2 kinds x 2 repeats x 6 steps) takes about 2 minutes, the default (all three) about 6; more
repeats (`--repeats 3`, `--steps 8`) narrow the spread.
results.json: `rows` (one per script, with `ours_over_stock`), `peak_flops`, `compared_with`.
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli  # noqa: E402

SCRIPTS = cb.TRAINING_SCRIPTS
STOCK_ARGS = {"moe": ["--stock"]}  # the example's flag for torchtitan's own modules (what stock runs)
STOCK_LAUNCHER_FLAGS = {"hf": ("--fix_hf_rotary",)}  # timed_train.py's flag: the fix the example applies itself
COMPARED_WITH = "torchtitan's own entry point on the same Trainer.Config = 1.00"


@dataclass
class Config(cb.TrainingBench):
    out_dir: str = field(default="runs/bench/train_overhead",
                         metadata={"help": "results.json, logs/, timings/ go here"})
    scripts: str = field(default="native,hf,moe", metadata={"help": "comma-separated: native, hf, moe"})
    extra_args: str = field(default="",
                            metadata={"help": "flags added to every training command (e.g. '--seq_len 64')"})
    compiled: bool = field(default=False, metadata={
        "help": "also each script compiled (--compile, ours and stock, alternating with the eager runs), and its "
                "first step cold against a new host's (an empty local cache) after a pull from a shared one "
                "(--compile_cache)"})
    compile_backend: str = field(default="inductor", metadata={
        "help": "with --compiled: torch.compile's backend (inductor generates code; aot_eager only traces)"})


def default() -> Config:
    """Each script's CPU preset as it is, 6 steps, 2 alternating repeats."""
    return Config()


def tiny() -> Config:
    """Harness check: train_native_qwen3.py only, 3 steps of 1 x 32 tokens, 1 repeat."""
    return replace(Config(), scripts="native", steps=3, repeats=1, extra_args="--seq_len 32 --local_batch_size 1")


PRESETS = {"default": default, "tiny": tiny}


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    names = cb.script_names(cfg.scripts)
    extra = cfg.extra_args.split()
    threads = cb.set_threads(cfg.threads)  # the peak is measured on as many threads as a training process uses
    matmul = [cb.measured_matmul_flops()]
    nominal = cb.nominal_peak_flops(cores=threads)
    rows, raw = [], {}
    for name in names:
        args = ["--steps", str(cfg.steps), "--no-export", *extra]
        runs = {"ours": cb.TrainingRun("ours", SCRIPTS[name], args),
                "stock": cb.TrainingRun("stock", SCRIPTS[name], [*args, *STOCK_ARGS.get(name, [])],
                                        launcher_flags=STOCK_LAUNCHER_FLAGS.get(name, ()))}
        compile_args = ["--compile", "--compile_backend", cfg.compile_backend]
        if cfg.compiled:  # the same two, compiled: one inductor cache for the bench (warm after the first process)
            runs.update({f"{k}_compiled": r._replace(args=[*r.args, *compile_args], env={
                "TORCHINDUCTOR_CACHE_DIR": str(out_dir / name / "inductor")}) for k, r in list(runs.items())})
        print(f"[bench] {SCRIPTS[name]}: ours vs torchtitan.train.main, {cfg.repeats} repeat(s)", flush=True)
        stats = cb.alternate_training(runs, repeats=cfg.repeats, threads=cfg.threads, out_dir=out_dir / name)
        raw[name] = stats
        s = {k: cb.training_summary(v) for k, v in stats.items()}
        rows.append({"script": SCRIPTS[name],
                     "ours_step_ms": s["ours"]["step_s"]["median"] * 1e3,
                     "stock_step_ms": s["stock"]["step_s"]["median"] * 1e3,
                     "ours_over_stock": cb.ratio(s["ours"]["step_s"]["median"], s["stock"]["step_s"]["median"]),
                     "ours_cpu_step_ms": s["ours"]["cpu_step_s"]["median"] * 1e3,
                     "stock_cpu_step_ms": s["stock"]["cpu_step_s"]["median"] * 1e3,
                     "ours_over_stock_cpu": cb.ratio(s["ours"]["cpu_step_s"]["median"],
                                                     s["stock"]["cpu_step_s"]["median"]),
                     "ours_tokens_per_s": s["ours"]["tokens_per_s"]["median"],
                     "stock_tokens_per_s": s["stock"]["tokens_per_s"]["median"],
                     "tokens_per_step": s["ours"]["tokens_per_step"],
                     "flops_per_token_ours": s["ours"]["flops_per_token"],
                     "flops_per_token_stock": s["stock"]["flops_per_token"],
                     "ours_to_first_step_s": s["ours"]["to_first_step_s"]["median"],
                     "stock_to_first_step_s": s["stock"]["to_first_step_s"]["median"],
                     "ours_over_stock_to_first_step": cb.ratio(s["ours"]["to_first_step_s"]["median"],
                                                               s["stock"]["to_first_step_s"]["median"]),
                     "ours_process_s": s["ours"]["process_wall_s"]["median"],
                     "stock_process_s": s["stock"]["process_wall_s"]["median"],
                     "first_losses": {"ours": s["ours"]["first_losses"], "stock": s["stock"]["first_losses"]},
                     "summary": s})
        if cfg.compiled:
            rows[-1].update(compiled_row(s, name, SCRIPTS[name], [*args, *compile_args], cfg, out_dir / name))
    matmul.append(cb.measured_matmul_flops())
    peak_measured = statistics.median(matmul)
    for r in rows:
        for kind in ("ours", "stock"):
            achieved = (r[f"flops_per_token_{kind}"] or 0) * r[f"{kind}_tokens_per_s"]
            r[f"{kind}_achieved_gflops"] = achieved / 1e9
            r[f"{kind}_mfu_measured_pct"] = 100 * achieved / peak_measured
            r[f"{kind}_mfu_nominal_pct"] = 100 * achieved / nominal["flops"]
    table = cb.format_table(rows, [("script", "script", ""), ("ours_step_ms", "ours ms/step", ".0f"),
                                   ("stock_step_ms", "stock ms/step", ".0f"),
                                   ("ours_over_stock", "ours / stock", ".3f"),
                                   ("ours_over_stock_cpu", "ours / stock (CPU time)", ".3f"),
                                   ("ours_tokens_per_s", "ours tok/s", ".0f"),
                                   ("stock_tokens_per_s", "stock tok/s", ".0f"),
                                   ("ours_mfu_measured_pct", "ours MFU %", ".1f"),
                                   ("stock_mfu_measured_pct", "stock MFU %", ".1f"),
                                   ("ours_to_first_step_s", "ours to step 1 s", ".1f"),
                                   ("stock_to_first_step_s", "stock to step 1 s", ".1f"),
                                   ("ours_over_stock_to_first_step", "ours / stock to step 1", ".2f")])
    if cfg.compiled:
        table += "\n\n" + cb.format_table(rows, [
            ("script", "script", ""), ("ours_compiled_step_ms", "ours compiled ms/step", ".0f"),
            ("stock_compiled_step_ms", "stock compiled ms/step", ".0f"),
            ("ours_over_stock_compiled", "ours / stock compiled", ".3f"),
            ("ours_compiled_over_eager", "ours compiled / eager", ".3f"),
            ("cold_first_step_s", "step 1 cold s", ".1f"), ("pulled_first_step_s", "step 1 after a pull s", ".1f"),
            ("cold_compile_s", "compiling cold s", ".1f"), ("pulled_compile_s", "compiling after a pull s", ".1f"),
            ("pulled_entries", "entries pulled", "d")])
    table += (f"\n{threads} thread(s) per process; peak: measured float32 matmul {peak_measured / 1e9:.1f} GFLOP/s "
              f"(median of {len(matmul)}); nominal {nominal['flops'] / 1e9:.1f} GFLOP/s = {nominal['how']}")
    for r in rows:
        table += (f"\n{r['script']}: ours / stock step time {r['ours_over_stock']:.3f} ({COMPARED_WITH}); "
                  f"ours / stock CPU time per step {r['ours_over_stock_cpu']:.3f}")
    results = {"config": cfg,
               "baseline": "torchtitan.train.main() (python -m torchtitan.train) on the Trainer.Config "
                           "the script builds; train_moe_nki.py: torchtitan's own MoE and RoPE (--stock). "
                           "See bench/timed_train.py",
               "compared_with": f"ours_over_stock: median step time of ours / of stock ({COMPARED_WITH})",
               "method": {"threads_per_process": cfg.threads, "repeats": cfg.repeats, "steps": cfg.steps,
                          "order": "alternating ours/stock processes",
                          "statistic": "median over processes of the median step interval, step 1 excluded"},
               "peak_flops": {"measured": peak_measured, "measured_samples": matmul,
                              "measured_how": f"best of 5 float32 2048x2048 matmuls on {threads} thread(s), "
                                              "before and after the runs",
                              "nominal": nominal},
               "rows": rows}
    cb.write(out_dir, "train_overhead", results, table)
    return results


def compiled_row(s: dict, name: str, script: str, args: list[str], cfg: Config, out_dir: Path) -> dict:
    """The compiled runs' figures of one script; then two more processes of ours compiled, each a new host (its own
    empty inductor cache) sharing one --compile_cache folder: the first compiles cold and pushes, the second pulls
    what the first compiled before its step 1."""
    row = {"ours_compiled_step_ms": s["ours_compiled"]["step_s"]["median"] * 1e3,
           "stock_compiled_step_ms": s["stock_compiled"]["step_s"]["median"] * 1e3,
           "ours_over_stock_compiled": cb.ratio(s["ours_compiled"]["step_s"]["median"],
                                                s["stock_compiled"]["step_s"]["median"]),
           "ours_compiled_over_eager": cb.ratio(s["ours_compiled"]["step_s"]["median"], s["ours"]["step_s"]["median"])}
    shared = (out_dir / "shared_cache").resolve()
    shared.mkdir(parents=True, exist_ok=True)
    for host in ("cold", "pulled"):
        run_dir = out_dir / "runs" / f"{host}_host"
        record = cb.run_training("ours", script, [*args, "--compile_cache", shared.as_uri(), "--out_dir", str(run_dir)],
                                 out_dir / "timings" / f"{host}_host.json", threads=cfg.threads,
                                 log_dir=out_dir / "logs",
                                 env={"TORCHINDUCTOR_CACHE_DIR": str(out_dir / f"inductor_{host}_host")})
        results = json.loads((run_dir / "results.json").read_text())
        row.update({f"{host}_first_step_s": record["to_first_step_s"],
                    f"{host}_compile_s": results["compile"]["compile_s"],
                    f"{host}_entries": results["compile_cache_shared"]["pulled"]})
    return row


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
