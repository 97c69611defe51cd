"""Time of the RoPE op against torchtitan's stock CosSinRoPE and transformers'
`apply_rotary_pos_emb`, forward + backward, several shapes, measured side by side.

What is timed, per call: q and k (leaves, requires_grad) rotated, then one backward with fixed
output gradients. Candidates:
  - `op`: NKIRoPE (common/kernels/rope_module.py), the module training uses, running the
    `qwen3_recipes::rope_fwd`/`rope_bwd` custom ops (on CPU, their PyTorch path);
  - `op_first_layer`: the same, with the rows for per-token positions computed in the call, as
    in the first layer of a forward (`op` reuses them, as layers 2..N do: the same positions
    tensor reaches every layer); equal to `op` for prefix positions;
  - `cossin`: torchtitan's stock `CosSinRoPE` with the same cache (the baseline of `cossin_over_op`);
  - `hf`: transformers' `apply_rotary_pos_emb`, on q and k in transformers' own layout
    ([batch, heads, seq, head_dim] views, as Qwen3Attention hands them), with cos/sin computed once
    outside the timing (transformers computes them once per model forward, for all layers).
Positions as in examples/rope_parity.py: `prefix` (none passed), `offset` and `packed` (per-sequence
documents restarting at 0). Each sample is the median of `--iters` calls; samples alternate between
candidates in rounds (order reversed every other round), warm-up rounds dropped, medians reported.
Ratios > 1 mean the op is faster: `cossin_over_op` = median(cossin) / median(op), compared with
torchtitan's stock CosSinRoPE on the same inputs (= 1.00); `hf_over_op` likewise for transformers.

    python bench/bench_rope.py --out_dir runs/bench/rope                      # ~1.5 minutes on a busy 2-core machine
    python bench/bench_rope.py --preset tiny --out_dir runs/bench/rope_tiny   # seconds (tests)

The printout ends with the lowest float32 `cossin_over_op` over the shapes, in layers 2..N and in
the first layer of a forward.
results.json: `rows` (one per shape and dtype: medians in ms, ratios), `lowest` (those lowest ratios),
`compared_with`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402

# (name, batch, seq, q_heads, kv_heads, head_dim, positions): rope_parity.py's shapes and one
# Qwen3-4B layer (32 query heads, 8 KV heads, head_dim 128) at 2048 tokens.
SHAPES = [
    ("gqa_d128_s256", 2, 256, 8, 2, 128, "prefix"),
    ("mqa_d64_s512_offset", 2, 512, 4, 1, 64, "offset"),
    ("mha_d128_s512_packed", 3, 512, 4, 4, 128, "packed"),
    ("gqa_d64_s256_packed", 4, 256, 16, 8, 64, "packed"),
    ("qwen3_4b_layer_s2048", 1, 2048, 32, 8, 128, "prefix"),
]
TINY_SHAPES = [("tiny_gqa_d64_s128", 1, 128, 4, 2, 64, "packed")]
THETA, MAX_POS = 1_000_000.0, 4096
COMPARED_WITH = "torchtitan's stock CosSinRoPE, forward + backward on the same inputs = 1.00; above 1: the op is faster"


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/rope", metadata={"help": "results.json goes here"})
    shapes: str = field(default="all", metadata={"help": "'all', 'tiny', or comma-separated shape names"})
    dtypes: str = field(default="float32,bfloat16", metadata={"help": "comma-separated: float32, bfloat16"})
    repeats: int = field(default=5, metadata={"help": "alternating rounds measured per shape", **cli.bounds(1, 100)})
    warmup: int = field(default=1, metadata={"help": "rounds run first and discarded", **cli.bounds(0, 100)})
    iters: int = field(default=5, metadata={"help": "calls per sample (the sample is their median)",
                                            **cli.bounds(1, 1000)})
    threads: int = field(default=1, metadata={"help": cb.THREADS_HELP, **cli.bounds(0, 1024)})
    seed: int = field(default=0, metadata={"help": "seed for inputs", **cli.bounds(0, 2**32 - 1)})


def default() -> Config:
    """Five shapes, float32 and bfloat16, 5 rounds of 5 calls (about 1.5 minutes on a busy 2-core machine)."""
    return Config()


def tiny() -> Config:
    """One small shape, float32, 2 rounds of 2 calls: checks the harness in seconds."""
    return replace(Config(), shapes="tiny", dtypes="float32", repeats=2, warmup=1, iters=2)


PRESETS = {"default": default, "tiny": tiny}


def pick_shapes(spec: str) -> list[tuple]:
    if spec == "all":
        return SHAPES
    if spec == "tiny":
        return TINY_SHAPES
    known = {s[0]: s for s in SHAPES + TINY_SHAPES}
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"unknown shape(s) {unknown}; choose from {sorted(known)}")
    return [known[n] for n in names]


def candidates(shape, dtype, gen) -> dict:
    """The three fwd+bwd callables on the same inputs."""
    import torch
    from torchtitan.models.common.rope import CosSinRoPE
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    sys.path.insert(0, str(cb.ROOT / "examples"))
    from rope_parity import make_positions  # the parity check's position kinds, not a copy
    from common.kernels import rope_module
    from common.kernels.rope_module import NKIRoPE

    _, b, s, hq, hkv, d, kind = shape
    pos = make_positions(kind, b, s, gen)
    q0 = torch.randn(b, s, hq, d, generator=gen).to(dtype)
    k0 = torch.randn(b, s, hkv, d, generator=gen).to(dtype)
    gq, gk = torch.randn(q0.shape, generator=gen).to(dtype), torch.randn(k0.shape, generator=gen).to(dtype)
    rope_cfg = dict(dim=d, max_seq_len=MAX_POS, theta=THETA)
    ours, stock = NKIRoPE.Config(**rope_cfg).build(), CosSinRoPE.Config(**rope_cfg).build()
    hf_rot = Qwen3RotaryEmbedding(Qwen3Config(head_dim=d, hidden_size=d * hq, num_attention_heads=hq,
                                              rope_theta=THETA, max_position_embeddings=MAX_POS))
    hf_pos = pos if pos is not None else torch.arange(s).unsqueeze(0)
    with torch.no_grad():
        cos, sin = hf_rot(q0, hf_pos.expand(b, -1))
    gq_hf, gk_hf = gq.transpose(1, 2), gk.transpose(1, 2)

    def fwd_bwd(fn, grads):
        def call():
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            qo, ko = fn(q, k)
            torch.autograd.backward((qo, ko), grads)
        return call

    def hf(q, k):  # Qwen3Attention's layout: [b, s, h, d] -> view transposed to [b, h, s, d]
        return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

    def first_layer(q, k):  # the rows for per-token positions computed, as in a forward's first layer
        rope_module.clear_rows_cache()
        return ours(q, k, pos)

    return {"op": fwd_bwd(lambda q, k: ours(q, k, pos), (gq, gk)),
            "op_first_layer": fwd_bwd(first_layer, (gq, gk)),
            "cossin": fwd_bwd(lambda q, k: stock(q, k, pos), (gq, gk)),
            "hf": fwd_bwd(hf, (gq_hf, gk_hf))}


def main(cfg: Config) -> dict:
    import torch

    from common import device
    device.route_torchtitan_device("cpu")  # torchtitan is imported for CosSinRoPE; no process group needed
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    threads = cb.set_threads(cfg.threads)
    shapes = pick_shapes(cfg.shapes)
    dtypes = [d for d in cfg.dtypes.split(",") if d]
    if any(d not in ("float32", "bfloat16") for d in dtypes):
        raise UserError(f"--dtypes takes float32 and/or bfloat16, got {cfg.dtypes!r}")
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for dtype_name in dtypes:
        for shape in shapes:
            fns = candidates(shape, getattr(torch, dtype_name), gen)
            print(f"[bench] {shape[0]} {dtype_name}", flush=True)
            samples = cb.alternate({n: (lambda f=f: cb.time_call(f, iters=cfg.iters)) for n, f in fns.items()},
                                   repeats=cfg.repeats, warmup=cfg.warmup, log=None)
            med = {n: cb.summary(v) for n, v in samples.items()}
            _, b, s, hq, hkv, d, kind = shape
            rows.append({"shape": shape[0], "dtype": dtype_name, "batch": b, "seq": s, "q_heads": hq,
                         "kv_heads": hkv, "head_dim": d, "positions": kind,
                         **{f"{n}_ms": med[n]["median"] * 1e3 for n in fns},
                         "cossin_over_op": cb.ratio(med["cossin"]["median"], med["op"]["median"]),
                         "cossin_over_op_first_layer": cb.ratio(med["cossin"]["median"],
                                                                med["op_first_layer"]["median"]),
                         "hf_over_op": cb.ratio(med["hf"]["median"], med["op"]["median"]),
                         "samples_s": {n: med[n]["samples"] for n in fns}})
    fp32 = [r["cossin_over_op"] for r in rows if r["dtype"] == "float32"]
    first = [r["cossin_over_op_first_layer"] for r in rows if r["dtype"] == "float32"]
    lowest = {"cossin_over_op_float32": min(fp32) if fp32 else None,
              "cossin_over_op_first_layer_float32": min(first) if first else None}
    table = cb.format_table(rows, [("shape", "shape", ""), ("dtype", "dtype", ""), ("positions", "positions", ""),
                                   ("op_ms", "op ms", ".3f"), ("op_first_layer_ms", "op 1st layer ms", ".3f"),
                                   ("cossin_ms", "CosSinRoPE ms", ".3f"),
                                   ("hf_ms", "HF apply_rotary ms", ".3f"),
                                   ("cossin_over_op", "CosSinRoPE / op", ".2f"), ("hf_over_op", "HF / op", ".2f")])
    if fp32:
        table += (f"\nCosSinRoPE / op, float32, lowest over the shapes: {lowest['cossin_over_op_float32']:.2f}; "
                  f"in the first layer of a forward (rows computed): "
                  f"{lowest['cossin_over_op_first_layer_float32']:.2f} ({COMPARED_WITH})")
    return cb.write_call_bench(
        out_dir, "rope", cfg, threads, table, rows=rows, lowest=lowest,
        baseline="torchtitan CosSinRoPE and transformers apply_rotary_pos_emb, same inputs, forward + backward, "
                 "alternating rounds",
        compared_with=f"cossin_over_op: {COMPARED_WITH}; hf_over_op: transformers' apply_rotary_pos_emb on the "
                      "same inputs = 1.00")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
