"""What a pilot run must tell before a longer one: warm-up apart from steady speed, FLOPs per token and MFU,
memory against the plan, and cost. Written into results.json by the three training scripts.

- `timing`: step 1 (with compilation and warm-up) against the median step after the warm-up steps.
- `flops_per_token`: 6 x the parameters a token passes through (MoE: the active experts; embeddings are looked
  up, not multiplied; the output projection counts, tied or not) + torchtitan's attention term 12 x layers x heads x
  head_dim x sequence length; from the model's config.json, so the three paths count the same model the same.
- `mfu`: flops_per_token x steady tokens/s / (peak FLOP/s per device x devices), against `peak_flops_per_device`:
  --peak_tflops when given; else torchtitan's table for a known accelerator (trn2: 79 TFLOPS bfloat16 per
  NeuronCore-v3, two per logical core at LNC=2); on CPU a matmul measured in this process, in the run's dtype.
  torchtitan's own step lines and TensorBoard get the same two numbers (`use_in_torchtitan`).
- `memory`: each rank's peak (the device allocator; on CPU the process's peak resident set size) beside the dry
  run's estimate for the same configuration (`planned_gib`).
- `cost`: with --price_per_hour (no price is written into the repository).
"""
from __future__ import annotations

import math
import os
import statistics
import time

GIB = 1 << 30
TRN2_PEAK = 79e12 * 2  # bfloat16 FLOP/s of one LNC=2 logical core (torchtitan's get_peak_flops for trn2)


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


def measured_cpu_peak(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n matmuls on this process's threads, in `dtype`."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    torch.matmul(a, b)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def peak_flops(device_type: str, dtype: str, peak_tflops: float | None) -> dict:
    """{"value": FLOP/s of one device (one process's cores on CPU), "source": where it came from}."""
    import torch

    if peak_tflops:
        return {"value": peak_tflops * 1e12, "source": "--peak_tflops"}
    if device_type == "cpu":
        return {"value": measured_cpu_peak(dtype), "source": f"measured: best of 5 {dtype} 1024x1024 matmuls on "
                                                             f"{torch.get_num_threads()} thread(s) of this process"}
    from torchtitan.tools import utils

    name = "neuron" if device_type == "neuron" else torch.cuda.get_device_name()
    value = utils.get_peak_flops(name)
    return {"value": value, "source": f"torchtitan get_peak_flops({name!r})" + (
        " (its A100 fallback: pass --peak_tflops)" if value == 312e12 and "A100" not in name else "")}


def apply_metrics_settings(tc, tensorboard: bool) -> None:
    """torchtitan's own metrics: with `tensorboard`, its TensorBoard logger into OUT_DIR/tb/<start time>."""
    tc.metrics.enable_tensorboard = tensorboard
    tc.metrics.save_tb_folder = "tb"


def use_in_torchtitan(trainer, flops: int, peak: dict) -> None:
    """torchtitan's own step lines and TensorBoard: the same FLOPs per token and peak as results.json."""
    trainer.metrics_processor.num_flops_per_token = flops
    trainer.metrics_processor.gpu_peak_flops = peak["value"]


def timing(rec, world_size: int) -> dict:
    """Step 1 against the steady steps, from the LossRecorder's per-step times and token counts."""
    steps = len(rec.losses)
    if steps == 0:
        return {}
    durations = [b - a for a, b in zip(rec.times, rec.times[1:])]  # step i's duration: durations[i - 1]
    excluded = 1 if steps < 5 else 2  # step 2 may still compile (the optimizer's first update)
    steady = durations[excluded:] or durations[-1:]
    steady_s = statistics.median(steady)
    per_step = ((rec.tokens_seen[-1] - rec.tokens_seen[0]) / (steps - 1) if steps > 1 else rec.tokens_seen[0])
    tps = per_step / steady_s if steady_s > 0 else math.nan
    return {"first_step_s": durations[0], "steady_step_s": steady_s,
            "warmup_steps_excluded": min(excluded, steps - 1), "steady_tokens_per_s": tps,
            "steady_tokens_per_s_per_rank": tps / world_size, "compile_or_warmup_s": durations[0] - steady_s,
            "tokens_per_step": per_step}


def peak_memory(device_type: str, device) -> dict:
    """Every rank's peak memory in GiB (gathered to all ranks), and what measured it."""
    import torch
    import torch.distributed as dist

    from common.device import peak_memory_bytes

    mine = torch.tensor([float(peak_memory_bytes(device_type))], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())] if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather(every, mine)
    by = {"cuda": "torch.cuda.max_memory_allocated", "neuron": "torch.neuron.max_memory_allocated"}.get(
        device_type, "the process's peak resident set size (ru_maxrss): Python, libraries and tensors")
    return {"peak_gib": [round(float(t.item()) / GIB, 4) for t in every], "measured_by": by}


