"""The compile audit: how many graphs a model's generation hands to the compiler, and whether its decode step
recompiles as the cache grows, seen on any machine before any compiler runs.

On Trainium every graph that torch.compile hands to the neuron backend is compiled by neuronx-cc (minutes each),
and every recompilation is one more. Which graphs there are, and when one is compiled again, is decided by Dynamo
before any backend runs, so the same generation under Dynamo with a backend that only counts (graph capture, no
code generation: each captured graph runs as it was traced) shows it on CPU in seconds.

The audit calls Dynamo as torch.compile does (`torch._dynamo.optimize`, what torch.compile returns) with the
arguments of the check's own torch.compile call (`compile_options`, one set for both: the row's `fullgraph`, and
`dynamic=False`), so that it counts the graphs of the call the check makes. `dynamic=False`: one graph per input
shape. The neuron backend takes no symbolic shapes (AWS's torch.compile reference: pass dynamic=False; a shape that
changes is compiled again), so a cache whose tensors grow by one position per token is a new graph per token there,
never one graph for every length. Two differences, so that it sees what Trainium will compile:
- a recompile limit above the number of forward calls, so that every recompilation is counted (Dynamo's default,
  8, would stop compiling the frame and run the rest uncompiled, hiding them);
- `guard_fail_fn`, Dynamo's hook for a failed guard: why each recompilation happened.
Graph breaks are Dynamo's own count (`torch._dynamo.utils.counters["graph_break"]`: reason -> times); each graph's
compile id (`CompileContext.current_compile_id()`, frame/attempt; attempt > 0 is a recompilation) is Dynamo's too.
Dynamo is reset before and after, so that no graph of one model is reused for the next.

Phases: forward call 1 is the prefill, call 2 the first decode step (a recompilation of the prefill's frame for its
new input length, as expected), calls 3 and later the rest of the decode. `recompiles` counts the recompilations in
that rest: none for a static cache, one per token for a cache that grows.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from collections import Counter

MODE = ("Dynamo with a counting backend (graph capture only, no code generation), dynamic=False: one graph per "
        "input shape, as the neuron backend compiles")
MAX_LISTED = 40  # reasons and compiles kept per row; a per-token recompile repeats one guard with other numbers
_AS_DYNAMO = {"fullgraph": "nopython", "dynamic": "dynamic"}  # torch.compile's names -> torch._dynamo.optimize's


def compile_options(fullgraph: bool) -> dict:
    """torch.compile's arguments for the check's compiled forward, besides the backend: the one set that the check's
    own call (generate_compat_check.compile_forward) and the audit (audit_generation) both use. dynamic=False: one
    graph per input shape, never a symbolic one, as the neuron backend needs."""
    return {"fullgraph": fullgraph, "dynamic": False}


def audit_generation(model, forward, generate, *, fullgraph: bool, new_tokens: int) -> dict:
    """Run `generate()` (one generation of `new_tokens` tokens through `model.forward`) with `forward`, the model's
    eager forward, under Dynamo and a counting backend; `model.forward` is restored afterwards. Returns the audit
    (`summary`), with `output`: what generate() returned."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._guards import CompileContext

    calls = 0
    compiles: list[dict] = []
    pending: list[str] = []  # guard failures since the last graph: why the next one is compiled

    def counting_backend(gm, example_inputs):
        cid = CompileContext.current_compile_id()
        compiles.append({"call": calls, "compile_id": None if cid is None else str(cid),
                         "recompile": cid is not None and (cid.frame_compile_id or 0) > 0,
                         "ops": sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes),
                         "guards": list(pending)})
        pending.clear()
        return gm.forward  # the captured graph runs as traced: no code is generated

    def guard_failed(failure) -> None:
        pending.append(" ".join(str(failure.reason).split()))

    limit = new_tokens + 16
    torch._dynamo.reset()
    counters.clear()
    saved = model.__dict__.get("forward")
    quiet = logging.getLogger("torch._dynamo")  # graph-break warnings: the row records them
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        with torch._dynamo.config.patch(accumulated_recompile_limit=max(256, 4 * limit)):
            options = {_AS_DYNAMO[k]: v for k, v in compile_options(fullgraph).items()}  # as torch.compile passes them
            compiled = torch._dynamo.optimize(counting_backend, guard_fail_fn=guard_failed, recompile_limit=limit,
                                              **options)(forward)

            @functools.wraps(forward)  # generate() reads the forward's signature to check its arguments
            def counted(*args, **kwargs):
                nonlocal calls
                calls += 1
                return compiled(*args, **kwargs)

            model.forward = counted
            output = generate()
        breaks = Counter()
        for reason, n in counters["graph_break"].items():
            breaks[short_reason(str(reason))] += int(n)
    finally:
        if saved is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = saved
        quiet.setLevel(level)
        torch._dynamo.reset()
        counters.clear()
    return dict(summary(compiles, breaks, calls, new_tokens, time.perf_counter() - start, limit),
                cpu_seconds=time.process_time() - cpu, output=output)


