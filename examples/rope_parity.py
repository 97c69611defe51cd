# Copy with this file the core (it checks the RoPE op):
#   common/__init__.py common/errors.py common/cli.py common/device.py common/paths.py common/results.py
#   common/checkpoint.py common/torchtitan_fixes.py
#   common/kernels/__init__.py common/kernels/rope_module.py common/kernels/rope_op.py
# and, for the Neuron stack's preflight before a Trainium run, from the harness:
#   common/harness/__init__.py common/harness/preflight.py
"""The AWS guide's kernel example: a custom RoPE kernel in torchtitan's Qwen3, checked against PyTorch.

The rotary embedding runs as a torch.library op with its own backward op (common/kernels/rope_op.py):
the wrapper turns torchtitan's [batch, seq, heads, head_dim] into the kernel's [batch, heads, seq,
head_dim] and back, the forward saves the rotation cache cat(cos, sin) and the backward op reuses
it, and the cache gets no gradient. On a Neuron device the op calls nki-library's `rope_hf`
kernel; elsewhere the same math in PyTorch. An `NKIRoPE` module (a CosSinRoPE subclass,
common/kernels/rope_module.py) is swapped in through torchtitan's override registry, one log line
per layer.

This script checks, with seeded inputs:
  1. the op against torchtitan's stock CosSinRoPE and against transformers' `apply_rotary_pos_emb`
     (with transformers' own Qwen3 rotary embedding for cos/sin): outputs and gradients of q and k,
     over grouped-query and multi-query heads, head_dim 64 and 128, sequences 256 and 512, batch > 1,
     a position offset and packed documents with per-sequence positions, in float32 and bfloat16;
  2. a tiny Qwen3 with NKIRoPE in the chosen layers against the stock model with the same weights:
     logits, loss and gradients, with and without packed-document positions.

    python examples/rope_parity.py --out_dir runs/rope_parity                      # CPU, every layer
    python examples/rope_parity.py --rope_layers '*layers.1.*'                     # one layer replaced
    python examples/rope_parity.py --seq_len 200 --lnc 2 --check_kernel_shape      # error: the NKI shape rule
    python examples/rope_parity.py --preset trn2        # one trn2 device (the stack preflight runs first)

Tolerances on the PyTorch path (CPU, CUDA). float32: 1e-6 absolute (the math is the same, so 0.0 is
expected; the AWS guide saw 0.0). bfloat16 against CosSinRoPE: the same 1e-6 (both compute in float32 and
round once). bfloat16 against transformers: transformers rounds cos and sin to bfloat16 and rounds each
product and the sum, about 5 roundings of at most 2^-9 relative each where ours rounds once; each output
element must be within 6 * 2^-9 * (|x_i| + |x_pair(i)|), the two inputs it mixes.
Tolerances on the NKI path (--preset trn2). rope_hf computes in the input dtype with cos/sin cast to it,
rounding each product and sum, so comparing its bfloat16 output with a float32-once reference at 1e-6 would
fail by construction. Its outputs and gradients are compared with `kernel_rounding_reference` (the kernel's
documented math, rounding where it rounds): each element within KERNEL_ROUNDINGS (3) ulps, i.e.
3 * eps(dtype) * (|x_i| + |x_pair(i)|), eps = 2^-7 in bfloat16, 2^-23 in float32 (0.0 expected with
round-to-nearest-even hardware); CosSinRoPE and transformers are then held to 5 eps (the kernel's 3 plus the
table's and the reference's own rounding); the tiny model's logits, loss and gradients to MODEL_KERNEL_TOL.
Max relative diff = max |ours - ref| / max |ref| (normwise: elementwise ratios explode near zero).

Expected on CPU (about 20 s): float32 and bfloat16 against CosSinRoPE 0.0; float32 against
transformers 0.0; model logits, loss and gradients 0.0; results.json with the per-dtype maxima,
`model_logits_max_abs_diff` and `replacements` (one FQN per replaced layer).
Expected on trn2 (not run by this project; minutes, most of it neuronx-cc compiling each shape once):
`kernel: nki rope_hf`, rows against `nki_kernel_rounding` with diffs 0 or a few ulps, passed=true.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import checkpoint, cli, device, paths  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.results import versions, write_results  # noqa: E402

# The installed stack's check before a Trainium run, where common/harness/ was copied with common/.
if importlib.util.find_spec("common.harness"):
    from common.harness import preflight
else:  # copied with the core alone: no stack check before the kernel runs
    preflight = None


FP32_TOL = 1e-6
BF16_ROUNDINGS = 6  # see the module docstring
KERNEL_ROUNDINGS = 3  # rope_hf rounds each output element 3 times: two products and their sum
KERNEL_VS_ONCE_ROUNDINGS = 5  # kernel's 3, plus its cos/sin table's and the float32-once reference's rounding
MODEL_KERNEL_TOL = 1e-4  # tiny Qwen3 on the NKI path, float32: a few ulps of RoPE carried through its layers


@dataclass
class Config:
    preset: str = "cpu"
    out_dir: str = field(default="runs/rope_parity", metadata={"help": "results.json goes here"})
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(
        default="auto", metadata={"help": "auto: neuron, then cuda, then cpu"})
    seed: int = field(default=0, metadata={"help": "seed for inputs and model weights", **cli.bounds(0, 2**32 - 1)})
    rope_layers: str = field(default="*", metadata={
        "help": "fnmatch glob on the RoPE module FQN: '*' every layer, '*layers.1.*' layer 1 only"})
    lnc: int = field(default=2, metadata={
        "help": "Trainium logical NeuronCore size; the kernel needs seq % (128 x LNC) == 0", **cli.bounds(1, 2)})
    check_kernel_shape: bool = field(default=False, metadata={
        "help": "enforce the NKI kernel's shape rule on any device (always on for neuron)"})
    seq_len: int = field(default=0, metadata={
        "help": "0: the preset's shapes (256 and 512); otherwise every shape and the model use this length",
        **cli.bounds(2, 2048, also=(0,), why="the tiny Qwen3 of the model check has 2048 positions")})
    model_batch: int = field(default=2, metadata={"help": "sequences in the tiny-model check", **cli.bounds(1, 1024)})

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        tokens = self.model_batch * (self.seq_len or 256)
        if tokens > 2048:  # measured on CPU: 7.5 GiB peak at 2048 tokens (8 x 256 or 1 x 2048), 2.9 GiB at 512
            raise UserError(f"--model_batch {self.model_batch} x --seq_len {self.seq_len or 256} is {tokens} tokens "
                            "for the tiny-model check, more than 2048 (about 3 MiB of memory a token: its logits over "
                            "the 151,936-token vocabulary, for both models, with their gradients)")


def cpu() -> Config:
    """CPU (or CUDA): the op's PyTorch path, kernel shape rule off unless asked."""
    return Config()


