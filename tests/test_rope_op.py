"""common/kernels/rope_op.py: op registration (opcheck), gradients, parity with torchtitan and transformers; the
Trainium branch's layout around the kernel call, its launch (grid / LNC) and set_neuron_env, on CPU."""
from __future__ import annotations

import os

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.models.common.rope import CosSinRoPE  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb  # noqa: E402

from common.errors import UserError  # noqa: E402
from common.kernels.rope_op import rope  # noqa: E402

THETA = 1_000_000.0  # Qwen3's rope_theta
MAX_SEQ_LEN = 1024  # room for offset 37 + seq 512
BATCH, Q_HEADS, KV_HEADS = 2, 8, 2  # grouped-query attention


def _inputs(seq, head_dim, dtype, seed=0, q_heads=Q_HEADS, kv_heads=KV_HEADS, batch=BATCH):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(dtype)
    dq = torch.randn(batch, seq, q_heads, head_dim, generator=g).to(dtype)  # upstream gradients
    dk = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, dq, dk


def _cache(seq, head_dim, dtype=torch.float32):
    cos_sin = CosSinRoPE(CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=THETA)).cache
    return cos_sin.to(dtype)


def _run(fn, q, k, dq, dk):
    """Forward and backward of fn(q, k) -> (q_out, k_out) with upstream gradients dq, dk."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    q_out, k_out = fn(q, k)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    return q_out.detach(), k_out.detach(), q.grad, k.grad


def _max_abs(ours, ref):
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, ref))


@pytest.mark.parametrize("dense", [True, False], ids=["kernel_layout", "permuted_views"])
def test_opcheck(dense):
    """Registration, fake impl and autograd, on dense [b, h, s, d] tensors (what the kernel gets) and
    on [b, h, s, d] views of [b, s, h, d] tensors (what `rope()` hands the PyTorch path): outputs
    keep the inputs' strides, as the fake impl says."""
    q, k, dq, dk = (t.transpose(1, 2) for t in _inputs(8, 16, torch.float32, q_heads=4, kv_heads=2))
    if dense:
        q, k, dq, dk = (t.contiguous() for t in (q, k, dq, dk))
    cache = _cache(8, 16)
    torch.library.opcheck(torch.ops.qwen3_recipes.rope_fwd.default,
                          (q.requires_grad_(), k.requires_grad_(), cache, 2))
    torch.library.opcheck(torch.ops.qwen3_recipes.rope_bwd.default, (dq, dk, cache, 2))
    out_q, _ = torch.ops.qwen3_recipes.rope_fwd(q, k, cache, 2)
    assert out_q.stride() == q.stride()


def test_gradcheck_float64():
    q, k, _, _ = _inputs(6, 8, torch.float64, q_heads=2, kv_heads=1, batch=1)
    cache = _cache(6, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, cache),
                                    (q.requires_grad_(), k.requires_grad_()))


def test_cache_gets_no_gradient():
    q, k, dq, dk = _inputs(8, 16, torch.float32)
    cache = _cache(8, 16).requires_grad_()
    _run(lambda q, k: rope(q, k, cache), q, k, dq, dk)
    assert cache.grad is None


