"""The dry run's memory model (common/harness/dryrun.py) term by term against what a CPU training step
really holds, at several model sizes and at 1 and 2 ranks.

Each size is a dense Qwen3 with the real 151,936-token vocabulary (the tiny Qwen3 from set-up, or a
seeded random HF folder of a larger shape), trained with `--hf_checkpoint`. For each size and world size:
  - estimated: `examples/train_native_qwen3.py --dry_run --dry_run_ranks N` for the same flags (its
    `dry_run` function, in the measuring process before its process group; above one rank in a process
    of its own, forked from rank 0);
  - measured on rank 0, over training steps after a warm-up step (each figure the median of
    --measured_steps steps; --measured_steps_one_rank at one rank), on torchtitan's Trainer built by
    the example's own `build_trainer_config` (FSDP over gloo, `--activation_checkpoint`: full by default,
    `--tensor_parallel_degree` above one rank, chunked loss, `--dtype`):
      parameters, gradients, optimizer state: bytes of the local shards (numel x element size): exact;
      gathered, gradient buffers, activations: from the CPU allocator's own record of every allocation
        and free during forward + backward (torch.profiler with profile_memory: c10's CPU allocator
        reports each one with its address and size). Each allocation is tagged by what it holds:
        FSDP's all-gather buffers (all its all-gather allocates, and the addresses of the unsharded
        parameters read after each), gradients (FSDP's unsharded gradients, read before each
        post-backward, and all the post-backward allocates), the rest being activations and
        temporaries (`activations`; also per phase: the chunked loss, the decoder's backward).
        A term's figure is the largest live total of its tag during the step (gradient buffers: of
        all gradient memory, less the gradients kept after the step). Exact to the byte for tensor
        storage; what bypasses c10's allocator (Python objects, gloo's internal buffers) is not seen.
  - `total`: parameters + optimizer state + the largest live total of everything the step allocated,
    against the dry run's total, which adds every term's own peak (an upper bound).
Ratios are measured / estimated: 1.00 means exact, above 1 the model underestimates.

    python bench/bench_memory_model.py --out_dir runs/bench/memory_model        # 3 to 5 minutes (2-core CPU)
    python bench/bench_memory_model.py --preset tiny --out_dir runs/bench/mm    # the test's setting, about 1 minute
    python bench/bench_memory_model.py --ranks 2 --sizes tiny_untied --dtype bfloat16 --out_dir runs/bench/mm_bf16
    python bench/bench_memory_model.py --ranks 1 --activation_checkpoint selective --out_dir runs/bench/mm_sel
    python bench/bench_memory_model.py --preset tiny --ranks 2 --tensor_parallel_degree 2 --out_dir runs/bench/mm_tp2

results.json: `rows` (one per size and world size: every term estimated, measured and their ratio, the
activation phases, what was live at the step's peak), `sizes`. Results: docs/memory-model.md.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import checkpoint, cli, paths  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.harness import lifecycle  # noqa: E402

TERMS = ("parameters", "gradients", "optimizer_state", "gathered_blocks", "gradient_buffers", "activations")
# Dense Qwen3 shapes besides the tiny one from set-up (2 layers, dim 64, tied); the rest of each
# config.json is the tiny model's (vocabulary, RoPE, norms).
SIZES = {
    "tiny": {},
    "tiny_untied": {"tie_word_embeddings": False},
    "small_untied": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    "medium": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 32},
}


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/memory_model", metadata={"help": "results.json, models/, logs/ go here"})
    sizes: str = field(default="tiny,small_untied,medium", metadata={"help": f"comma-separated: {', '.join(SIZES)}"})
    ranks: str = field(default="1,2", metadata={
        "help": "comma-separated world sizes (1: measured in this process; above: a torchrun launch per size)"})
    sizes_above_one_rank: str = field(default="", metadata={
        "help": "the sizes measured at world sizes above 1 (comma-separated; empty: all of --sizes)"})
    local_batch_size: int = field(default=4, metadata={"help": "sequences per rank", **cli.bounds(1, 1024)})
    seq_len: int = field(default=256, metadata={
        "help": "tokens per sequence (a multiple of 8: the chunked loss)",
        **cli.bounds(8, 2**16, multiple_of=8, why="torchtitan's chunked loss splits each sequence into 8")})
    threads: int = field(default=1, metadata={"help": cb.THREADS_HELP, **cli.bounds(0, 1024)})
    measured_steps: int = field(default=3, metadata={
        "help": "steps measured after the warm-up step; each term's figure is its median over them",
        **cli.bounds(1, 1000)})
    measured_steps_one_rank: int = field(default=0, metadata={
        "help": "steps measured at one rank (0: --measured_steps): there every step has had the same figures, "
                "byte for byte; above one rank a step can hold a buffer more, with the other rank's timing",
        **cli.bounds(0, 1000)})
    dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "compute dtype (FSDP mixed precision), as the example's --dtype"})
    activation_checkpoint: Literal["full", "selective", "none"] = field(default="full", metadata={
        "help": "the example's --activation_checkpoint in every measured run"})
    tensor_parallel_degree: int = field(default=1, metadata={
        "help": "the example's --tensor_parallel_degree at world sizes above 1 (it must divide them)",
        **cli.bounds(1, 64)})
    measure_here: bool = field(default=False, metadata={
        "help": "internal: measure in this process (the benchmark launches itself so under torchrun above 1 rank)"})


def default() -> Config:
    """Three sizes (tied and untied), 1 and 2 ranks, 4 x 256 tokens per rank."""
    return Config()


def tiny() -> Config:
    """The test's setting: the tiny Qwen3 tied and untied at 1 rank, untied at 2, 2 x 128 tokens per rank,
    3 measured steps at 2 ranks and 1 at 1 rank (where every step's figures are the same)."""
    return replace(Config(), sizes="tiny,tiny_untied", sizes_above_one_rank="tiny_untied", local_batch_size=2,
                   seq_len=128, measured_steps_one_rank=1)


PRESETS = {"default": default, "tiny": tiny}


# ---------------------------------------------------------------------------------- the launcher
def write_model(size: str, folder: Path) -> Path:
    """The HF folder of a size: the tiny Qwen3 from set-up, or a seeded random Qwen3 of that shape."""
    return cb.seeded_qwen3(folder, SIZES[size]) if SIZES[size] else paths.asset_dir("tiny_qwen3")


def main(cfg: Config) -> dict:
    if cfg.measure_here:
        return measure_all(cfg)
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    sizes, ranks = _sizes(cfg), _ranks(cfg)
    above = _sizes(cfg, cfg.sizes_above_one_rank) if cfg.sizes_above_one_rank else sizes
    for s in sizes:  # written once here; every measuring process reads them
        write_model(s, out_dir / "models" / s)
    common = ["--local_batch_size", str(cfg.local_batch_size), "--seq_len", str(cfg.seq_len), "--dtype", cfg.dtype,
              "--activation_checkpoint", cfg.activation_checkpoint,
              "--tensor_parallel_degree", str(cfg.tensor_parallel_degree)]
    runs = [(s, n) for n in ranks for s in (sizes if n == 1 else above)]
    measured: dict[int, dict] = {n: {} for n in ranks}
    for n in ranks:
        # Every size at one rank in this process; one launch per size above (the same limit as the dry run's).
        if n == 1:
            measured[n].update(_measure_in_this_process(cfg, sizes, out_dir))
            continue
        for group in [[s] for s in above]:
            args = ["--measure_here", "--out_dir", str(out_dir), "--sizes", ",".join(group),
                    "--measured_steps", str(cfg.measured_steps), *common]
            measured[n].update(_launch(Path(__file__).resolve(), args, n, out_dir, tag="_".join(group),
                                       threads=cfg.threads))
    rows = []
    for size, n in runs:
        m = measured[n][size]
        row = {"size": size, "ranks": n, "tied": m["tied"], "parameters_total": m["estimated"]["parameters"]}
        for term in (*TERMS, "total"):
            got = m["measured"][term]
            est = m["estimated"]["total_bytes"] if term == "total" else m["estimated"]["per_rank_bytes"][term]
            row[term] = {"estimated": est, "measured": got, "ratio": cb.ratio(got, est)}
        act, phases = m["estimated"]["activation_terms"], m["measured_only"]["phases"]
        for phase in ("loss", "decoder_backward"):
            got = phases.get(phase, {}).get("other", 0)
            row[f"activations_{phase}"] = {"estimated": act[f"{phase}_phase"], "measured": got,
                                           "ratio": cb.ratio(got, act[f"{phase}_phase"])}
        row["measured_only"] = m["measured_only"]
        row["phase_of_peak"] = m["phase_of_peak"]
        rows.append(row)
    flat = [{"run": f"{r['size']} x{r['ranks']}", **{t: r[t]["ratio"] for t in (*TERMS, "total")},
             "act_loss": r["activations_loss"]["ratio"], "act_decoder": r["activations_decoder_backward"]["ratio"],
             "act_mib": r["activations"]["measured"] / 2**20, "peak_mib": r["total"]["measured"] / 2**20}
            for r in rows]
    table = cb.format_table(flat, [("run", "size x ranks", ""), ("parameters", "params", ".3f"),
                                   ("gradients", "grads", ".3f"), ("optimizer_state", "optimizer", ".3f"),
                                   ("gathered_blocks", "gathered", ".2f"), ("gradient_buffers", "grad buffers", ".2f"),
                                   ("activations", "activations", ".2f"), ("act_loss", "act: loss", ".2f"),
                                   ("act_decoder", "act: decoder bwd", ".2f"),
                                   ("total", "total", ".2f"), ("act_mib", "act MiB", ".1f"),
                                   ("peak_mib", "peak MiB", ".1f")])
    table += ("\nratios: measured / dry-run estimate, per rank (rank 0); "
              f"{cfg.local_batch_size} x {cfg.seq_len} tokens per rank, {cfg.dtype}, activation checkpointing "
              f"{cfg.activation_checkpoint}, tensor parallel {cfg.tensor_parallel_degree} above one rank")
    results = {"config": cfg, "sizes": {s: {**SIZES[s]} for s in sizes},
               "baseline": "the dry run's figures for the same size, world size and batch, computed in the same run",
               "method": {"tensors": "parameters, gradients, optimizer state: local shard bytes (numel x element size)",
                          "allocator": "gathered, gradient buffers, activations, peak: torch.profiler profile_memory "
                                       "(c10 CPU allocator: every allocation and free with address and size) over "
                                       "forward + backward of the step after a warm-up step"},
               "rows": rows}
    cb.write(out_dir, "memory_model", results, table)
    return results


def _sizes(cfg: Config, text: str | None = None) -> list[str]:
    text = cfg.sizes if text is None else text
    sizes = [s for s in text.split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        raise UserError(f"--sizes takes a comma-separated subset of {', '.join(SIZES)}, got {text!r}")
    return sizes


def _ranks(cfg: Config) -> list[int]:
    try:
        ranks = [int(r) for r in cfg.ranks.split(",") if r]
    except ValueError:
        raise UserError(f"--ranks takes comma-separated integers, got {cfg.ranks!r}") from None
    if not ranks or min(ranks) <= 0:
        raise UserError(f"--ranks takes positive world sizes, got {cfg.ranks!r}")
    return ranks


def _start_dry_run(example, ecfg, ranks: int, out: Path, threads: int) -> Callable[[], dict]:
    """The example's `dry_run` for `ecfg` at `ranks` ranks, in a process of its own (torchtitan 0.3.0's
    spmd_types path refuses a second FSDP plan at one world size in a process), started in the background
    with its output in OUT/dry_run.log; returns the function that waits for it and reads its figures.
    The process is a child forked from this one, which has the stack imported: the plan alone, seconds,
    without a second interpreter's imports. Where a fork is not safe (another Python thread, or more than
    one torch thread: a lock or an OpenMP pool would not be usable in the child) it is
    `train_native_qwen3.py --dry_run` for the same flags instead."""
    import threading

    import torch

    out.mkdir(parents=True, exist_ok=True)
    log = out / "dry_run.log"
    if threading.active_count() > 1 or torch.get_num_threads() > 1:
        cmd = [sys.executable, str(cb.ROOT / "examples" / "train_native_qwen3.py"),
               "--hf_checkpoint", ecfg.hf_checkpoint, "--dry_run", "--dry_run_ranks", str(ranks), "--out_dir", str(out),
               "--local_batch_size", str(ecfg.local_batch_size), "--seq_len", str(ecfg.seq_len), "--dtype", ecfg.dtype]
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, cwd=cb.ROOT, env=cb.training_env(threads), stdout=f, stderr=subprocess.STDOUT)
        return lambda: _dry_run_figures(proc.wait(timeout=1800), out)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the plan, its results.json, and out without running anything of the parent's
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            lifecycle.dry_run(example.RECIPE, replace(ecfg, guards=replace(ecfg.guards, dry_run_ranks=ranks)), out)
            code = 0
        except BaseException:  # noqa: BLE001  into the log, read by the parent
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def finish() -> dict:
        deadline = time.monotonic() + 1800
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                done = os.waitpid(pid, 0)
                break
            time.sleep(0.1)
        return _dry_run_figures(os.waitstatus_to_exitcode(done[1]), out)
    return finish


def _dry_run_figures(code: int, out: Path) -> dict:
    if code != 0 or not (out / "results.json").is_file():
        raise RuntimeError(f"the dry run in {out} exited {code}:\n" + (out / "dry_run.log").read_text()[-4000:])
    return json.loads((out / "results.json").read_text())["dry_run"]


def _measure_in_this_process(cfg: Config, sizes: list[str], out_dir: Path) -> dict:
    """One rank needs no launch: `measure_all` for every size in this process (a process of its own would
    spend seconds importing what this one has imported), with --threads torch threads, its output in the log
    a launch's would go to."""
    import torch

    tag = "_".join(sizes)
    log = out_dir / "logs" / f"measure_{tag}_1_ranks.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    cb.set_threads(cfg.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as a launch has it (cb.training_env)
    t0 = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    saved, fd = (os.dup(1), os.dup(2)), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        out = measure_all(replace(cfg, sizes=",".join(sizes), measure_here=True, out_dir=str(out_dir),
                                  measured_steps=cfg.measured_steps_one_rank or cfg.measured_steps))
    except Exception as e:
        raise RuntimeError(f"the measurement at 1 rank failed: {type(e).__name__}: {e} (its output: {log})") from e
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, source in enumerate(saved, start=1):
            os.dup2(source, target)
        for f in (fd, *saved):
            os.close(f)
        torch.set_num_threads(threads)
    print(f"[bench] measured {tag} at 1 ranks in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _launch(script: Path, args: list[str], nproc: int, out_dir: Path, tag: str, threads: int) -> dict:
    """This script with --measure_here under torchrun, `nproc` processes; returns what rank 0 wrote."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--local-ranks-filter=0", str(script), *args]
    target = out_dir / f"measured_{tag}_{nproc}_ranks.json"
    target.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cb.ROOT, env=cb.training_env(threads), capture_output=True, text=True,
                          timeout=1800)
    cb.save_log(out_dir / "logs" / f"measure_{tag}_{nproc}_ranks.log", proc)
    if proc.returncode != 0 or not target.is_file():
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                           f"\n--- stderr\n{proc.stderr[-5000:]}")
    print(f"[bench] measured {tag} at {nproc} ranks in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(target.read_text())


# ------------------------------------------------------------------------------- the measurement
def measure_all(cfg: Config) -> dict:
    """In each process of one world size: the process group, then one measured step per size."""
    from bench.timed_train import load_example
    from common import device
    from common.results import atomic_write_text

    example = load_example(cb.ROOT / "examples" / "train_native_qwen3.py")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out_dir = Path(cfg.out_dir).resolve()
    config = example.RECIPE.config  # the recipe's flags, and the guards' section
    configs = {s: config(hf_checkpoint=str(write_model(s, out_dir / "models" / s)), steps=2, export=False,
                         device="cpu", dtype=cfg.dtype, local_batch_size=cfg.local_batch_size, seq_len=cfg.seq_len,
                         guards=lifecycle.Guards(dry_run_ranks=1), activation_checkpoint=cfg.activation_checkpoint,
                         tensor_parallel_degree=cfg.tensor_parallel_degree if world > 1 else 1)
               for s in _sizes(cfg)}
    # The dry run's figures for the same settings, before this process has a process group: at one rank from
    # this process; above one rank (one size a launch) from rank 0's child, which plans while this measures.
    device.route_torchtitan_device("cpu")
    if world == 1:
        estimates = {s: lifecycle.dry_run(example.RECIPE, c, out_dir / "dry_runs" / f"{s}_1_ranks")
                     for s, c in configs.items()}
    elif int(os.environ.get("RANK", "0")) == 0:
        import torchtitan.trainer  # noqa: F401  imported before the fork: the child only plans

        estimates = {s: _start_dry_run(example, c, world, out_dir / "dry_runs" / f"{s}_{world}_ranks", cfg.threads)
                     for s, c in configs.items()}
    else:
        estimates = {}
    dev = device.setup("cpu")
    try:
        out = {}
        for size, ecfg in configs.items():
            folder = Path(ecfg.hf_checkpoint)
            t0 = time.perf_counter()
            out[size] = measure_one(example, ecfg, dev, out_dir / "work" / f"{size}_{world}_ranks", cfg.measured_steps)
            if size in estimates:
                out[size]["estimated"] = estimates[size] if world == 1 else estimates[size]()
            out[size]["tied"] = bool(checkpoint.read_hf_config(folder).get("tie_word_embeddings"))
            print(f"[bench] measured {size} at {world} ranks in {time.perf_counter() - t0:.1f} s", flush=True)
            gc.collect()
        if dev.is_main:
            tag = "_".join(_sizes(cfg))
            atomic_write_text(out_dir / f"measured_{tag}_{world}_ranks.json", json.dumps(out, indent=1) + "\n")
        return out
    finally:
        device.teardown()


def measure_one(example, ecfg, dev, run_dir: Path, steps: int) -> dict:
    """Build the example's trainer for `ecfg`, run a warm-up step, then measure `steps` steps (this rank).
    Each allocator term is its median over the measured steps, gathered memory its smallest (a step above it
    held a buffer for another thread); every step's figures stay in `measured_only.per_step`. A gathered buffer
    counts until FSDP lets go of it (AllocationTracker.summary): gloo's worker thread may free it later."""
    import statistics

    import torch
    from torch.distributed.tensor import DTensor
    from common import export

    run_dir.mkdir(parents=True, exist_ok=True)
    found = lifecycle.preflight(example.RECIPE, ecfg)
    tc, _notes = example.RECIPE.trainer_config(ecfg, dev, run_dir, found)
    if dev.is_main:
        export.stage_hf_assets(Path(tc.hf_assets_path), found.tokenizer_dir, Path(ecfg.hf_checkpoint).resolve())
    torch.distributed.barrier()
    trainer = tc.build()
    model = trainer.model_parts[0]

    def local_bytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    batch = next(iter(trainer.dataloader))
    trainer.step = 1  # warm-up step: creates the optimizer state and FSDP's lazy state
    trainer.train_step(trainer.batch_generator([batch]))
    params = sum(local_bytes(p) for p in model.parameters())
    optimizer = sum(local_bytes(v) for opt in trainer.optimizers.optimizers for st in opt.state.values()
                    for v in st.values() if torch.is_tensor(v))
    step, loss_fn = trainer.forward_backward_step, trainer.loss_fn
    summaries = []
    for n in range(steps):
        trainer.optimizers.zero_grad(set_to_none=True)  # what train_step does first; freed before the window
        gc.collect()
        tracker = AllocationTracker(model)

        def tracked_step(**kwargs):
            with tracker:
                return step(**kwargs)

        def marked_loss(*args, **kwargs):  # the chunked loss runs lm_head forward and backward chunk by chunk
            tracker.phase("loss")
            try:
                return loss_fn(*args, **kwargs)
            finally:
                tracker.phase("decoder_backward")

        trainer.forward_backward_step, trainer.loss_fn = tracked_step, marked_loss
        trainer.step = 2 + n
        try:
            trainer.train_step(trainer.batch_generator([batch]))
        finally:
            trainer.forward_backward_step, trainer.loss_fn = step, loss_fn
        summaries.append(tracker.summary())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    trainer.close()
    del trainer, model
    per_step = [{"gathered_blocks": t["peak_by_tag"]["gathered"],
                 # every byte of gradient memory at its peak beyond the gradients kept after the step
                 "gradient_buffers": t["peak_by_tag"]["all_gradients"] - grads,
                 "activations": t["peak_by_tag"]["other"], "peak": t["peak_total"]} for t in summaries]
    median = {k: int(statistics.median(s[k] for s in per_step)) for k in per_step[0]}
    # the detail (phases, what was live at the peak) of the step whose peak is the median one
    t = summaries[sorted(range(steps), key=lambda i: per_step[i]["peak"])[(steps - 1) // 2]]
    return {
        "measured": {"parameters": params, "gradients": grads, "optimizer_state": optimizer,
                     # FSDP's own hold is the same every step: a step above it held a buffer for another thread
                     # (seen on a busy machine at 2 ranks: one embedding-unit buffer more, 1.5x, in 1 step of 30)
                     "gathered_blocks": min(s["gathered_blocks"] for s in per_step),
                     "gradient_buffers": median["gradient_buffers"],
                     "activations": median["activations"], "total": params + optimizer + median["peak"]},
        "measured_only": {"gradient_buffers_peak": t["peak_by_tag"]["grad"], "at_peak": t["at_peak"],
                          "phases": t["phases"], "largest": t["largest_activations_at_phase_peak"],
                          "allocations": t["allocations"], "per_step": per_step,
                          "gathered_freed_after_fsdp_let_go": [t["gathered_freed_after_fsdp_let_go"] for t in summaries]},
        "phase_of_peak": t["phase_of_peak"],
    }


class AllocationTracker:
    """Every CPU allocation and free inside the `with` block (torch.profiler, profile_memory), tagged
    afterwards: `gathered` (FSDP all-gather outputs), `grad` (FSDP gradients and reduce-scatter
    buffers), `other` (activations, temporaries). Tags come from markers: after every FSDP
    all-gather the addresses of the gathered storages, before every post-backward the addresses of
    the unsharded gradients, and the post-backward's extent (all it allocates is gradient memory)."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule

        groups = {}
        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                group = mod._get_fsdp_state()._fsdp_param_group  # FSDP2 internals (torch 2.14), read only
                if group is not None:
                    groups[id(group)] = group
        self.groups = list(groups.values())
        self.marks: list[tuple[str, set[int], str]] = []
        self.prof = None
        self._saved = {}

    def phase(self, name: str) -> None:
        self._mark("phase", set(), name)

    # markers: a zero-length profiler range named after its index in self.marks
    def _mark(self, kind: str, ptrs: set[int], name: str = "") -> None:
        from torch.autograd.profiler import record_function

        self.marks.append((kind, ptrs, name))
        with record_function(f"memory_model_mark_{len(self.marks) - 1}"):
            pass

    def _gathered_ptrs(self) -> set[int]:
        ptrs = set()
        for g in self.groups:
            for fp in g.fsdp_params:
                for t in getattr(fp, "all_gather_outputs", []):
                    if t.untyped_storage().nbytes():
                        ptrs.add(t.untyped_storage().data_ptr())
            for result in (g._all_gather_result, getattr(g.comm_ctx.all_gather_state, "all_gather_result", None)):
                if result is not None and result.all_gather_output is not None:
                    ptrs.add(result.all_gather_output.untyped_storage().data_ptr())
        return ptrs

    def _unsharded_grad_ptrs(self, group) -> set[int]:
        ptrs = set()
        for fp in group.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                for t in (fp._unsharded_param.grad, fp.unsharded_accumulated_grad):
                    if t is not None:
                        t = t.to_local() if hasattr(t, "to_local") else t
                        ptrs.add(t.untyped_storage().data_ptr())
        return ptrs

    @staticmethod
    def _sharded_grad_ptrs(group) -> set[int]:
        return {fp.sharded_param.grad.to_local().untyped_storage().data_ptr() for fp in group.fsdp_params
                if fp.sharded_param.grad is not None}

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.profiler import ProfilerActivity, profile

        tracker = self
        unshard, wait, post_backward = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard, \
            FSDPParamGroup.post_backward

        def unshard_marked(group, *a, **k):  # the all-gather: all it allocates is gathered memory
            tracker._mark("gather_begin", set())
            try:
                return unshard(group, *a, **k)
            finally:
                tracker._mark("gather_end", set())
                tracker._mark("gathered", tracker._gathered_ptrs())

        def wait_marked(group, *a, **k):
            r = wait(group, *a, **k)
            tracker._mark("gathered", tracker._gathered_ptrs())
            return r

        def post_backward_marked(group, *a, **k):
            tracker._mark("grad", tracker._unsharded_grad_ptrs(group))
            tracker._mark("grad_begin", set())
            try:
                return post_backward(group, *a, **k)
            finally:
                tracker._mark("grad_end", set())
                tracker._mark("sharded_grad", tracker._sharded_grad_ptrs(group))

        self._saved = {"unshard": unshard, "wait_for_unshard": wait, "post_backward": post_backward}
        # Instrumentation of this process only, undone on exit: FSDP has no hook at these points.
        FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard = unshard_marked, wait_marked
        FSDPParamGroup.post_backward = post_backward_marked
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        self.phase("forward")
        return self

    def __exit__(self, *exc):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        try:
            self.prof.__exit__(*exc)
        finally:
            for name, fn in self._saved.items():
                setattr(FSDPParamGroup, name, fn)
        return False

    def _events(self) -> list[tuple[int, str, object]]:
        """(time, kind, payload) for allocations and frees (address, signed size, the ops around it)
        and for markers (index into self.marks), in time order."""
        events, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if str(e.tag).endswith("Allocation"):
                f = e.extra_fields
                if f.device.type == "cpu":
                    ops, q = [], e.parent
                    while q is not None and len(ops) < 3:
                        ops.append(q.name)
                        q = q.parent
                    events.append((e.start_time_ns, "alloc", (f.ptr, f.alloc_size, " < ".join(ops))))
            elif e.name.startswith("memory_model_mark_"):
                events.append((e.start_time_ns, "mark", int(e.name.rsplit("_", 1)[1])))
        events.sort(key=lambda ev: ev[0])
        return events

    def summary(self) -> dict:
        """Peaks of every tag, per phase and over the step, and the breakdown at the step's peak.
        Pass 1 gives every allocation its final tag (a marker may tag an allocation made before it);
        pass 2 replays allocations and frees with those tags. Frees of memory allocated before the
        step are ignored: the step's figures count what the step allocated."""
        events = self._events()
        allocs: list[dict] = []
        replay: list[tuple[str, object]] = []  # ("+", index) / ("-", index) / ("phase", name)
        live: dict[int, int] = {}
        dropped: set[int] = set()  # gathered buffers FSDP let go of, their allocator free not seen yet
        freed_late = 0
        in_grad, in_gather, phase = 0, 0, "forward"
        for _t, kind, payload in events:
            if kind == "mark":
                what, ptrs, name = self.marks[payload]
                if what == "phase":
                    phase = name
                    replay.append(("phase", name))
                elif what == "grad_begin":
                    in_grad += 1
                elif what == "grad_end":
                    in_grad -= 1
                elif what == "gather_begin":
                    in_gather += 1
                elif what == "gather_end":
                    in_gather -= 1
                else:  # gathered, grad, sharded_grad: retag the live allocations at these addresses
                    for ptr in ptrs:
                        if ptr in live and (what != "grad" or allocs[live[ptr]]["tag"] == "other"):
                            allocs[live[ptr]]["tag"] = what
                            allocs[live[ptr]]["held_by_fsdp"] = what == "gathered"
                    if what == "gathered":
                        # A gathered buffer FSDP held at an earlier marker and holds no longer is free from
                        # here on: FSDP dropped it, and only gloo's worker thread may still hold it (its
                        # async work keeps the all-gather's output until that thread runs, later on a busy
                        # machine). Its own free then comes later or never, and is ignored.
                        for ptr in [q for q, i in live.items() if allocs[i].get("held_by_fsdp") and q not in ptrs]:
                            replay.append(("-", live.pop(ptr)))
                            dropped.add(ptr)
                continue
            ptr, size, ops = payload
            if size > 0:
                live[ptr] = len(allocs)
                replay.append(("+", len(allocs)))
                tag = "grad" if in_grad else "gathered" if in_gather else "other"
                allocs.append({"size": size, "tag": tag, "ops": ops})
            elif ptr in live:
                replay.append(("-", live.pop(ptr)))
                dropped.discard(ptr)
            elif ptr in dropped:  # freed after FSDP had dropped it and a later marker had passed
                dropped.discard(ptr)
                freed_late += 1
        tags = ("gathered", "sharded_grad", "grad", "other")
        totals = dict.fromkeys(tags, 0)
        phases: dict[str, dict[str, int]] = {}
        peak_total, at_peak, phase_of_peak, phase = 0, dict(totals), None, "forward"
        largest = {}
        current: set[int] = set()
        for kind, x in replay:
            if kind == "phase":
                phase = x
                continue
            a = allocs[x]
            if kind == "-":
                totals[a["tag"]] -= a["size"]
                current.discard(x)
                continue
            totals[a["tag"]] += a["size"]
            current.add(x)
            peaks = phases.setdefault(phase, dict.fromkeys(tags, 0))
            if a["tag"] == "other" and totals["other"] > peaks["other"]:
                largest[phase] = sorted(((allocs[i]["size"], allocs[i]["ops"]) for i in current
                                         if allocs[i]["tag"] == "other"), reverse=True)[:6]
            for tag in tags:
                peaks[tag] = max(peaks[tag], totals[tag])
            peaks["all_gradients"] = max(peaks.get("all_gradients", 0), totals["grad"] + totals["sharded_grad"])
            if sum(totals.values()) > peak_total:
                peak_total, at_peak, phase_of_peak = sum(totals.values()), dict(totals), phase
        return {"peak_total": peak_total, "at_peak": at_peak, "phase_of_peak": phase_of_peak,
                "peak_by_tag": {t: max(p.get(t, 0) for p in phases.values()) for t in (*tags, "all_gradients")},
                "phases": phases, "largest_activations_at_phase_peak": largest, "allocations": len(allocs),
                "gathered_freed_after_fsdp_let_go": freed_late}


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
