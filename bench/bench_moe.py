"""Time of the grouped-expert op against a per-expert loop and against torchtitan's stock MoE
experts, forward + backward, 8 to 64 experts, measured side by side.

Routed experts of one MoE layer (SwiGLU experts, top-k routing, Qwen3-MoE layout) on `--tokens`
tokens of width `--dim`, expert hidden size `--hidden`, `--top_k` experts per token. The router's
scores and choices are fixed inputs (scores are leaves with requires_grad, so every candidate also
produces their gradient); each call runs the forward and one backward with a fixed output gradient.
Candidates, all with the same weights:
  - `op_fp32`: common/kernels/moe_op.py `grouped_experts`, float32 matmuls (the CPU preset's setting);
  - `loop_fp32`: a per-expert loop in plain PyTorch autograd (select each expert's tokens, SwiGLU,
    weighted index_add; the loop tests/test_moe_op.py checks the op against), float32;
  - `matmuls_fp32`: only the nine grouped matmuls of a SwiGLU forward + backward on rows already
    grouped by expert (no routing, gathers or activations): the floor for any implementation, so
    `loop_over_matmuls` bounds what `loop_over_op` can reach on this machine;
  - `op_bf16`: `OpRoutedExperts` (common/kernels/moe_module.py, the module training swaps in), bfloat16 matmuls;
  - `stock_bf16`: torchtitan's stock `RoutedExperts` (token dispatcher, `GroupedExperts` on
    `torch._grouped_mm` in bfloat16, combine), built from the same config the training script uses.
Ratios > 1 mean the op is faster: `loop_over_op` (float32), `stock_over_op` (bfloat16). Each sample
is the median of `--iters` calls; samples alternate in rounds, warm-up rounds dropped, medians reported.
`loop_over_matmuls` is what `loop_over_op` could reach if the op cost no more than its matmuls.

    python bench/bench_moe.py --out_dir runs/bench/moe                      # about 4 minutes on a 2-core machine
    python bench/bench_moe.py --preset tiny --out_dir runs/bench/moe_tiny   # seconds (tests)
(bfloat16 grouped matmuls are slow on CPUs without bf16 units.)

The printout ends with `loop_over_op` at 16 experts and the matmuls-alone bound beside it.
results.json: `rows` (one per expert count: medians in ms, ratios), `at_16_experts` (those two
ratios), `compared_with`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402

COMPARED_WITH = ("the per-expert loop (plain autograd, float32) = 1.00; above 1: the op is faster; the bound: "
                 "the loop over the nine grouped matmuls alone, no routing, gathers or activations")


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/moe", metadata={"help": "results.json goes here"})
    experts: str = field(default="8,16,32,64", metadata={"help": "comma-separated expert counts"})
    tokens: int = field(default=1024, metadata={"help": "tokens routed (batch x sequence)", **cli.bounds(1, 65536)})
    dim: int = field(default=256, metadata={
        "help": "model width (a multiple of 8 for torch._grouped_mm)",
        **cli.bounds(8, 8192, multiple_of=8, why="torch._grouped_mm needs 16-byte strides")})
    hidden: int = field(default=256, metadata={
        "help": "expert hidden size (a multiple of 8)",
        **cli.bounds(8, 8192, multiple_of=8, why="torch._grouped_mm needs 16-byte strides")})
    top_k: int = field(default=4, metadata={"help": "experts per token", **cli.bounds(1, 64)})
    repeats: int = field(default=3, metadata={"help": "alternating rounds measured per expert count",
                                              **cli.bounds(1, 100)})
    warmup: int = field(default=1, metadata={"help": "rounds run first and discarded", **cli.bounds(0, 100)})
    iters: int = field(default=3, metadata={"help": "calls per sample (the sample is their median)",
                                            **cli.bounds(1, 1000)})
    threads: int = field(default=1, metadata={"help": cb.THREADS_HELP, **cli.bounds(0, 1024)})
    seed: int = field(default=0, metadata={"help": "seed for weights and inputs", **cli.bounds(0, 2**32 - 1)})


def default() -> Config:
    """1024 tokens, dim 256, hidden 256, top_k 4, 8/16/32/64 experts, 3 rounds of 3 calls."""
    return Config()


def tiny() -> Config:
    """The CPU training preset's layer (dim 64, hidden 32), 256 tokens, 8 and 16 experts, 2 rounds of 2 calls."""
    return replace(Config(), experts="8,16", tokens=256, dim=64, hidden=32, repeats=2, warmup=1, iters=2)