def short_reason(text: str) -> str:
    """A graph-break message as one line: its title and Dynamo's explanation (the hints and links dropped)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown reason"
    why = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.startswith("Explanation:")), None)
    return f"{lines[0]}: {why}" if why else lines[0]


def _guard(failures: list[str]) -> str:
    """The guard that failed on the frame's newest graph (Dynamo checks the newest first), and how many older
    graphs of the frame failed too."""
    if not failures:
        return "no guard failure recorded"
    return failures[0] + (f" (and {len(failures) - 1} older graph(s) of this frame)" if len(failures) > 1 else "")


def summary(compiles: list[dict], breaks: Counter, calls: int, new_tokens: int, seconds: float, limit: int) -> dict:
    """The audit: graphs (compiled in all), recompiles (recompilations after the first decode step) with their
    reasons (the guard that failed), graph breaks with theirs, graphs per phase, and the first compiles."""
    later = [c for c in compiles if c["call"] >= 3 and c["recompile"]]
    reasons = [f"forward call {c['call']}: {_guard(c['guards'])}" for c in later]
    if len(reasons) > MAX_LISTED:
        reasons = reasons[:MAX_LISTED] + [f"... and {len(reasons) - MAX_LISTED} more"]
    return {"graphs": len(compiles), "recompiles": len(later), "recompile_reasons": reasons,
            "graph_breaks": sum(breaks.values()), "graph_break_reasons": dict(breaks.most_common()),
            "phases": {"prefill": sum(c["call"] <= 1 for c in compiles),
                       "first_decode_step": sum(c["call"] == 2 for c in compiles),
                       "later_decode_steps": sum(c["call"] >= 3 for c in compiles)},
            "forward_calls": calls, "new_tokens": new_tokens, "seconds": seconds, "mode": MODE,
            "recompile_limit": limit,
            "compiles": [{"forward_call": c["call"], "compile_id": c["compile_id"], "ops": c["ops"],
                          "guard": _guard(c["guards"]) if c["recompile"] else None} for c in compiles[:MAX_LISTED]]}


def per_token(audit: dict) -> bool:
    """Every decode step after the first compiled again: the cache (or something else) changes shape per token."""
    later_calls = audit["forward_calls"] - 2
    return later_calls > 0 and audit["recompiles"] >= later_calls


def note(audit: dict) -> str:
    """One sentence for the row's notes: the counts, and what a recompiling decode costs on Trainium."""
    if audit.get("error"):
        return f"compile audit failed: {audit['error']}"
    p = audit["phases"]
    text = (f"compile audit: {audit['graphs']} graph(s) over {audit['forward_calls']} forward calls (prefill "
            f"{p['prefill']}, first decode step {p['first_decode_step']}, later decode steps "
            f"{p['later_decode_steps']}), " + (f"{audit['graph_breaks']} graph break(s)" if audit["graph_breaks"]
                                                else "no graph break"))
    if not audit["recompiles"]:
        return text + f", no recompile over {audit['new_tokens']} tokens: compiles once"
    first = audit["recompile_reasons"][0].split(": ", 1)[-1][:200]
    if per_token(audit):
        return text + (f"; the decode step recompiles at every new token ({audit['recompiles']} recompilations over "
                       f"{audit['new_tokens']} tokens; first guard: {first}): on Trainium each is one more neuronx-cc "
                       "compilation (minutes each), hours for one generation, and past Dynamo's recompile_limit "
                       "(8 by default) the rest of the decode runs uncompiled; a static cache compiles it once")
    return text + (f"; the decode step recompiles {audit['recompiles']} time(s) over {audit['new_tokens']} tokens "
                   f"(first guard: {first}): on Trainium each is one more neuronx-cc compilation (minutes each)")


def row_columns(audit: dict | None) -> dict:
    """The row's columns: the counts as integers, their reasons beside them as JSON, the rest in compile_audit."""
    if audit is None:
        return {}
    keys = ("mode", "phases", "forward_calls", "new_tokens", "seconds", "cpu_seconds", "recompile_limit",
            "same_tokens", "compiles", "error")
    details = {k: audit[k] for k in keys if k in audit}
    if audit.get("error"):
        return {"compile_audit": json.dumps(details)}
    details["compiles_once"] = not audit["recompiles"]
    return {"compile_graphs": audit["graphs"], "compile_recompiles": audit["recompiles"],
            "compile_recompile_reasons": json.dumps(audit["recompile_reasons"]),
            "compile_graph_breaks": audit["graph_breaks"],
            "compile_graph_break_reasons": json.dumps(audit["graph_break_reasons"]),
            "compile_audit": json.dumps(details)}
