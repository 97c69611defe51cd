"""examples/rope_parity.py and common/kernels/rope_module.py: NKIRoPE through torchtitan's override registry.

Shows: float32 forward/backward max abs diff <= 1e-6 against torchtitan's CosSinRoPE and transformers'
apply_rotary_pos_emb, bfloat16 within the stated bound; the tiny Qwen3 with the op in every layer gives the
stock logits; `--rope_layers '*layers.1.*'` replaces exactly one layer and the log says so; sequence length 200
at LNC=2 with the check on is one clear error; the reference the trn2 preset holds the NKI kernel to rounds as
the kernel does (bit-equal to transformers' bfloat16 math).
"""
from __future__ import annotations

import re

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.config import apply_overrides  # noqa: E402
from torchtitan.config.override import OverrideConfig  # noqa: E402
from torchtitan.models.common.rope import CosSinRoPE  # noqa: E402

from common import checkpoint  # noqa: E402
from common.kernels import rope_module  # noqa: E402
from tools.prepare_assets import TINY_QWEN3_CONFIG  # noqa: E402
from conftest import assert_clean_error, read_results, run_example, run_in_process  # noqa: E402

OVERRIDE_LINE = re.compile(r"\[Override\] common\.kernels\.rope_module\.nki_rope\w*: (\S+) CosSinRoPE\.Config -> NKIRoPE\.Config")


def test_rows_for_positions_equal_the_cache_rows():
    """NKIRoPE computes rows for per-token positions instead of gathering them: same values."""
    mod = rope_module.NKIRoPE.Config(dim=128, max_seq_len=4096, theta=1e6).build()
    positions = torch.stack([torch.arange(7, 519), torch.cat([torch.arange(300), torch.arange(212)])])
    assert torch.equal(mod.rows_for(positions), mod.cache[positions])


def test_rows_are_computed_once_per_forward_and_never_stale():
    """Layers 2..N of a forward reuse the rows the first layer computed for the same positions
    tensor; another tensor, an in-place change or other RoPE settings compute them anew."""
    a, b = (rope_module.NKIRoPE.Config(dim=64, max_seq_len=1024, theta=1e6).build() for _ in range(2))
    other = rope_module.NKIRoPE.Config(dim=64, max_seq_len=1024, theta=1e4).build()
    positions = torch.cat([torch.arange(100), torch.arange(28)])[None]
    rope_module.clear_rows_cache()
    first = a._rows_once_per_forward(positions)
    assert b._rows_once_per_forward(positions) is first  # the next layer: no recompute
    equal_copy = positions.clone()
    assert b._rows_once_per_forward(equal_copy) is not first  # a new tensor (the next step's)
    assert torch.equal(b._rows_once_per_forward(equal_copy), first)
    assert not torch.equal(other._rows_once_per_forward(equal_copy), first)  # other theta
    equal_copy[0, 5:] += 3  # in place
    assert torch.equal(a._rows_once_per_forward(equal_copy), a.cache[equal_copy])


def test_nki_rope_module_matches_cosine_sine_rope():
    stock = CosSinRoPE.Config(dim=64, max_seq_len=1024, theta=1e6).build()
    ours = rope_module.NKIRoPE.Config(dim=64, max_seq_len=1024, theta=1e6).build()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 256, 4, 64, generator=g), torch.randn(2, 256, 2, 64, generator=g)
    for positions in (None, torch.arange(100, 356)[None], torch.arange(256).expand(2, -1)):
        for a, b in zip(ours(q, k, positions), stock(q, k, positions)):
            assert torch.equal(a, b)


def test_registry_replaces_the_chosen_layers():
    """The model config as root (as torchtitan's RL trainer applies overrides): default every layer."""
    tiny = {"architectures": list(checkpoint.QWEN3_DENSE), **TINY_QWEN3_CONFIG, "num_hidden_layers": 4}
    cfg = checkpoint.qwen3_spec_from_hf(tiny).model
    lines = apply_overrides(OverrideConfig(imports=[rope_module.register()]), cfg)
    assert [OVERRIDE_LINE.search(x).group(1) for x in lines] == [f"layers.{i}.attention.rope" for i in range(4)]
    assert all(type(layer.attention.rope) is rope_module.NKIRoPE.Config for layer in cfg.layers)


def _override_lines(proc) -> list[str]:
    return [m.group(1) for m in OVERRIDE_LINE.finditer(proc.stdout + proc.stderr)]