PRESETS = {"default": default, "tiny": tiny}


def per_expert_loop(x, scores, ids, w1, w2, w3):
    """One expert at a time, plain autograd: what the op replaces."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.silu(x[tok] @ w1[e].t()) * (x[tok] @ w3[e].t())
        out = out.index_add(0, tok, (h @ w2[e].t()) * scores[tok, slot, None])
    return out


def routed_experts_config(cfg: Config, num_experts: int):
    """torchtitan's RoutedExperts config for this layer, from the same builder train_moe_nki.py uses."""
    sys.path.insert(0, str(cb.ROOT / "examples"))
    from train_moe_nki import TINY_MOE
    from common import checkpoint

    shape = {**TINY_MOE, "hidden_size": cfg.dim, "moe_intermediate_size": cfg.hidden, "num_hidden_layers": 1,
             "num_experts": num_experts, "num_experts_per_tok": cfg.top_k}
    spec = checkpoint.qwen3_spec_from_hf(shape, where="bench")
    return spec.model.layers[0].moe.routed_experts


def candidates(cfg: Config, num_experts: int, gen) -> dict:
    import torch
    import torch.nn.functional as F

    from common.kernels.moe_module import grouped_experts_op
    from common.kernels.moe_op import grouped_experts

    T, D, H, E, K = cfg.tokens, cfg.dim, cfg.hidden, num_experts, cfg.top_k
    x0 = torch.randn(T, D, generator=gen)
    w = {n: 0.05 * torch.randn(shape, generator=gen) for n, shape in
         (("w1", (E, H, D)), ("w2", (E, D, H)), ("w3", (E, H, D)))}
    logits = torch.randn(T, E, generator=gen)
    s0, ids = F.softmax(logits, -1).topk(K, -1)
    s0 = s0 / s0.sum(-1, keepdim=True)
    grad = torch.randn(T, D, generator=gen)
    counts = torch.bincount(ids.reshape(-1), minlength=E)

    rcfg = routed_experts_config(cfg, E)
    stock = rcfg.build()
    ours = grouped_experts_op(rcfg, compute_dtype="bfloat16").build()
    with torch.no_grad():
        for m in (stock, ours):
            m.inner_experts.w1_EFD.copy_(w["w1"])
            m.inner_experts.w2_EDF.copy_(w["w2"])
            m.inner_experts.w3_EFD.copy_(w["w3"])
    ours.eval()  # no expert-load counting inside the timing

    def leaves():
        return x0.clone().requires_grad_(), s0.clone().requires_grad_()

    def functional(fn):
        def call():
            x, s = leaves()
            ws = {n: t.clone().requires_grad_() for n, t in w.items()}
            fn(x, s, ids, ws["w1"], ws["w2"], ws["w3"]).backward(grad)
        return call

    def module(m):
        def call():
            x, s = leaves()
            for p in m.parameters():
                p.grad = None
            m(x.view(1, T, D), s.view(1, T, K), ids.view(1, T, K), counts).view(T, D).backward(grad)
        return call

    # The floor: the nine matmuls any grouped SwiGLU forward + backward does (three forward, two
    # per projection backward), on rows already grouped by expert, nothing else.
    order = torch.argsort(ids.reshape(-1), stable=True)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x0[order // K].contiguous()
    g_rows = torch.randn(T * K, D, generator=gen)

    def matmuls():
        w1t, w2t, w3t = (w[n].transpose(-2, -1) for n in ("w1", "w2", "w3"))
        h1, h3 = torch._grouped_mm(xs, w1t, offs=offs), torch._grouped_mm(xs, w3t, offs=offs)
        act = h1 * h3  # stands in for silu(h1) * h3: one elementwise pass
        torch._grouped_mm(act, w2t, offs=offs)
        torch._grouped_mm(g_rows.t(), act, offs=offs)  # dw2
        d_act = torch._grouped_mm(g_rows, w["w2"], offs=offs)
        torch._grouped_mm(d_act.t(), xs, offs=offs), torch._grouped_mm(d_act.t(), xs, offs=offs)  # dw1, dw3
        torch._grouped_mm(d_act, w["w1"], offs=offs), torch._grouped_mm(d_act, w["w3"], offs=offs)  # dx

    return {"op_fp32": functional(lambda *a: grouped_experts(*a, compute_dtype=torch.float32)[0]),
            "matmuls_fp32": matmuls,
            "loop_fp32": functional(per_expert_loop),
            "op_bf16": module(ours),
            "stock_bf16": module(stock)}


def main(cfg: Config) -> dict:
    import torch

    from common import device
    device.route_torchtitan_device("cpu")  # torchtitan's modules are built; no process group needed
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    threads = cb.set_threads(cfg.threads)
    try:
        counts = [int(e) for e in cfg.experts.split(",") if e]
    except ValueError:
        raise UserError(f"--experts takes comma-separated integers, got {cfg.experts!r}") from None
    if not counts or min(counts) < cfg.top_k:
        raise UserError(f"--experts must list counts of at least --top_k {cfg.top_k}")
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for E in counts:
        fns = candidates(cfg, E, gen)
        print(f"[bench] {E} experts", flush=True)
        samples = cb.alternate({n: (lambda f=f: cb.time_call(f, iters=cfg.iters)) for n, f in fns.items()},
                               repeats=cfg.repeats, warmup=cfg.warmup, log=None)
        med = {n: cb.summary(v) for n, v in samples.items()}
        rows.append({"experts": E, "tokens": cfg.tokens, "dim": cfg.dim, "hidden": cfg.hidden, "top_k": cfg.top_k,
                     **{f"{n}_ms": med[n]["median"] * 1e3 for n in fns},
                     "loop_over_op": cb.ratio(med["loop_fp32"]["median"], med["op_fp32"]["median"]),
                     "loop_over_matmuls": cb.ratio(med["loop_fp32"]["median"], med["matmuls_fp32"]["median"]),
                     "op_over_matmuls": cb.ratio(med["op_fp32"]["median"], med["matmuls_fp32"]["median"]),
                     "stock_over_op": cb.ratio(med["stock_bf16"]["median"], med["op_bf16"]["median"]),
                     "samples_s": {n: med[n]["samples"] for n in fns}})
    at16 = next((r["loop_over_op"] for r in rows if r["experts"] == 16), None)
    bound16 = next((r["loop_over_matmuls"] for r in rows if r["experts"] == 16), None)
    at_16 = {"loop_over_op": at16, "loop_over_matmuls": bound16}
    table = cb.format_table(rows, [("experts", "experts", ""), ("op_fp32_ms", "op fp32 ms", ".2f"),
                                   ("loop_fp32_ms", "loop fp32 ms", ".2f"), ("loop_over_op", "loop / op", ".2f"),
                                   ("matmuls_fp32_ms", "matmuls alone ms", ".2f"),
                                   ("loop_over_matmuls", "loop / matmuls (bound)", ".2f"),
                                   ("op_bf16_ms", "op bf16 ms", ".2f"), ("stock_bf16_ms", "stock MoE bf16 ms", ".2f"),
                                   ("stock_over_op", "stock / op", ".2f")])
    table += (f"\nshape: {cfg.tokens} tokens, dim {cfg.dim}, hidden {cfg.hidden}, top_k {cfg.top_k}; "
              "forward + backward")
    if at16 is not None:
        table += (f"\nloop / op {at16:.2f} at 16 experts; loop / matmuls-alone bound {bound16:.2f} "
                  f"({COMPARED_WITH})")
    return cb.write_call_bench(
        out_dir, "moe", cfg, threads, table, rows=rows, at_16_experts=at_16,
        baseline="per-expert loop (float32, plain autograd) and torchtitan's stock RoutedExperts (bfloat16 "
                 "torch._grouped_mm), same weights and routing",
        compared_with=f"loop_over_op, loop_over_matmuls: {COMPARED_WITH}; stock_over_op: torchtitan's stock "
                      "RoutedExperts in bfloat16 = 1.00")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