def trn2() -> Config:
    """One Trainium device: the NKI rope_hf kernel, LNC=2, shape rule enforced."""
    return replace(Config(), device="neuron", check_kernel_shape=True)


PRESETS = {"cpu": cpu, "trn2": trn2}

# (name, batch, seq, q_heads, kv_heads, head_dim, positions): positions "prefix" = none passed (the
# first seq rows of the cache), "offset" = start + arange(seq), "packed" = per-sequence documents.
SHAPES = [
    ("gqa_d128_s256", 2, 256, 8, 2, 128, "prefix"),
    ("mqa_d64_s512_offset", 2, 512, 4, 1, 64, "offset"),
    ("mha_d128_s512_packed", 3, 512, 4, 4, 128, "packed"),
    ("gqa_d64_s256_packed", 4, 256, 16, 8, 64, "packed"),
]
THETA = 1_000_000.0  # Qwen3's rope_theta
MAX_POS = 4096


def make_positions(kind: str, batch: int, seq: int, gen):
    import torch

    if kind == "prefix":
        return None
    if kind == "offset":
        start = int(torch.randint(1, MAX_POS - seq, (1,), generator=gen))
        return torch.arange(start, start + seq).unsqueeze(0)
    rows = []
    for _ in range(batch):  # 2 to 4 documents per row, restarting at 0, as torchtitan packs them
        cuts = sorted(torch.randint(1, seq, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist())
        bounds = [0, *cuts, seq]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(rows)


def diff(ours, ref) -> tuple[float, float]:
    d = (ours.float() - ref.float()).abs().max().item()
    return d, d / max(ref.float().abs().max().item(), 1e-30)


def bf16_bound(x):
    """Elementwise bound for transformers' bfloat16 math: inputs mixed into each output element."""
    h = x.shape[-1] // 2
    partner = x.float().abs().roll(h, dims=-1)
    return BF16_ROUNDINGS * 2.0 ** -9 * (x.float().abs() + partner)


def ulp_bound(x, roundings: int):
    """`roundings` ulps of x's dtype at the magnitude of the inputs each output element mixes."""
    import torch

    h = x.shape[-1] // 2
    return roundings * torch.finfo(x.dtype).eps * (x.float().abs() + x.float().abs().roll(h, dims=-1))


def kernel_rounding_reference(x, table, backward: bool):
    """rope_hf's documented math (nki-library core/embeddings/rope_hf.py, _apply_rope_single), rounding where
    the kernel rounds: cos and sin cast to x's dtype, every product and sum rounded to x's dtype (PyTorch rounds
    each elementwise op's result once, as the kernel's tensor_tensor writes do), h = head_dim / 2:
        forward   y1 = x1 * cos1 - x2 * sin1        y2 = x2 * cos2 + x1 * sin2
        backward  y1 = x1 * cos1 + x2 * sin2        y2 = x2 * cos2 - x1 * sin1
    x [batch, seq, heads, head_dim] (torchtitan's layout); table [seq, 2 * head_dim] or [batch, seq, 2 * head_dim]."""
    import torch

    d, h = x.shape[-1], x.shape[-1] // 2
    t = table.to(x.dtype)
    t = (t if t.dim() == 3 else t.unsqueeze(0)).unsqueeze(2)  # [batch or 1, seq, 1, 2d]
    cos, sin = t[..., :d], t[..., d:]
    x1, x2 = x[..., :h], x[..., h:]
    y = x * cos
    if backward:
        return torch.cat([y[..., :h] + x2 * sin[..., h:], y[..., h:] - x1 * sin[..., :h]], dim=-1)
    return torch.cat([y[..., :h] - x2 * sin[..., :h], y[..., h:] + x1 * sin[..., h:]], dim=-1)


def check_op(name, dtype, shape, lnc, check_kernel_shape, dev, gen) -> list[dict]:
    """The op (through NKIRoPE) against torchtitan's CosSinRoPE and transformers, forward + backward; on a
    Neuron device (the NKI kernel) also against the kernel's own rounding (see the module docstring)."""
    import torch
    from torchtitan.models.common.rope import CosSinRoPE
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    from common.kernels.rope_module import NKIRoPE

    _, b, s, hq, hkv, d, kind = shape
    positions = make_positions(kind, b, s, gen)
    q0 = torch.randn(b, s, hq, d, generator=gen).to(dtype)
    k0 = torch.randn(b, s, hkv, d, generator=gen).to(dtype)
    gq, gk = torch.randn(q0.shape, generator=gen).to(dtype), torch.randn(k0.shape, generator=gen).to(dtype)
    q0, k0, gq, gk = (t.to(dev) for t in (q0, k0, gq, gk))
    pos = positions.to(dev) if positions is not None else None

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qo, ko = fn(q, k)
        torch.autograd.backward((qo, ko), (gq, gk))
        return qo.detach(), ko.detach(), q.grad, k.grad

    rope_cfg = dict(dim=d, max_seq_len=MAX_POS, theta=THETA)
    ours_mod = NKIRoPE.Config(**rope_cfg, lnc=lnc, check_kernel_shape=check_kernel_shape).build().to(dev)
    stock_mod = CosSinRoPE.Config(**rope_cfg).build().to(dev)
    hf_rot = Qwen3RotaryEmbedding(Qwen3Config(head_dim=d, hidden_size=d * hq, num_attention_heads=hq,
                                              rope_theta=THETA, max_position_embeddings=MAX_POS)).to(dev)
    hf_pos = pos if pos is not None else torch.arange(s, device=dev).unsqueeze(0)

    def hf(q, k):  # transformers' layout is [batch, heads, seq, head_dim]
        cos, sin = hf_rot(q, hf_pos.expand(b, -1))
        qo, ko = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    ours = run(lambda q, k: ours_mod(q, k, pos))
    inputs = (q0, k0, gq, gk)
    nki = torch.device(dev).type == "neuron"
    refs = [("torchtitan_CosSinRoPE", run(lambda q, k: stock_mod(q, k, pos))),
            ("transformers_apply_rotary_pos_emb", run(hf))]
    if nki:  # the kernel's own rounding, from the table the op was given
        table = ours_mod.cache[:s] if pos is None else ours_mod.rows_for(pos)
        refs.append(("nki_kernel_rounding", tuple(kernel_rounding_reference(x.cpu(), table.cpu(), i >= 2).to(dev)
                                                  for i, x in enumerate(inputs))))  # computed on the host CPU
    rows = []
    for ref_name, ref in refs:
        fwd = [diff(o, r) for o, r in zip(ours[:2], ref[:2])]
        bwd = [diff(o, r) for o, r in zip(ours[2:], ref[2:])]
        if nki:
            ulps = KERNEL_ROUNDINGS if ref_name == "nki_kernel_rounding" else KERNEL_VS_ONCE_ROUNDINGS
            ok = all(bool(((o.float() - r.float()).abs() <= ulp_bound(x, ulps)).all())
                     for o, r, x in zip(ours, ref, inputs))
        elif dtype == torch.float32 or ref_name.startswith("torchtitan"):
            ok = max(x[0] for x in fwd + bwd) <= FP32_TOL
        else:
            ok = all(bool(((o.float() - r.float()).abs() <= bf16_bound(x) + 1e-30).all())
                     for o, r, x in zip(ours, ref, inputs))
        rows.append({"shape": name, "dtype": str(dtype).removeprefix("torch."), "reference": ref_name,
                     "batch": b, "seq": s, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "positions": kind,
                     "forward_max_abs_diff": max(x[0] for x in fwd), "forward_max_rel_diff": max(x[1] for x in fwd),
                     "backward_max_abs_diff": max(x[0] for x in bwd), "backward_max_rel_diff": max(x[1] for x in bwd),
                     "within_tolerance": ok})
    return rows


def replace_rope(cfg: Config) -> tuple:
    """Tiny Qwen3 configs (shape of the set-up asset): stock, and with NKIRoPE where --rope_layers
    says, through torchtitan's registry (the call the trainer makes; one log line per module)."""
    from torchtitan.config import apply_overrides
    from torchtitan.config.override import OverrideConfig
    from common import torchtitan_fixes
    from common.kernels import rope_module

    hf_cfg = checkpoint.read_hf_config(paths.asset_dir("tiny_qwen3"))
    stock_cfg = checkpoint.qwen3_spec_from_hf(hf_cfg, where="tiny-qwen3").model
    torchtitan_fixes.use_attention_backend(stock_cfg, "sdpa")
    ours_cfg = copy.deepcopy(stock_cfg)
    entry = rope_module.register(cfg.rope_layers)
    settings = {"lnc": cfg.lnc, "check_kernel_shape": cfg.check_kernel_shape}
    lines = apply_overrides(OverrideConfig(imports=[(entry, settings)]),
                            ours_cfg)
    if not lines:
        raise UserError(f"--rope_layers {cfg.rope_layers!r} matched no RoPE module; their names look like "
                        "layers.N.attention.rope (model_spec.model.layers.N.attention.rope in a training run), "
                        "so start the glob with '*', e.g. '*layers.1.*'")
    replaced = [line.split(": ", 1)[1].split(" ")[0] for line in lines]
    return stock_cfg, ours_cfg, hf_cfg["vocab_size"], {"replacements": replaced, "override_log": lines}


def check_model(cfg: Config, dev, seq: int, stock_cfg, ours_cfg, vocab: int) -> dict:
    """The stock tiny Qwen3 and the one with NKIRoPE, same weights: logits, loss, gradients."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        stock, ours = stock_cfg.build(), ours_cfg.build()
    for m in (stock, ours):
        m.to_empty(device=dev)
    with torch.no_grad():
        stock.init_states(buffer_device=dev)
        ours.init_states(buffer_device=dev)
        ours.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, vocab, (cfg.model_batch, seq + 1), generator=gen).to(dev)
    packed = make_positions("packed", cfg.model_batch, seq, gen).to(dev)
    out = {}
    for label, positions in (("", None), ("_packed", packed)):
        logits, losses, grads = [], [], []
        for m in (stock, ours):
            m._skip_lm_head = False
            m.zero_grad(set_to_none=True)
            masks = stock.get_attention_masks(positions=positions) if positions is not None else None
            lg = m(tokens[:, :-1], attention_masks=masks, positions=positions)
            loss = F.cross_entropy(lg.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            logits.append(lg.detach())
            losses.append(loss.item())
            grads.append({n: p.grad for n, p in m.named_parameters()})
        out[f"model{label}_logits_max_abs_diff"] = diff(logits[1], logits[0])[0]
        out[f"model{label}_loss"] = {"stock": losses[0], "nki_rope": losses[1]}
        out[f"model{label}_loss_abs_diff"] = abs(losses[1] - losses[0])
        out[f"model{label}_grad_max_abs_diff"] = max(diff(grads[1][n], g)[0] for n, g in grads[0].items())
    return out


def summarize(rows: list[dict], dtype: str, nki: bool) -> dict:
    mine = [r for r in rows if r["dtype"] == dtype]
    out = {k: max(r[k] for r in mine) for k in ("forward_max_abs_diff", "forward_max_rel_diff",
                                                 "backward_max_abs_diff", "backward_max_rel_diff")}
    for ref in sorted({r["reference"] for r in mine}):
        out[ref] = {k: max(r[k] for r in mine if r["reference"] == ref)
                    for k in ("forward_max_abs_diff", "backward_max_abs_diff")}
    if nki:
        out["tolerance"] = (f"|diff| <= {KERNEL_ROUNDINGS} * eps({dtype}) * (|x_i| + |x_pair(i)|) vs the kernel's "
                            f"rounding; {KERNEL_VS_ONCE_ROUNDINGS} * eps vs CosSinRoPE and transformers")
    else:
        out["tolerance"] = (f"{FP32_TOL:g} abs" if dtype == "float32" else
                            f"{FP32_TOL:g} abs vs CosSinRoPE; vs transformers |diff| <= "
                            f"{BF16_ROUNDINGS} * 2^-9 * (|x_i| + |x_pair(i)|) elementwise")
    out["passed"] = all(r["within_tolerance"] for r in mine)
    return out


def main(cfg: Config) -> dict:
    from common.kernels.rope_op import NKI_LAUNCH, check_kernel_rule

    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    paths.asset_dir("tiny_qwen3")  # fail fast if set-up has not run
    neuron = cfg.device == "neuron" or (cfg.device == "auto" and device.neuron_installed())
    if neuron and preflight is not None:  # the Neuron stack, before the process group and the runtime start
        preflight.require_stack("trn2", "rope", wrap_nki=NKI_LAUNCH == "wrap_nki")
    if neuron or cfg.check_kernel_shape:  # the kernel's shape rule for every shape this run will rotate
        for shape in SHAPES:
            check_kernel_rule(cfg.seq_len or shape[2], shape[5], cfg.lnc)
    dev_info = device.setup(cfg.device, lnc=cfg.lnc)
    try:
        return run(cfg, dev_info, out_dir)
    finally:
        device.teardown()


def run(cfg: Config, dev_info, out_dir: Path) -> dict:
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()  # torchtitan's [Override] lines
    print(f"[config] {cli.format_config(cfg)}")
    dev = dev_info.device
    t0 = time.perf_counter()
    stock_cfg, ours_cfg, vocab, replaced = replace_rope(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    shapes = [s if not cfg.seq_len else (f"{s[0]}_as_s{cfg.seq_len}", s[1], cfg.seq_len, *s[3:]) for s in SHAPES]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            for r in check_op(shape[0], dtype, shape, cfg.lnc, cfg.check_kernel_shape, dev, gen):
                rows.append(r)
                print(f"[op] {r['dtype']:8s} {r['shape']:26s} vs {r['reference']:34s} "
                      f"fwd {r['forward_max_abs_diff']:.3g} bwd {r['backward_max_abs_diff']:.3g}"
                      f"{'' if r['within_tolerance'] else '  OUTSIDE TOLERANCE'}")
    model = {**replaced, **check_model(cfg, dev, cfg.seq_len or 256, stock_cfg, ours_cfg, vocab)}
    print(f"[model] {len(model['replacements'])} layer(s) replaced; logits max abs diff "
          f"{model['model_logits_max_abs_diff']:.3g} (packed {model['model_packed_logits_max_abs_diff']:.3g}); "
          f"loss {model['model_loss']['stock']:.6f} vs {model['model_loss']['nki_rope']:.6f}; "
          f"grads max abs diff {model['model_grad_max_abs_diff']:.3g}")
    nki = dev_info.device_type == "neuron"
    model_tol = MODEL_KERNEL_TOL if nki else FP32_TOL
    model_ok = max(model[k] for k in ("model_logits_max_abs_diff", "model_packed_logits_max_abs_diff",
                                      "model_loss_abs_diff", "model_packed_loss_abs_diff",
                                      "model_grad_max_abs_diff", "model_packed_grad_max_abs_diff")) <= model_tol
    results = {"script": "rope_parity.py", "config": cfg, "versions": versions(),
               "device": dev_info.device_type, "kernel": "nki rope_hf" if nki else "pytorch",
               "float32": summarize(rows, "float32", nki), "bfloat16": summarize(rows, "bfloat16", nki),
               "model_tolerance": model_tol,
               **model, "model_passed": model_ok, "cases": rows, "seconds": time.perf_counter() - t0}
    results["passed"] = results["float32"]["passed"] and results["bfloat16"]["passed"] and model_ok
    path = write_results(out_dir, results)
    f32, bf16 = results["float32"], results["bfloat16"]
    print(f"[done] float32 fwd {f32['forward_max_abs_diff']:.3g} bwd {f32['backward_max_abs_diff']:.3g}; "
          f"bfloat16 fwd {bf16['forward_max_abs_diff']:.3g} bwd {bf16['backward_max_abs_diff']:.3g}; "
          f"passed={results['passed']}; {path}")
    if not results["passed"]:
        raise UserError(f"parity outside tolerance; see the cases marked within_tolerance=false in {path}")
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="cpu"))