def _plan_cache(key: dict) -> "Path":
    """Where the plan of `key` (the run record and world size) is kept: the dry run is deterministic for a
    configuration, its torch and torchtitan, and its own source, so a rerun or a sibling run reads it back."""
    import hashlib
    import json
    from pathlib import Path

    from common.harness import dryrun
    from common.paths import CACHE_DIR
    from common.results import versions

    source = Path(dryrun.__file__).read_bytes() + Path(__file__).read_bytes()
    blob = json.dumps({"key": key, "versions": {k: versions().get(k) for k in ("torch", "torchtitan")},
                       "source": hashlib.sha256(source).hexdigest()}, sort_keys=True, default=str)
    return CACHE_DIR.parent / "plans" / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"


def planned_gib_in_a_child(plan, device_type: str, key: dict | None = None) -> float | None:
    """The dry run's per-rank total for this configuration, in GiB: `plan()` runs in a forked child (the dry run
    makes a process group of its own and may plan once per process), before this process has one. On CPU torchtitan
    is routed first, so the child finds it imported; on an accelerator the child routes its own copy to the CPU
    (the model is on the meta device) and this process routes later. None if the child fails; the run goes on.
    With `key` the result is kept in the cache folder and read back for the same key."""
    import json

    from common.device import route_torchtitan_device
    from common.results import atomic_write_text

    cached = _plan_cache(key) if key is not None else None
    if cached is not None and cached.is_file():
        try:
            return float(json.loads(cached.read_text())["planned_gib"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # planned again below
    got = _plan_in_a_child(plan, device_type, route_torchtitan_device)
    if got is not None and cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached, json.dumps({"planned_gib": got, "key": key}, default=str) + "\n")
        except OSError:
            pass  # a read-only cache only costs the plan next time
    return got


PLAN_TIMEOUT_S = 300


def _plan_in_a_child(plan, device_type: str, route) -> float | None:
    """None where a fork is not safe (device.fork_is_safe: another Python thread, holding a lock at the fork, would
    leave the child waiting on it forever); and None, the child killed, if it has not answered in
    PLAN_TIMEOUT_S. The child plans on one torch thread (the parent's OpenMP threads are not in it). It dies with
    this process, however this process ends (a SIGKILL too: it holds a copy of the out_dir lock's descriptor, and
    would hold the lock until it ended), and never prints a traceback: whatever happens in it ends in os._exit."""
    import json
    import select
    import signal

    from common.device import die_with_parent, fork_is_safe

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
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):  # the parent's stop handlers
                signal.signal(sig, signal.SIG_DFL)                                      # are not the child's
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
    chunks, deadline = [], time.monotonic() + PLAN_TIMEOUT_S
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


def report(rec, *, shape: dict, seq_len: int, world_size: int, peak: dict, memory: dict, planned_gib: float | None,
           price_per_hour: float | None) -> dict:
    """The pilot fields of results.json."""
    import psutil

    t = timing(rec, world_size)
    flops = flops_per_token(shape, seq_len)
    tps = t.get("steady_tokens_per_s", math.nan)
    mfu = flops * tps / (peak["value"] * world_size) if math.isfinite(tps) else None
    top = max(memory["peak_gib"])
    wall = time.time() - psutil.Process().create_time()
    return {"timing": t, "flops_per_token": flops, "mfu": mfu, "peak_flops_per_device": peak,
            "memory": {**memory, "planned_gib": planned_gib,
                       "ratio": round(top / planned_gib, 3) if planned_gib else None},
            "cost": cost(price_per_hour, wall, tps)}


def format_line(p: dict) -> str:
    t, m = p["timing"], p["memory"]
    return (f"[pilot] step 1 {t['first_step_s']:.2f} s, steady {t['steady_step_s']:.3f} s/step "
            f"({t['steady_tokens_per_s']:.0f} tokens/s); {p['flops_per_token'] / 1e6:.1f} MFLOP/token, MFU "
            f"{p['mfu']:.3f} of {p['peak_flops_per_device']['value'] / 1e12:.3g} TFLOPS a device; memory "
            f"{max(m['peak_gib']):.2f} GiB peak vs {m['planned_gib'] or float('nan'):.2f} GiB planned"
            + (f"; cost {p['cost']['run_cost']:.4g} at {p['cost']['price_per_hour']:g}/h" if p["cost"] else ""))


def project(*, steps: int, tokens_per_step: int, flops: int, world_size: int, peak: float, mfu: float,
            price_per_hour: float | None) -> dict:
    """The dry run's projection of the full run: its FLOPs at an assumed MFU of the target's peak."""
    seconds = steps * tokens_per_step * flops / (mfu * peak * world_size)
    return {"steps": steps, "tokens_per_step": tokens_per_step, "flops_per_token": flops, "assumed_mfu": mfu,
            "peak_flops_per_device": peak, "world_size": world_size, "seconds": seconds,
            "cost": price_per_hour * seconds / 3600 if price_per_hour else None, "price_per_hour": price_per_hour}
