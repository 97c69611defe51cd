"""What a pilot run must tell before a longer one: warm-up apart from steady speed, FLOPs per token and MFU,
memory against the plan, and cost. Written into results.json by the three training scripts.

- `timing`: this process's first step (with compilation and warm-up; `first_step`, the step after the resumed one in
  a resumed part) against the median step after the warm-up steps, each step timed without the held-out evaluation
  and the save before it.
- `flops_per_token`: 6 x the parameters a token passes through (MoE: the active experts; embeddings are looked
  up, not multiplied; the output projection counts, tied or not) + torchtitan's attention term 12 x layers x heads x
  head_dim x sequence length; from the model's config.json, so the three paths count the same model the same.
- `mfu`: flops_per_token x steady tokens/s / (peak FLOP/s per device x devices), against `peak_flops_per_device`:
  --peak_tflops when given; else on trn2 79 TFLOPS bfloat16 per NeuronCore-v3 x --lnc (the NeuronCores of one
  logical core); on CUDA torchtitan's table; on CPU the best matmul measured on this machine in the run's dtype (CPU
  time; kept in the cache folder: `best_cpu_peak`), and the MFU is marked indicative. An MFU
  above 1, or a peak that is not a positive number, is no measurement: `mfu` is null and `mfu_note` says why (a
  warning line names the peak and its source). torchtitan's own step lines and TensorBoard get the same two
  numbers (common/harness/trainer.py's GuardedMetrics), and show no MFU for a step where it would be above 1.
- `memory`: each rank's peak over its steps (the device allocator's peak of each step, read before torchtitan resets
  it; on CPU the process's peak resident set size) beside the dry run's estimate for the same configuration
  (`planned_gib`), with their `ratio` where both count tensors: a profiled run's peak holds the profiler's own
  buffers, and a CPU run's the whole process (libraries, Python, freed memory kept): `comparable` is false, no
  ratio, and `not_comparable` says why.
- `timing.compile_cache`: whether step 1 found the compile cache cold or warm (`compile_cache`).
- `profile`: with --profile, torchtitan's profiler (torch.profiler) traces the chosen steps into OUT_DIR/profile_traces
  (`apply_profile_settings`, `profile_traces`).
- `cost`: with --price_per_hour (no price is written into the repository).
"""
from __future__ import annotations

import math
import os
import statistics
import time

from common.device import GIB
from common.harness.stops import STOP_SIGNALS
# bfloat16 FLOP/s of one physical NeuronCore-v3 (torchtitan's figure in get_peak_flops). A logical core is --lnc of
# them: torchtitan 0.3.0 multiplies by 2 whatever the LNC is, which halves the MFU of an LNC=1 run.
TRN2_CORE_PEAK = 79e12
TRN2_SOURCE = ("79 TFLOPS bfloat16 per NeuronCore-v3 x LNC={lnc} (torchtitan's per-core figure; AWS gives 667 dense "
               "bfloat16 TFLOPS per Trainium2 chip over its 8 NeuronCores, 83 each)")
PEAK_TFLOPS_LOW = 1e-3  # --peak_tflops's lower bound (common/harness/lifecycle.py): why there


def trn2_peak(lnc: int) -> float:
    """bfloat16 FLOP/s of one trn2 logical core of `lnc` NeuronCores (1 or 2)."""
    if lnc not in (1, 2):
        raise ValueError(f"a trn2 logical core is 1 or 2 NeuronCores, not {lnc}")
    return TRN2_CORE_PEAK * lnc


def flops_per_token(shape: dict, seq_len: int) -> int:
    """Training FLOPs per token of a Qwen3 (dense or MoE) config.json; see the module docstring."""
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or d // heads
    kv = shape.get("num_key_value_heads") or heads
    attention = 2 * d * heads * head_dim + 2 * d * kv * head_dim
    experts = shape.get("num_experts")
    mlp = (shape["num_experts_per_tok"] * 3 * d * shape["moe_intermediate_size"] + d * experts if experts
           else 3 * d * shape["intermediate_size"])
    active = layers * (attention + mlp) + vocab * d
    return int(6 * active + 12 * layers * heads * head_dim * seq_len)


