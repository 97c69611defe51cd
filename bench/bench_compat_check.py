"""Benchmark 5: where the compatibility check's time goes, per model: load, compile, generation,
the CPU reference, judging; against the check's own end-to-end run measured in the same run.

Stage split: for each model, the script's own per-process function
`examples/generate_compat_check.py:generate_on_device(job)` runs in this process (a single-core job,
as the CPU preset runs every offline model), with timers around transformers'
`AutoModelForCausalLM.from_pretrained` and `GenerationMixin.generate` (class attributes, wrapped for
the duration of the call and restored), then the English judge (`compat_check.rows.EnglishJudge`, as
the script builds it) judges the text:
    load        first from_pretrained (weights into the model that is checked)
    compile     the script's `compile_s` (Dynamo + inductor; 0 with --no_compile, the default here)
    generation  first generate (32 greedy tokens, static cache) minus compile
    reference   second from_pretrained + generate: the CPU eager run `cpu_match` compares against
    judging     EnglishJudge.judge on the generated text (the judge model is loaded once, `judge_load_s`)
    wall_s      the script's own figure (load + tokenizer + compile + generation), for comparison;
                `other_in_wall_s` = wall_s - load - compile - generation (mostly the tokenizer load)
Models alternate in rounds (order reversed every other round), `--repeats` rounds, medians per stage.

Baseline: the script itself, once, end to end, as a user runs it (`python examples/generate_compat_check.py
--models M --redo ...` in a subprocess, results in OUT_DIR/e2e): its Parquet `wall_s` and `compile_s`
per model and the process's total time. `stages_over_script_total` = (sum of the stage medians) /
the script's total time per model (the rest is process start, spawning a process per model, imports,
the Parquet write).

    python bench/bench_compat_check.py --out_dir runs/bench/compat                # about 4.5 minutes on 2 cores
    python bench/bench_compat_check.py --preset tiny --out_dir runs/bench/compat_tiny   # tests

Threads: the script's own choice (it sets torch's thread count to cores / processes in
generate_on_device), so the split runs at the same setting as the script.
Compiling with inductor on CPU costs about 90 s per model the first time (`--compile` to include it).
If examples/generate_compat_check.py is missing or lacks `generate_on_device`, the benchmark says so,
writes results.json with `skipped`, and exits 0.
results.json: `rows` (one per model: stage medians in s and shares), `script_e2e`.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from contextlib import contextmanager
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
    out_dir: str = field(default="runs/bench/compat", metadata={"help": "results.json and e2e/ go here"})
    models: str = field(default="tiny-qwen3,tiny-qwen3-moe,smollm2-135m-instruct", metadata={"help": "comma-separated offline asset names or HF folders"})
    new_tokens: int = field(default=32, metadata={"help": "greedy tokens generated per model"})
    compile: bool = field(default=False, metadata={"help": "compile the forward with inductor (about 90 s per model on CPU)"})
    repeats: int = field(default=3, metadata={"help": "alternating rounds of the stage split"})
    e2e: bool = field(default=True, metadata={"help": "also run the script end to end once (the baseline)"})

    def validate(self) -> None:
        if self.new_tokens <= 0 or self.repeats <= 0:
            raise UserError("--new_tokens and --repeats must be positive")


def default() -> Config:
    """The three offline models, eager, 32 tokens, 3 rounds, plus one end-to-end run of the script."""
    return Config()


def tiny() -> Config:
    """Harness check: tiny-qwen3 only, 4 tokens, 1 round, no end-to-end run (it costs a minute)."""
    return replace(Config(), models="tiny-qwen3", new_tokens=4, repeats=1, e2e=False)


PRESETS = {"default": default, "tiny": tiny}


def load_script():
    """The compatibility-check module, or None with the reason when it is missing or unfinished."""
    if not SCRIPT.is_file():
        return None, f"{SCRIPT.relative_to(cb.ROOT)} does not exist"
    spec = importlib.util.spec_from_file_location("bench_generate_compat_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001  an unfinished script must not fail the benchmark suite
        return None, f"{SCRIPT.name} does not import: {type(e).__name__}: {e}"
    missing = [n for n in ("generate_on_device", "resolve_model", "Config", "PRESETS") if not hasattr(module, n)]
    if missing:
        return None, f"{SCRIPT.name} lacks {', '.join(missing)}"
    return module, None


@contextmanager
def stage_timers(calls: list):
    """Time every from_pretrained and generate call (name, seconds) while the block runs."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationMixin

    original_load = AutoModelForCausalLM.__dict__["from_pretrained"]
    original_generate = GenerationMixin.generate

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls.append((name, time.perf_counter() - t0))
        return wrapper

    AutoModelForCausalLM.from_pretrained = classmethod(timed("load", original_load.__func__))
    GenerationMixin.generate = timed("generate", original_generate)
    try:
        yield
    finally:
        AutoModelForCausalLM.from_pretrained = original_load
        GenerationMixin.generate = original_generate
        del transformers