def test_rope_parity_default_every_layer(tmp_path, prepared_assets):
    proc = run_example("rope_parity.py", "--out_dir", str(tmp_path))
    r = read_results(tmp_path)
    for dtype in ("float32", "bfloat16"):
        assert r[dtype]["passed"], r[dtype]
        for key in ("forward_max_abs_diff", "backward_max_abs_diff"):
            assert r[dtype][key] >= 0.0
            assert r[dtype]["torchtitan_CosSinRoPE"][key] <= 1e-6
    assert r["float32"]["forward_max_abs_diff"] <= 1e-6 and r["float32"]["backward_max_abs_diff"] <= 1e-6
    shapes = {(c["head_dim"], c["seq"], c["positions"]) for c in r["cases"]}
    assert {64, 128} <= {s[0] for s in shapes} and {256, 512} <= {s[1] for s in shapes}
    assert {"prefix", "offset", "packed"} <= {s[2] for s in shapes}
    assert any(c["q_heads"] > c["kv_heads"] for c in r["cases"])
    assert r["model_logits_max_abs_diff"] <= 1e-6 and r["model_packed_logits_max_abs_diff"] <= 1e-6
    assert r["model_loss_abs_diff"] <= 1e-6 and r["model_grad_max_abs_diff"] <= 1e-6
    layers = TINY_QWEN3_CONFIG["num_hidden_layers"]
    assert r["replacements"] == [f"layers.{i}.attention.rope" for i in range(layers)]
    assert _override_lines(proc) == r["replacements"]  # one log line per replaced layer
    assert r["versions"]["torch"] and r["versions"]["torchtitan"]


@pytest.mark.extended
def test_rope_layers_pattern_replaces_exactly_one(tmp_path, prepared_assets):
    """(Short sequences, one in the model check: the default shapes are test_rope_parity_default_every_layer's.)"""
    proc = run_example("rope_parity.py", "--out_dir", str(tmp_path), "--rope_layers", "*layers.1.*", "--seq_len", "64",
                       "--model_batch", "1", process=True)  # a pattern is registered once per process
    r = read_results(tmp_path)
    assert r["replacements"] == ["layers.1.attention.rope"]
    assert _override_lines(proc) == ["layers.1.attention.rope"]
    assert r["passed"] and r["model_logits_max_abs_diff"] <= 1e-6


@pytest.mark.parametrize("args, needles", [
    (["--rope_layers", "*layers.9.*"], ["matched no RoPE module"]),
    (["--rope_layer", "*"], ["unrecognized arguments: --rope_layer"]),
])
def test_bad_input_is_one_clear_error(tmp_path, args, needles, prepared_assets):
    """(The sequence length the kernel refuses is a row of tests/test_bad_input_matrix.py.)"""
    proc = run_in_process("rope_parity.py", "--out_dir", str(tmp_path), *args)
    assert_clean_error(proc, *needles)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_rounding_reference(dtype):
    """The reference the trn2 preset holds rope_hf to rounds where the kernel rounds (cos/sin in the input dtype,
    each product and sum rounded): that is transformers' bfloat16 math, bit for bit, forward and backward; and in
    float32 it equals the op's PyTorch path. On CPU it is therefore pinned without the kernel."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    from rope_parity import kernel_rounding_reference, ulp_bound
    from common.kernels.rope_op import rope

    g = torch.Generator().manual_seed(1)
    q, gq = (torch.randn(2, 256, 4, 64, generator=g).to(dtype) for _ in range(2))
    cache = CosSinRoPE.Config(dim=64, max_seq_len=1024, theta=1e6).build().cache
    table = cache[torch.stack([torch.arange(256), torch.arange(100, 356)])]  # one table per sequence
    x = q.clone().requires_grad_()
    cos, sin = table[..., :64].to(dtype), table[..., 64:].to(dtype)
    hf = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)[0].transpose(1, 2)
    hf.backward(gq)
    assert torch.equal(kernel_rounding_reference(q, table, backward=False), hf.detach())
    assert torch.equal(kernel_rounding_reference(gq, table, backward=True), x.grad)
    y = q.clone().requires_grad_()
    ours = rope(y, y, table)[0]
    ours.backward(gq)
    ref_fwd, ref_bwd = kernel_rounding_reference(q, table, False), kernel_rounding_reference(gq, table, True)
    if dtype == torch.float32:
        assert torch.equal(ours.detach(), ref_fwd) and torch.equal(y.grad, ref_bwd)
    else:  # the op rounds once: within the kernel's 3-ulp allowance, not equal
        assert ((ours.detach().float() - ref_fwd.float()).abs() <= ulp_bound(q, 3)).all()
        assert ((y.grad.float() - ref_bwd.float()).abs() <= ulp_bound(gq, 3)).all()
        assert not torch.equal(ours.detach(), ref_fwd)


def test_trn2_preset_without_the_stack_names_rope_hfs_module(tmp_path):
    """On a machine without Neuron, the trn2 preset stops in its preflight with one line naming what is missing,
    rope_hf's module included (a fix must bring that module: neuronx-cc's nkilib or nki-library's)."""
    proc = run_in_process("rope_parity.py", "--preset", "trn2", "--out_dir", str(tmp_path))
    assert_clean_error(proc, "not installed: torch-neuronx", "nkilib.core.embeddings.rope_hf")
    assert "blockwise" not in proc.stderr