def measured_cpu_peak(dtype: str, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n matmuls on this process's threads, in `dtype`, timed in the process's
    CPU time over its threads (not the wall clock), which a busy machine moves less (2-core machine at a load of 20,
    one thread: 29 to 31 GFLOP/s from CPU time, 5.5 to 8.5 from the wall clock; `best_cpu_peak` keeps the best of
    every run on the machine). 512 reaches the same peak
    as 1024 at an eighth of the work (2-core machine, one thread: float32 92.6 and 93.9 GFLOP/s; bfloat16, which such
    a CPU emulates, 1.3 and 1.0 GFLOP/s, and 1.3 CPU-seconds instead of 13 before a bfloat16 run's step 1)."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    torch.matmul(a, b)  # warm-up
    threads = max(torch.get_num_threads(), 1)
    best = math.inf
    for _ in range(repeats):
        t0 = time.process_time()
        torch.matmul(a, b)
        best = min(best, (time.process_time() - t0) / threads)
    return 2 * n ** 3 / max(best, 1e-9)


def best_cpu_peak(measured: float, dtype: str, threads: int) -> tuple[float, int]:
    """(the best CPU peak measured on this machine for `dtype` and `threads`, measurements so far), `measured`
    included, kept in the cache folder (cpu-peak/): a measurement taken while the machine was busy (other runs, a
    test suite) reads lower, and one taken on an idle machine stays the figure of every later run."""
    import json
    import platform

    from common.paths import CACHE_DIR
    from common.results import atomic_write_text

    cpu = next((ln.split(":", 1)[1].strip() for ln in _read_lines("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor() or platform.machine())
    key = "".join(c if c.isalnum() else "_" for c in f"{cpu}-{os.cpu_count()}cpus-{threads}threads-{dtype}")
    path = CACHE_DIR.parent / "cpu-peak" / f"{key[:150]}.json"
    try:
        kept = json.loads(path.read_text())
        best, runs = max(float(kept["flops"]), measured), int(kept["runs"]) + 1
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one this wrote: measured anew
        best, runs = measured, 1
    if math.isfinite(best) and best > 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"cpu": cpu, "flops": best, "runs": runs}) + "\n")
        except OSError:  # a read-only cache: this run's figure only
            pass
    return best, runs


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read(1 << 20).splitlines()
    except OSError:
        return []


def peak_flops(device_type: str, dtype: str, peak_tflops: float | None, lnc: int = 2) -> dict:
    """{"value": FLOP/s of one device (one process's cores on CPU), "source": where it came from}. On Neuron the
    device is one logical core of `lnc` NeuronCores; the figure needs no Neuron runtime."""
    if peak_tflops:
        return {"value": peak_tflops * 1e12, "source": "--peak_tflops"}
    if device_type == "neuron":
        return {"value": trn2_peak(lnc), "source": TRN2_SOURCE.format(lnc=lnc)}
    import torch

    if device_type == "cpu":
        threads = torch.get_num_threads()
        value, runs = best_cpu_peak(measured_cpu_peak(dtype), dtype, threads)
        return {"value": value, "indicative": True,
                "source": f"the best of {runs} measurement(s) on this machine ({dtype} 512x512 matmuls in the CPU time "
                          f"of {threads} thread(s)), so the machine's load at this run's start does not lower it; the "
                          "steps are timed on the wall clock, which load does slow: a CPU MFU is indicative"}
    from torchtitan.tools import utils

    name = torch.cuda.get_device_name()
    value = utils.get_peak_flops(name)
    return {"value": value, "source": f"torchtitan get_peak_flops({name!r})" + (
        " (its A100 fallback: pass --peak_tflops)" if value == 312e12 and "A100" not in name else "")}


def apply_metrics_settings(tc, tensorboard: bool) -> None:
    """torchtitan's own metrics: with `tensorboard`, its TensorBoard logger into OUT_DIR/tb/<start time>."""
    tc.metrics.enable_tensorboard = tensorboard
    tc.metrics.save_tb_folder = "tb"


PROFILE_FOLDER = "profile_traces"  # under OUT_DIR (torchtitan's dump folder)
PROFILE_TRACE = "iteration_{step}/rank*_trace.json.gz"  # torchtitan's names for a step's traces in that folder


def check_profile(profile: bool, profile_freq: int, steps: int, device_mode: bool = False) -> None:
    """Settings that would trace nothing, refused before anything runs: --profile_freq or --profile_device without
    --profile, --profile_freq past --steps, and a traced step with no step before it (torch.profiler's warm-up:
    without one, the trace torchtitan writes holds its metadata and no step)."""
    from common.errors import UserError

    if device_mode and not profile:
        raise UserError("--profile_device traces nothing without --profile: add --profile")
    if profile_freq and not profile:
        raise UserError(f"--profile_freq {profile_freq} traces nothing without --profile: add --profile")
    if profile and profile_freq > steps:
        raise UserError(f"--profile_freq {profile_freq} is more than --steps {steps}: no step would be traced; trace "
                        "a step the run reaches (0: the last one)")
    if profile and profile_every(steps, profile_freq) < 2:
        what = f"--profile_freq {profile_freq}" if profile_freq else f"--steps {steps}"
        raise UserError(f"{what} leaves the profiler no warm-up step before the traced one, and its trace would hold "
                        "no step: trace every 2nd step or more (--profile_freq 2), or run 2 steps or more")


def profile_every(steps: int, profile_freq: int) -> int:
    """The interval of the traced steps: --profile_freq, or with 0 the run's last step (--steps)."""
    return profile_freq or steps


def profiled_steps(every: int, first: int, last: int) -> list[int]:
    """The steps from `first` to `last` torchtitan's profiler traces, at `every`: its multiples."""
    return [s for s in range(max(first, 1), last + 1) if s % every == 0]


def apply_profile_settings(tc, *, steps: int, profile_freq: int, device_type: str) -> dict:
    """torchtitan's own profiler settings on the Trainer.Config: a torch.profiler trace (Chrome trace format,
    gzipped) of every `every`-th step into OUT_DIR/profile_traces/iteration_N/rankR_trace.json.gz, the steps
    before each traced one its warm-up (3, as torchtitan's default, or fewer at a shorter interval); each trace is
    written when its step ends. GuardHooks.build sets common/harness/trainer.py's GuardedProfiler, which adds the
    Neuron activity on Neuron.
    {"every", "activities", "note"}: the interval, what is traced, a note for the log."""
    every = profile_every(steps, profile_freq)
    tc.profiler.enable_profiling = True
    tc.profiler.save_traces_folder = PROFILE_FOLDER
    tc.profiler.profile_freq = every
    tc.profiler.profiler_active = 1
    tc.profiler.profiler_warmup = min(3, every - 1)  # at least 1: check_profile
    activities = "CPU"
    if device_type == "neuron":
        from common.device import neuron_available

        if neuron_available():  # common/harness/trainer.py's GuardedProfiler asks for it
            activities = "CPU and Neuron (PrivateUse1)"
    note = (f"profiling: torch.profiler ({activities}) traces step {every}" + (" and its multiples" if every < steps
            else "") + f" into OUT_DIR/{PROFILE_FOLDER}" + (f", the Neuron runtime's traces into OUT_DIR/{PROFILE_FOLDER}/"
                                                           f"{NEURON_TRACES}" if "Neuron" in activities else ""))
    return {"every": every, "activities": activities, "note": note}


def profile_traces(out_dir, *, every: int, steps: list[int], since: float, activities: str,
                   earlier: dict | None = None) -> dict:
    """results.json's `profile`: the steps traced in this run and the trace files torchtitan wrote for them (each
    rank's, where this host sees them: paths relative to OUT_DIR, with their sizes). `since`: when this run
    started; an older run's trace of the same step is not listed (2 s allowed for a file system's coarse times).
    `earlier`: the stopped part's `profile` (a resumed run's results.json before this part replaces it): its traces
    of the steps before this part's, where the file is still there at its size, listed first."""
    from pathlib import Path

    folder = Path(out_dir) / PROFILE_FOLDER
    traced = profiled_steps(every, steps[0], steps[-1]) if steps else []
    traces = []
    for row in ((earlier or {}).get("traces") or []) if steps else []:
        try:
            step, rel, size = int(row["step"]), str(row["path"]), int(row["bytes"])
            path = (Path(out_dir) / rel).resolve()
            kept = step < steps[0] and path.is_relative_to(folder.resolve()) and path.stat().st_size == size
        except (TypeError, ValueError, KeyError, OSError):
            continue
        if kept:
            traces.append({"step": step, "path": rel, "bytes": size})
    for step in traced:
        traces += [{"step": step, **f} for f in files_since(folder, out_dir, since, PROFILE_TRACE.format(step=step))]
    traced = sorted({t["step"] for t in traces if t["step"] < (steps[0] if steps else 1)}) + traced  # earlier parts'
    out = {"every": every, "steps": traced, "folder": PROFILE_FOLDER, "traces": traces, "activities": activities,
           "format": "Chrome trace JSON, gzipped (chrome://tracing, ui.perfetto.dev, TensorBoard's profile plugin)"}
    if "Neuron" in activities:
        out["neuron_traces"] = files_since(folder / NEURON_TRACES, out_dir, since)
    return out


NEURON_TRACES = "neuron"  # OUT_DIR/profile_traces/neuron/node<N>: the Neuron runtime's traces (GuardedProfiler)


def files_since(folder, out_dir, since: float, pattern: str = "**/*") -> list[dict]:
    """The files under `folder` matching `pattern` (any, by default) written by this run (modified at or after
    `since`, 2 s allowed for a file system's coarse times): [{"path" (relative to OUT_DIR), "bytes"}], sorted by path.
    A Neuron profile's files (trace_info.pb, ntrace.pb, .ntff, .neff under one `<instance id>_pid_<pid>/` folder a
    process) are listed whole: Neuron Explorer wants them uploaded together."""
    from pathlib import Path

    found = []
    for path in sorted(Path(folder).glob(pattern)):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file() and st.st_mtime >= since - 2:
            found.append({"path": str(path.relative_to(out_dir)), "bytes": st.st_size})
    return found


def checked_mfu(flops: int, tokens_per_s: float, peak: dict, world_size: int) -> tuple[float | None, str | None]:
    """(MFU, None), or (None, why) where it is no measurement: a peak that is not a positive finite number, or an
    MFU above 1 (the peak is below what the run did). (None, None) without a throughput."""
    value, source = peak.get("value"), peak.get("source") or "unknown source"
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        return None, f"the peak {value!r} FLOP/s a device ({source}) is not a positive number: no MFU against it"
    if not math.isfinite(tokens_per_s):
        return None, None
    mfu = flops * tokens_per_s / (value * world_size)
    if mfu > 1:
        return None, (f"MFU would be {mfu:.3g}, above 1: the peak {value / 1e12:.3g} TFLOPS a device ({source}) is "
                      "below what this run did: pass the device's real peak as --peak_tflops")
    return mfu, None


def timing(rec, world_size: int, steps_s: list[float] | None = None) -> dict:
    """This process's first step against the steady steps, from the LossRecorder's per-step times and token counts.
    `steps_s`: the stop control's time of each step (common/harness/stops.py's StopControl.steps_s), which leaves out
    the held-out evaluation and the save after the step before; the recorder's time between two steps holds them.
    The steps after the first are timed from it where it has one time a step (the first is always the recorder's:
    the stop control counts it from before the build)."""
    steps = len(rec.losses)
    if steps == 0:
        return {}
    durations = [b - a for a, b in zip(rec.times, rec.times[1:])]  # step i's duration: durations[i - 1]
    if steps_s is not None and len(steps_s) == len(durations):
        durations = durations[:1] + list(steps_s[1:])
    excluded = 1 if steps < 5 else 2  # step 2 may still compile (the optimizer's first update)
    steady = durations[excluded:] or durations[-1:]
    steady_s = statistics.median(steady)
    per_step = ((rec.tokens_seen[-1] - rec.tokens_seen[0]) / (steps - 1) if steps > 1 else rec.tokens_seen[0])
    tps = per_step / steady_s if steady_s > 0 else math.nan
    return {"first_step": rec.steps[0] if rec.steps else 1, "first_step_s": durations[0], "steady_step_s": steady_s,
            "warmup_steps_excluded": min(excluded, steps - 1), "steady_tokens_per_s": tps,
            "steady_tokens_per_s_per_rank": tps / world_size,
            "compile_or_warmup_s": max(durations[0] - steady_s, 0.0),  # 0: step 1 no slower (noise, nothing compiled)
            "tokens_per_step": per_step}


def peak_memory(device_type: str, device, peak_bytes: int) -> dict:
    """Every rank's peak memory in GiB (gathered to all ranks), and what measured it: `peak_bytes`, this rank's
    heaviest step (common/harness/trainer.py's GuardedMetrics reads each step's peak before torchtitan resets it)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(peak_bytes)], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())] if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather(every, mine)
    if device_type == "neuron":
        from common.device import neuron_peak_memory

        by = neuron_peak_memory()[1]  # torch.neuron's, or torch.accelerator's where TorchNeuron documents it
    else:
        by = "torch.cuda.max_memory_allocated" if device_type == "cuda" else \
            "the process's peak resident set size (ru_maxrss): Python, libraries and tensors"
    return {"peak_gib": [round(float(t.item()) / GIB, 4) for t in every], "measured_by": by + ", the heaviest step"}


def _plan_cache(key: dict) -> "Path":
    """Where the plan of `key` (the run record and world size) is kept: the dry run is deterministic for a
    configuration, its torch and torchtitan, and its own source, so a rerun or a sibling run reads it back."""
    import hashlib
    import json
    from pathlib import Path

    from common.paths import CACHE_DIR
    from common.results import versions

    source = Path(__file__).with_name("dryrun.py").read_bytes() + Path(__file__).read_bytes()  # the plan's code
    blob = json.dumps({"key": key, "versions": {k: versions().get(k) for k in ("torch", "torchtitan")},
                       "source": hashlib.sha256(source).hexdigest()}, sort_keys=True, default=str)
    return CACHE_DIR.parent / "plans" / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


class PlanInAChild:
    """The dry run's per-rank total for this configuration, in GiB, planned in a forked child while this process goes
    on to step 1 (the figure is read with the results, `result()`): `plan()` runs in the child (the dry run makes a
    process group of its own, a fake one, and may plan once per process), forked before this process has one. On
    CPU torchtitan is routed first, so the child finds it imported; on an accelerator the child routes its own copy
    to the CPU (the model is on the meta device) and this process routes later. None if the child fails; the run
    goes on. With `key` the result is kept in the cache folder and read back for the same key (no child then)."""

    def __init__(self, plan, device_type: str, key: dict | None = None):
        import json

        from common.device import route_torchtitan_device

        self.cached, self.value, self.child = _plan_cache(key) if key is not None else None, None, None
        self.key = key
        if self.cached is not None and self.cached.is_file():
            try:
                self.value = float(json.loads(self.cached.read_text())["planned_gib"])
                return
            except (OSError, ValueError, KeyError, TypeError):
                pass  # planned again below
        self.child = _fork_plan(plan, device_type, route_torchtitan_device)
        self.deadline = time.monotonic() + PLAN_TIMEOUT_S

    def result(self) -> float | None:
        import json

        from common.results import atomic_write_text

        if self.child is not None:
            self.value, self.child = _collect_plan(*self.child, self.deadline), None
            if self.value is not None and self.cached is not None:
                try:
                    self.cached.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(self.cached, json.dumps({"planned_gib": self.value, "key": self.key},
                                                              default=str) + "\n")
                except OSError:
                    pass  # a read-only cache only costs the plan next time
        return self.value


PLAN_TIMEOUT_S = 300


def _plan_in_a_child(plan, device_type: str, route) -> float | None:
    """The plan in a forked child, waited for (PlanInAChild without the cache and without going on meanwhile)."""
    child = _fork_plan(plan, device_type, route)
    return _collect_plan(*child, time.monotonic() + PLAN_TIMEOUT_S) if child is not None else None


def _fork_plan(plan, device_type: str, route) -> tuple[int, int] | None:
    """(the child's pid, the pipe it answers on); None where a fork is not safe (processes.fork_is_safe: another
    Python thread, holding a lock at the fork, would leave the child waiting on it forever). The child plans on one
    torch thread (the parent's OpenMP threads are not in it), ignores the stop signals (a stop is the parent's), dies
    with this process, however this process ends (a SIGKILL too: it holds a copy of the out_dir lock's descriptor,
    and would hold the lock until it ended), and never prints a traceback: whatever happens in it ends in os._exit."""
    import json
    import signal

    from common.processes import die_with_parent, fork_is_safe

    if not fork_is_safe():
        return None
    if device_type == "cpu":
        route("cpu")

    arm = die_with_parent(signal.SIGKILL)  # prctl looked up here, before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plan, report, leave without running anything of the parent's
        try:
            arm()
            os.close(read)
            for sig in STOP_SIGNALS:  # a stop is the parent's to make (a Ctrl-C reaches the whole group);
                signal.signal(sig, signal.SIG_IGN)  # the child ends with it however it ends (the parent-death signal)
            try:
                import torch

                # One intra-op thread before any op: the parent's OpenMP pool (torch's default threads, once an op
                # has run) is not in the child, and a parallel region there would wait for it forever.
                torch.set_num_threads(1)
                payload = json.dumps({"planned_bytes": plan()})
            except BaseException as e:  # noqa: BLE001  reported to the parent as text
                payload = json.dumps({"error": f"{type(e).__name__}: {e}"})
            os.write(write, payload.encode())
        except BaseException:  # noqa: BLE001  the parent gone (a broken pipe) or a signal: nothing to tell
            pass
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _collect_plan(pid: int, read: int, deadline: float) -> float | None:
    """The child's answer, in GiB; None, the child killed, where it has not answered by `deadline`."""
    import json
    import select
    import signal

    chunks = []
    while select.select([read], [], [], max(deadline - time.monotonic(), 0))[0]:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    else:  # no answer in time: the run goes on without a plan
        os.kill(pid, signal.SIGKILL)
        chunks = []
    os.close(read)
    os.waitpid(pid, 0)
    try:
        got = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return None
    return round(got["planned_bytes"] / GIB, 4) if "planned_bytes" in got else None


def cost(price_per_hour: float | None, wall_s: float, steady_tokens_per_s: float) -> dict | None:
    if not price_per_hour:
        return None
    return {"price_per_hour": price_per_hour, "run_hours": wall_s / 3600, "run_cost": price_per_hour * wall_s / 3600,
            "per_million_tokens": price_per_hour / (steady_tokens_per_s * 3600) * 1e6
            if steady_tokens_per_s and math.isfinite(steady_tokens_per_s) else None}


NOT_COMPARABLE = ("profiled run: the peak holds torch.profiler's own buffers (and on Neuron the memory a device "
                  "trace reserves), which the plan does not count")
CPU_NOT_COMPARABLE = ("CPU run: the peak is the process's resident set (Python, its libraries, about 1 GB with torch, "
                      "and the freed memory glibc keeps) where the plan counts tensors; the plan's terms are checked "
                      "against a CPU step's tensors by bench/bench_memory_model.py")


def report(rec, *, shape: dict, seq_len: int, world_size: int, peak: dict, memory: dict, planned_gib: float | None,
           price_per_hour: float | None, compile_cache: dict | None = None, profile: dict | None = None,
           device_type: str = "cpu", steps_s: list[float] | None = None) -> dict:
    """The pilot fields of results.json. Memory is compared with the plan (`ratio`) only where both count the same
    thing: not for a profiled run (`profile`, profile_traces()), nor on CPU (`device_type`), whose figure is the
    process's resident set. `steps_s`: the stop control's step times, evaluations and saves left out (timing())."""
    import psutil

    t = timing(rec, world_size, steps_s)
    if t and compile_cache is not None:
        t["compile_cache"] = compile_cache
    flops = flops_per_token(shape, seq_len)
    tps = t.get("steady_tokens_per_s", math.nan)
    mfu, why = checked_mfu(flops, tps, peak, world_size)
    top = max(memory["peak_gib"])
    wall = time.time() - psutil.Process().create_time()
    unlike = NOT_COMPARABLE if profile is not None else CPU_NOT_COMPARABLE if device_type == "cpu" else None
    out = {"timing": t, "flops_per_token": flops, "mfu": mfu, "mfu_note": why, "peak_flops_per_device": peak,
           "memory": {**memory, "planned_gib": planned_gib, "comparable": unlike is None,
                      "ratio": round(top / planned_gib, 3) if planned_gib and unlike is None else None,
                      **({} if unlike is None else {"not_comparable": unlike})},
           "cost": cost(price_per_hour, wall, tps)}
    if profile is not None:
        out["profile"] = profile
    return out


def mfu_warning(p: dict) -> str | None:
    """The one warning line of a run whose MFU was left out, naming the peak and its source."""
    return f"warning: no MFU in results.json (mfu: null): {p['mfu_note']}" if p.get("mfu_note") else None


def fallback_ops(device_type: str) -> dict | None:
    """Neuron: the ops TorchNeuron ran on the host CPU instead of the device in this process (they slow a step
    without failing it), from `torch_neuronx.get_fallback_ops()`, a per-process registry (read in the training
    process, after the steps). None off Neuron."""
    if device_type != "neuron":
        return None
    import torch_neuronx

    get = getattr(torch_neuronx, "get_fallback_ops", None)
    if get is None:
        return {"ops": None, "note": "this torch-neuronx has no get_fallback_ops()"}
    ops = get() or []
    names = sorted({str(op) for op in (ops.keys() if isinstance(ops, dict) else ops)})
    return {"ops": names, "count": len(names)}


def format_line(p: dict) -> str:
    t, m = p["timing"], p["memory"]
    peak = p["peak_flops_per_device"]["value"]
    mfu = f"{p['mfu']:.3f}" if p["mfu"] is not None else "- (left out: see the warning)" if p.get("mfu_note") else "-"
    planned = f"{m['planned_gib'] or float('nan'):.2f} GiB planned"
    cache = t.get("compile_cache")
    first = t.get("first_step", 1)
    return ((f"[pilot] step 1 {t['first_step_s']:.2f} s" if first == 1 else
             f"[pilot] first step (step {first}, after the resume) {t['first_step_s']:.2f} s")
            + (f" (compile cache: {cache['state']})" if cache else "")
            + f", steady {t['steady_step_s']:.3f} s/step "
            f"({t['steady_tokens_per_s']:.0f} tokens/s); {p['flops_per_token'] / 1e6:.1f} MFLOP/token, MFU "
            f"{mfu}{' (CPU: indicative)' if p['peak_flops_per_device'].get('indicative') else ''} of "
            f"{peak / 1e12:.3g} TFLOPS a device; memory {max(m['peak_gib']):.2f} GiB peak vs {planned}"
            + ("" if m.get("comparable", True) else " (not comparable: a profiled run)"
               if m.get("not_comparable", "").startswith("profiled") else " (not comparable on CPU: the process's "
                                                                        "resident set against the plan's tensors)")
            + (f"; cost {p['cost']['run_cost']:.4g} at {p['cost']['price_per_hour']:g}/h" if p["cost"] else "")
            + (f"; {len(p['profile']['traces'])} profile trace(s) in {p['profile']['folder']}"
               if p.get("profile") else "")
            + (f"; {p['fallback_ops']['count']} op(s) ran on the CPU: {', '.join(p['fallback_ops']['ops'][:5])}"
               + (" ..." if p["fallback_ops"]["count"] > 5 else "") if (p.get("fallback_ops") or {}).get("count")
               else ""))


def project(*, steps: int, tokens_per_step: int, flops: int, world_size: int, peak: float, mfu: float,
            price_per_hour: float | None) -> dict:
    """The dry run's projection of the full run: its FLOPs at an assumed MFU of the target's peak."""
    seconds = steps * tokens_per_step * flops / (mfu * peak * world_size)
    return {"steps": steps, "tokens_per_step": tokens_per_step, "flops_per_token": flops, "assumed_mfu": mfu,
            "peak_flops_per_device": peak, "world_size": world_size, "seconds": seconds,
            "cost": price_per_hour * seconds / 3600 if price_per_hour else None, "price_per_hour": price_per_hour}