def split_one(script, cfg: Config, spec: str, judge) -> dict:
    from common import device

    folder = script.resolve_model(spec)
    job = {"folder": str(folder), "cores": 1, "runner": "single", "device": "cpu", "dtype": "auto",
           "compile": cfg.compile, "fullgraph": False, "prompt": script.Config.prompt,
           "new_tokens": cfg.new_tokens, "timeout_s": 1800, "lnc": 2, "trust_remote_code": False}
    calls: list = []
    device.fill_single_process_env()
    with stage_timers(calls):
        report = script.generate_on_device(job)
    device.teardown()
    loads = [t for n, t in calls if n == "load"]
    gens = [t for n, t in calls if n == "generate"]
    if len(loads) < 2 or len(gens) < 2:
        raise RuntimeError(f"expected two loads and two generate calls from generate_on_device, saw {calls}")
    compile_s = float(report.get("compile_s") or 0.0)
    t0 = time.perf_counter()
    verdict = judge().judge(report["text"], script.Config.prompt)
    judging = time.perf_counter() - t0
    return {"load_s": loads[0], "compile_s": compile_s, "generation_s": gens[0] - compile_s,
            "reference_s": loads[1] + gens[1], "judging_s": judging, "script_wall_s": report["wall_s"],
            "cpu_match": report["tokens"] == report.get("cpu_tokens"), "english": verdict["english"]}


def run_e2e(cfg: Config, out_dir: Path) -> dict:
    """The script as a user runs it, once: its Parquet timing fields and the process's wall time."""
    import subprocess

    import pyarrow.parquet as pq

    cmd = [sys.executable, str(SCRIPT), "--models", cfg.models, "--new_tokens", str(cfg.new_tokens), "--redo",
           "--out_dir", str(out_dir)] + ([] if cfg.compile else ["--no_compile"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cb.ROOT, env=cb.training_env(), capture_output=True, text=True, timeout=3600)
    total = time.perf_counter() - t0
    (out_dir / "e2e.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = {}
    for path in sorted(out_dir.glob("*.parquet")):
        for r in pq.read_table(path).to_pylist():
            rows[r["model_id"]] = {"result": r.get("result"), "wall_s": r.get("wall_s"), "compile_s": r.get("compile_s")}
    return {"command": cmd, "process_s": total, "rows": rows}


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    script, why = load_script()
    if script is None:
        msg = f"skipped: {why}; benchmark 5 needs the compatibility check script"
        print(f"[bench] compat: {msg}")
        results = {"config": cfg, "skipped": msg, "rows": []}
        cb.write(out_dir, "compat_check", results, f"compat check: {msg}")
        return results
    from common import paths
    from compat_check import rows as compat

    specs = script.model_specs(cfg.models)
    judge_cache: list = []
    judge_load: list = []

    def judge():
        if not judge_cache:
            t0 = time.perf_counter()
            judge_cache.append(compat.EnglishJudge(paths.smollm2_dir(), compat.JudgeLimits()))
            judge_load.append(time.perf_counter() - t0)
        return judge_cache[0]

    per_model: dict[str, list[dict]] = {s: [] for s in specs}

    def one(spec):
        def call() -> float:
            r = split_one(script, cfg, spec, judge)
            per_model[spec].append(r)
            return sum(r[k] for k in STAGES)
        return call

    cb.alternate({s: one(s) for s in specs}, repeats=cfg.repeats, warmup=0)
    e2e = run_e2e(cfg, out_dir / "e2e") if cfg.e2e else None
    rows = []
    for spec, runs in per_model.items():
        med = {k: cb.summary([r[k] for r in runs])["median"] for k in (*STAGES, "script_wall_s")}
        total = sum(med[k] for k in STAGES)
        # what wall_s holds besides load, compile and generation: the tokenizer load, moving the model
        other = med["script_wall_s"] - med["load_s"] - med["compile_s"] - med["generation_s"]
        row = {"model": spec, **med, "other_in_wall_s": other, "stages_total_s": total,
               **{k.replace("_s", "_share"): med[k] / total if total else None for k in STAGES},
               "cpu_match": runs[-1]["cpu_match"], "english": runs[-1]["english"], "runs": runs}
        if e2e and spec in e2e["rows"]:
            row["parquet_wall_s"] = e2e["rows"][spec]["wall_s"]
            row["parquet_compile_s"] = e2e["rows"][spec]["compile_s"]
            row["split_wall_over_parquet_wall"] = cb.ratio(med["script_wall_s"], e2e["rows"][spec]["wall_s"] or 0)
        rows.append(row)
    if e2e:
        per_model_total = e2e["process_s"] / max(len(specs), 1)
        for row in rows:
            row["stages_over_script_total"] = cb.ratio(row["stages_total_s"], per_model_total)
    table = cb.format_table(rows, [("model", "model", ""), ("load_s", "load s", ".2f"), ("compile_s", "compile s", ".2f"),
                                   ("generation_s", "generation s", ".2f"), ("reference_s", "CPU reference s", ".2f"),
                                   ("judging_s", "judging s", ".2f"),
                                   ("other_in_wall_s", "tokenizer etc. s", ".2f"), ("generation_share", "generation share", ".2f"),
                                   ("parquet_wall_s", "script wall_s", ".2f"),
                                   ("split_wall_over_parquet_wall", "split / script wall_s", ".2f"),
                                   ("stages_over_script_total", "stages / script time per model", ".2f")])
    table += (f"\njudge model load (once): {judge_load[0] if judge_load else float('nan'):.2f} s; "
              f"{'compiled (inductor)' if cfg.compile else 'eager (--no_compile)'}; {cfg.new_tokens} new tokens")
    if e2e:
        table += f"; script end to end: {e2e['process_s']:.0f} s for {len(specs)} model(s)"
    results = {"config": cfg, "skipped": None,
               "baseline": "generate_compat_check.py end to end, once, same models and flags (Parquet wall_s, process time)",
               "method": {"torch_threads": "the script's own (cores / processes, set in generate_on_device)", "repeats": cfg.repeats, "order": "alternating models per round", "statistic": "median per stage"},
               "judge_load_s": judge_load[0] if judge_load else None, "script_e2e": e2e, "rows": rows}
    cb.write(out_dir, "compat_check", results, table)
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
