"""On a Trainium device only: the NKI branches of the kernel ops against their PyTorch paths, forward and backward.

Skipped, with the reason below, wherever `common.device.neuron_available()` is false: this project's CI and every
machine without torch-neuronx and a NeuronCore. So these tests have not run. On a trn2 box (docs/first-hour-trn2.md):
    python -m pytest -rs tests/test_neuron_device.py
Each test has a time limit; most of it is neuronx-cc compiling each kernel once. The tests that put tensors on the
device run in this process on NeuronCore 0, the training run the last one starts on NeuronCore 1 (core_split(),
checked on CPU by tests/test_neuron_device_cores.py); run this file in a pytest process of its own.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import signal
from typing import Mapping

import pytest
import torch
import torch.nn.functional as F

from common import device
from common.harness import preflight
from common.kernels import moe_nki
from common.kernels.moe_op import grouped_experts
from common.kernels.rope_op import rope
from rope_parity import kernel_rounding_reference, ulp_bound  # examples/ is on sys.path (conftest)

LNC = 2
TIME_LIMIT_S = 1800
REASON = ("needs a Trainium device: common.device.neuron_available() is false here (no torch-neuronx or no "
          "NeuronCore); run on a trn2 host, see docs/first-hour-trn2.md")
# The Neuron runtime gives a process every NeuronCore of the instance, exclusively, from its start until the
# process closes it or exits, unless NEURON_RT_VISIBLE_CORES selects some: an index, a range "p-q" or a contiguous
# increasing list (aws-neuron/aws-neuron-sdk@81ce03a:neuron-runtime/guides/nrt-developer-guide.rst:1045-1054). The
# first four tests start it in this process; the last starts a training run as a child, which without cores of its
# own fails with "Failed to initialize Neuron Runtime". TorchNeuron's process group keeps a NEURON_RT_VISIBLE_CORES
# it finds set and only otherwise sets it to LOCAL_RANK (parmoham-aws/test-repo-parmoham@98154b8:
# torch_neuronx/distributed/backend.py:216-218), so the child's one rank runs on CHILD_CORES.
CORES_VAR = "NEURON_RT_VISIBLE_CORES"
IN_PROCESS_CORES, CHILD_CORES = "0", "1"  # logical NeuronCores (at LNC=2, 64 on a trn2.48xlarge)


def core_split(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what this pytest process sets before its first device use, the child training run's whole environment):
    disjoint NeuronCores; the child without TORCH_NEURONX_NEFF_CACHE_DIR, so that it uses OUT_DIR/neff_cache."""
    child = {k: v for k, v in env.items() if k != device.NEFF_CACHE_VAR}
    child[CORES_VAR] = CHILD_CORES
    return {CORES_VAR: IN_PROCESS_CORES}, child


if importlib.util.find_spec("torch_neuronx") is not None:  # before anything can start the Neuron runtime
    os.environ.update(core_split(os.environ)[0])
    device.set_neuron_env(LNC, os.environ.get(device.NEFF_CACHE_VAR, "/tmp/neff_cache"))
pytestmark = pytest.mark.skipif(not (device.neuron_installed() and device.neuron_available()), reason=REASON)
# The reduced Qwen3-30B-A3B preset of examples/train_moe_nki.py: one rank's tokens (seq 4096 x local batch 1).
TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 4096, 2048, 768, 64, 4
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
BF16_REL = 2e-2  # normwise, nki-library's own relative tolerance for the forward kernel against its golden