# bf16 tolerances. torchtitan computes in float32 and rounds once to bf16, as this op's PyTorch
# path does, so the two agree exactly (0.0). HF's apply_rotary_pos_emb computes in bf16 with bf16
# cos/sin (Qwen3RotaryEmbedding casts them to the activations' dtype), so each product and the sum
# are rounded: a few bf16 roundings, each at most half an ulp of the output's magnitude. With
# randn inputs the outputs stay below 8 in magnitude, where one bf16 ulp is 2**-5 = 0.03125;
# we allow two ulps there.
BF16_TOL = {"torchtitan": 0.0, "transformers": 2 * 2.0**-5}
FP32_TOL = 1e-6  # 0.0 expected: the float32 math is the same sequence of operations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq", [256, 512])
@pytest.mark.parametrize("start", [0, 37])
def test_parity_with_torchtitan_and_transformers(dtype, head_dim, seq, start, record_property):
    q, k, dq, dk = _inputs(seq, head_dim, dtype, seed=seq + head_dim + start)
    stock = CosSinRoPE(CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ_LEN, theta=THETA))
    # As torchtitan's attention calls it: rope(xq, xk, positions), positions [batch, seq] or None.
    positions = None if start == 0 else torch.arange(start, start + seq).expand(BATCH, seq)
    cache = stock.cache[start:start + seq]  # the caller slices the rows for its positions

    ours = _run(lambda q, k: rope(q, k, cache, lnc=2, check_kernel_shape=True), q, k, dq, dk)
    titan = _run(lambda q, k: stock(q, k, positions), q, k, dq, dk)

    # transformers: q/k [b, h, s, d], cos/sin [b, s, d] in the activations' dtype.
    cos = cache[:, :head_dim].expand(BATCH, seq, head_dim).to(dtype)
    sin = cache[:, head_dim:].expand(BATCH, seq, head_dim).to(dtype)

    def hf(q, k):
        q_out, k_out = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    ref_hf = _run(hf, q, k, dq, dk)

    for t in ours:
        assert t.dtype == dtype
    diff_titan, diff_hf = _max_abs(ours, titan), _max_abs(ours, ref_hf)
    record_property("max_abs_diff", {"torchtitan": diff_titan, "transformers": diff_hf})
    print(f"{dtype} d={head_dim} s={seq} start={start}: torchtitan {diff_titan:.3g}, transformers {diff_hf:.3g}")
    if dtype == torch.float32:
        assert diff_titan <= FP32_TOL and diff_hf <= FP32_TOL
    else:
        assert diff_titan <= BF16_TOL["torchtitan"]
        assert diff_hf <= BF16_TOL["transformers"]
        assert max(t.abs().max().item() for t in ours) < 8  # the magnitude BF16_TOL is sized for


def test_torch_compile_fullgraph():
    q, k, dq, dk = _inputs(16, 32, torch.float32)
    cache = _cache(16, 32)
    compiled = torch.compile(lambda q, k: rope(q, k, cache), backend="aot_eager", fullgraph=True)
    got, want = _run(compiled, q, k, dq, dk), _run(lambda q, k: rope(q, k, cache), q, k, dq, dk)
    assert _max_abs(got, want) == 0.0


def test_kernel_seq_len_rule():
    q, k, _, _ = _inputs(200, 64, torch.float32)
    with pytest.raises(UserError, match=r"sequence length 200 .* 128 x LNC = 256"):
        rope(q, k, _cache(200, 64), lnc=2, check_kernel_shape=True)
    rope(q, k, _cache(200, 64), lnc=2)  # not checked off Trainium unless asked
    q, k, _, _ = _inputs(256, 64, torch.float32)
    rope(q, k, _cache(256, 64), lnc=2, check_kernel_shape=True)


@pytest.mark.parametrize("head_dim, cache_shape, kernel_shape, match", [
    (7, (8, 14), False, "head_dim 7 is odd"),
    (160, (256, 320), True, "head_dim 160 is larger than 128"),
    (16, (8, 16), False, r"expected \[seq, head_dim \* 2\] = \[8, 32\]"),
    (16, (9, 32), False, "rope_cache has 9 rows but the sequence has 8 positions"),
])
def test_shape_errors(head_dim, cache_shape, kernel_shape, match):
    seq = 256 if kernel_shape else 8
    q, k, _, _ = _inputs(seq, head_dim, torch.float32)
    with pytest.raises(UserError, match=match):
        rope(q, k, torch.zeros(cache_shape), check_kernel_shape=kernel_shape)


def test_per_sequence_tables():
    """A [batch, seq, 2d] cache (packed documents: positions per sequence) rotates each sequence
    with its own rows, exactly as CosSinRoPE does with per-sequence positions; opcheck included."""
    q, k, dq, dk = _inputs(16, 32, torch.float32, batch=3)
    stock = CosSinRoPE(CosSinRoPE.Config(dim=32, max_seq_len=64, theta=THETA))
    positions = torch.stack([torch.arange(16), torch.arange(5, 21), torch.cat([torch.arange(9), torch.arange(7)])])
    ours = _run(lambda q, k: rope(q, k, stock.cache[positions]), q, k, dq, dk)
    titan = _run(lambda q, k: stock(q, k, positions), q, k, dq, dk)
    assert _max_abs(ours, titan) == 0.0
    qk = [t.transpose(1, 2).contiguous() for t in (q, k)]
    torch.library.opcheck(torch.ops.qwen3_recipes.rope_fwd.default,
                          (qk[0].requires_grad_(), qk[1].requires_grad_(), stock.cache[positions], 2))
    with pytest.raises(UserError, match="tables for 2 sequences but the batch has 3"):
        rope(q, k, stock.cache[positions[:2]])


# --- The Trainium branch's layout and launch, on CPU -------------------------------------------------------------
# A PyTorch stand-in replaces rope_hf: the kernel's documented math with its rounding (rope_parity.py's
# kernel_rounding_reference), returning new tensors and leaving the q_out/k_out buffers untouched, as NKI V2 does.

def _stand_in(calls):
    from rope_parity import kernel_rounding_reference  # examples/ is on sys.path (conftest)

    def rope_hf(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
        assert q.is_contiguous() and k.is_contiguous() and rope_cache.is_contiguous()
        assert rope_cache.dtype == q.dtype and cos is None and sin is None
        calls.append(tuple(rope_cache.shape))
        return tuple(kernel_rounding_reference(x.transpose(1, 2), rope_cache, backward).transpose(1, 2).contiguous()
                     for x in (q, k))
    return rope_hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batched", [False, True], ids=["one_table", "table_per_sequence"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_kernel_call_layout(dtype, batched, backward):
    """rope_kernel_call: one kernel call per batch (a [batch, seq, 2d] table included), the returned tensors
    used (not the buffers passed in), results in the caller's strides, equal to the PyTorch path within the
    kernel's rounding (3 ulps at the mixed inputs' magnitude; exact in float32 here)."""
    from common.kernels.rope_op import _rope_torch, rope_kernel_call

    q, k, _, _ = _inputs(16, 32, dtype, batch=3)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, h, s, d] views of [b, s, h, d], as rope() hands them over
    stock = CosSinRoPE(CosSinRoPE.Config(dim=32, max_seq_len=64, theta=THETA))
    table = stock.cache[torch.stack([torch.arange(16), torch.arange(5, 21), torch.arange(16)])] if batched \
        else stock.cache[:16]
    calls = []
    got = rope_kernel_call(_stand_in(calls), q, k, table, backward)
    want = _rope_torch(q, k, table, 2, backward)
    assert calls == [tuple(table.shape)]
    for g, w, x in zip(got, want, (q, k)):
        assert g.stride() == x.stride() and g.dtype == dtype
        bound = 3 * torch.finfo(dtype).eps * (x.float().abs() + x.float().abs().roll(16, dims=-1))
        assert ((g.float() - w.float()).abs() <= bound).all()
        if dtype == torch.float32:
            assert torch.equal(g, w)


def test_launch_nki_grid_and_lnc(monkeypatch):
    """kernel[lnc] before nki 0.7.0 (Neuron 2.33) or when NEURON_LOGICAL_NC_CONFIG is unset; the plain call when
    the variable sets the LNC on 2.33; a variable that disagrees with --lnc is one clear error (NCC_EVRF066)."""
    from common.kernels import rope_op

    class Kernel:
        def __getitem__(self, lnc):
            return ("grid", lnc)

    kernel = Kernel()
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setattr(rope_op, "_nki_version", lambda: (0, 7))
    assert rope_op.launch_nki(kernel, 2) == ("grid", 2)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert rope_op.launch_nki(kernel, 2) is kernel
    for older in ((0, 6), None):
        monkeypatch.setattr(rope_op, "_nki_version", lambda v=older: v)
        assert rope_op.launch_nki(kernel, 2) == ("grid", 2)
    with pytest.raises(UserError, match="LNC=1 but NEURON_LOGICAL_NC_CONFIG=2"):
        rope_op.launch_nki(kernel, 1)


def test_set_neuron_env(monkeypatch):
    """The Neuron settings come from config fields, in one place (common/device.py), and are returned to log."""
    for var in ("NEURON_LOGICAL_NC_CONFIG", "TORCH_NEURONX_NEFF_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    env = device.set_neuron_env(2, "/tmp/neff")
    assert env == {"NEURON_LOGICAL_NC_CONFIG": "2", "TORCH_NEURONX_NEFF_CACHE_DIR": "/tmp/neff"}
    assert {k: os.environ[k] for k in env} == env