@pytest.fixture(autouse=True)
def time_limit():
    def expire(signum, frame):
        raise TimeoutError(f"a Neuron device test ran over {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIME_LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _fwd_bwd(fn, inputs, grads, dev):
    leaves = [t.detach().clone().to(dev).requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [g.to(dev) for g in grads])
    return [o.detach().cpu() for o in outs], [t.grad.cpu() for t in leaves]


def test_rope_kernel_against_its_rounding_and_the_pytorch_path():
    """rope_hf through the op (one table per sequence, as packed documents give): within 3 ulps of the kernel's
    own rounding (rope_parity.py), within 5 ulps of the PyTorch path, forward and backward, bfloat16."""
    g = torch.Generator().manual_seed(0)
    q, gq = (torch.randn(2, 4096, Q_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    k, gk = (torch.randn(2, 4096, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    positions = torch.stack([torch.arange(4096), torch.arange(100, 4196)]).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))  # CosSinRoPE's table, theta 1e6
    angles = (positions[..., None] * inv_freq).repeat(1, 1, 2)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [batch, seq, 2 * head_dim]
    outs, grads = _fwd_bwd(lambda a, b: rope(a, b, table.to("neuron"), lnc=LNC), (q, k), (gq, gk), "neuron")
    cpu_outs, cpu_grads = _fwd_bwd(lambda a, b: rope(a, b, table, lnc=LNC), (q, k), (gq, gk), "cpu")
    for got, pytorch_path, x, backward in zip(outs + grads, cpu_outs + cpu_grads, (q, k, gq, gk),
                                              (False, False, True, True)):
        ref = kernel_rounding_reference(x, table, backward)
        assert ((got.float() - ref.float()).abs() <= ulp_bound(x, 3)).all()
        assert ((got.float() - pytorch_path.float()).abs() <= ulp_bound(x, 5)).all()


def test_moe_kernel_forms_and_routing_tables_on_the_device():
    """Both MoE kernels import in a form moe_nki.launchable takes (a jit kernel object or a plain function), and
    the static-shape routing tables built on the device equal those built on CPU, at the reduced preset's shapes."""
    form = preflight.kernel_jit_form()
    assert "not importable" not in form and form.count("launch") == 2, form
    ids = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(1)).topk(TOP_K, dim=-1).indices
    n = moe_nki.num_blocks(TOKENS, TOP_K, EXPERTS)
    tables = []
    for on in (ids.to("neuron"), ids):
        counts = moe_nki.expert_counts(on, EXPERTS)
        tables.append([counts, moe_nki.token_slots(on, counts, n), moe_nki.block_to_expert(counts, n)])
    for name, got, ref in zip(("counts", "token slots", "block_to_expert"), *tables):
        assert torch.equal(got.cpu(), ref), name


def test_moe_kernels_against_the_pytorch_op():
    """The grouped-expert op on a Neuron device (blockwise_mm_baseline_shard_hidden + blockwise_mm_bwd) against
    the same op on CPU, at the reduced preset's shapes, bfloat16: output and the gradients of x, router scores,
    w1, w2, w3 within BF16_REL of the largest value; and the first step's checkpoint check passed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    scores, ids = F.softmax(logits, -1).topk(TOP_K, dim=-1)
    scores = (scores / scores.sum(-1, keepdim=True)).bfloat16()
    w1, w3 = ((0.02 * torch.randn(EXPERTS, INTER, HIDDEN, generator=g)).bfloat16() for _ in range(2))
    w2 = (0.02 * torch.randn(EXPERTS, HIDDEN, INTER, generator=g)).bfloat16()
    grad = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()

    def op(ids_on):
        return lambda x_, s_, a, b, c: grouped_experts(x_, s_, ids_on, a, b, c, compute_dtype=torch.bfloat16)[0]

    inputs = (x, scores, w1, w2, w3)
    moe_nki._checkpoints_checked = False
    outs, grads = _fwd_bwd(op(ids.to("neuron")), inputs, (grad,), "neuron")
    assert moe_nki._checkpoints_checked
    ref_outs, ref_grads = _fwd_bwd(op(ids), inputs, (grad,), "cpu")
    for name, got, ref in zip(("out", "x", "scores", "w1", "w2", "w3"), outs + grads, ref_outs + ref_grads):
        err, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert err <= BF16_REL * scale, f"{name}: max abs diff {err:.3g} > {BF16_REL} x {scale:.3g}"


def test_causal_and_document_masked_attention_on_the_device(tmp_path):
    """The attention the training scripts run (common/torchtitan_fixes.py SDPADocumentAttention) on the device, at the
    4B preset's head shape: causal (--document_mask auto on Neuron: TorchNeuron's fused flash kernel takes no mask,
    parmoham-aws/test-repo-parmoham@98154b8 torch_neuronx/python_ops/scaled_dot_product_fused_attention.py:44-57)
    and document-masked (the unfused fallback, float32 scores: the same file's 185-189). Each forward and backward
    runs under torch.profiler; the attention ops it dispatched and the device's peak memory are written to
    attention.json for the report (which op ran is read, not assumed); the masked peak is the larger, by at least the
    fallback's float32 scores of one head group."""
    from common.torchtitan_fixes import SDPADocumentAttention, document_causal_mask_from_positions

    seq, heads, kv_heads = 1024, Q_HEADS, 8  # a multiple of 512: the fused kernel's rule
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, n, HEAD_DIM, generator=g).bfloat16() for n in (heads, kv_heads, kv_heads))
    positions = torch.cat([torch.arange(seq // 2), torch.arange(seq // 2)])[None]  # two packed documents
    read, _ = device.neuron_peak_memory()
    found = {}
    for name, choice in (("causal", "off"), ("masked", "on")):
        attention = SDPADocumentAttention(SDPADocumentAttention.Config(document_mask=choice))
        leaves = [t.to("neuron").requires_grad_() for t in (q, k, v)]
        masks = document_causal_mask_from_positions(positions.to("neuron"))
        torch.neuron.synchronize()
        torch.neuron.reset_peak_memory_stats()  # the peak both readers read (common.device.neuron_peak_memory)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = attention(*leaves, attention_masks=masks)
            out.float().sum().backward()
            torch.neuron.synchronize()
        ops = sorted({e.name for e in prof.events() if "attention" in e.name.lower()})
        found[name] = {"ops": ops, "peak_bytes": int(read())}
    (tmp_path / "attention.json").write_text(json.dumps(found, indent=1))
    print(json.dumps(found))
    assert found["causal"]["ops"] and found["masked"]["ops"], found
    scores = seq * seq * 4  # one head's float32 scores
    assert found["masked"]["peak_bytes"] >= found["causal"]["peak_bytes"] + scores, found


def test_a_neuron_runs_pilot_fields_memory_neff_cache_and_fallback_ops(tmp_path):
    """Two steps of the native script on one NeuronCore (CHILD_CORES, not this process's), as the runbook's step 4
    runs it: the device peak of the heaviest step read after a synchronize (not torchtitan's nested-stats 0), the
    NEFF cache watched where the run set TORCH_NEURONX_NEFF_CACHE_DIR (OUT_DIR/neff_cache: a fresh folder, so cold,
    with .neff files), and the ops TorchNeuron ran on the CPU read in the training process; step 2 profiled, the
    runtime's trace files under OUT_DIR/profile_traces/neuron and listed; the installed packages for a problem
    report."""
    out = tmp_path / "o"
    env = core_split(os.environ)[1]
    proc = subprocess.run([sys.executable, "examples/train_native_qwen3.py", "--device", "neuron", "--steps", "2",
                           "--profile", "--no-export", "--out_dir", str(out)], env=env, capture_output=True,
                          text=True, timeout=TIME_LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((out / "results.json").read_text())
    assert max(r["memory"]["peak_gib"]) > 0, r["memory"]
    cache = r["timing"]["compile_cache"]
    assert cache["dir"] == str(out / "neff_cache") and cache["state"] == "cold" and cache["entries_after"] > 0
    assert isinstance(r["fallback_ops"]["ops"], list), r["fallback_ops"]
    assert r["memory"]["measured_by"].startswith(("torch.neuron.", "torch.accelerator.")), r["memory"]
    runtime = r["profile"]["neuron_traces"]
    assert runtime and all(t["path"].startswith("profile_traces/neuron/node0/") for t in runtime), r["profile"]
    assert any(t["path"].endswith("trace_info.pb") for t in runtime), runtime  # ProfileMode.RUNTIME's file
    assert any(line.startswith("torch-neuronx==") for line in r["installed"]["pip"]), r["installed"]
