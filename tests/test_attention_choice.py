"""Causal SDPA or packed-document masking (common/torchtitan_fixes.py document_masking): document-masked on CPU and
CUDA as before, plain causal on Neuron unless asked (TorchNeuron's fused attention takes no mask), and the dry
run's memory plan of each path (common/harness/dryrun.py attention_bytes) for the Qwen3-4B preset."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.models.common.attention import create_varlen_metadata_for_document  # noqa: E402
from torchtitan.models.qwen3 import model_registry  # noqa: E402

from common.harness import dryrun  # noqa: E402
from common.torchtitan_fixes import (SDPADocumentAttention, attention_path, document_masking,  # noqa: E402
                                     use_attention_backend)
from conftest import ROOT, run_python  # noqa: E402

GIB = 2**30
# Qwen3-4B's config.json numbers the plan reads (the preset's model_shape)
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "tie_word_embeddings": True}


def test_auto_masks_documents_everywhere_but_on_neuron():
    assert [document_masking("auto", d) for d in ("cpu", "cuda", "neuron")] == [True, True, False]
    assert document_masking("on", "neuron") and not document_masking("off", "cpu")
    with pytest.raises(ValueError, match="unknown document mask choice 'yes'"):
        document_masking("yes", "cpu")


def test_off_is_plain_causal_attention_across_documents():
    """Without document masking the boundaries the trainer hands are ignored: the same as is_causal SDPA over the
    whole packed sequence; with it (auto on CPU) each document attends to itself only."""
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    q, k, v = (torch.randn(1, 8, 4, 16) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 4 heads share 2 kv heads
    meta = create_varlen_metadata_for_document(positions)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    off = SDPADocumentAttention(SDPADocumentAttention.Config(document_mask="off"))(q, k, v, attention_masks=meta)
    torch.testing.assert_close(off, causal, rtol=0, atol=0)
    auto = SDPADocumentAttention(SDPADocumentAttention.Config())(q, k, v, attention_masks=meta)
    torch.testing.assert_close(auto[:, :4], causal[:, :4], rtol=0, atol=1e-6)  # the first document: the same
    assert (auto[:, 4:] - causal[:, 4:]).abs().max() > 1e-2  # the later ones no longer see the first


def test_the_installed_attention_says_its_path_per_device():
    spec = model_registry("4B")
    changed = use_attention_backend(spec.model, "sdpa")
    assert len(changed) == 36
    assert attention_path(spec.model, "neuron") == "sdpa_causal"
    assert attention_path(spec.model, "cpu") == "sdpa_document_mask"
    masked = model_registry("4B")
    use_attention_backend(masked.model, "sdpa", document_mask="on")
    assert attention_path(masked.model, "neuron") == "sdpa_document_mask_neuron"
    assert attention_path(model_registry("4B").model, "cuda") == "flex"
    with pytest.raises(ValueError, match="unknown document mask choice"):
        use_attention_backend(model_registry("4B").model, "sdpa", document_mask="true")


def test_the_plan_counts_neurons_float32_scores_and_a_boolean_mask():
    """The 4B preset's micro-batch (1 x 4,096 tokens, 32 heads, bfloat16): with the mask on Neuron, 3 float32 score
    tensors and a bfloat16 one (7 GiB: 2 GiB a float32 one) in the layer's backward, and the mask as 1 byte plus its
    bfloat16 and float32 copies; causal, neither; on CPU the mask alone (1 byte and its copy in the query's dtype)."""
    L = 4096

    def act(path, **kw):
        return dryrun.activation_estimate(QWEN3_4B, batch=1, seq_len=L, compute_bytes=2, ac="full", attention=path,
                                          **kw)

    masked, causal, cpu = act("sdpa_document_mask_neuron"), act("sdpa_causal"), act("sdpa_document_mask")
    assert masked["attention_scores"] == 32 * L * L * (3 * 4 + 2) == 7 * GIB
    assert masked["attention_mask"] == L * L * (1 + 2 + 4)
    assert causal["attention_scores"] == causal["attention_mask"] == 0
    assert (cpu["attention_scores"], cpu["attention_mask"]) == (0, L * L * 3)
    assert masked["recomputed_layer"] - causal["recomputed_layer"] == 7 * GIB + L * L * 7
    assert act("sdpa_document_mask_neuron", tp=4)["attention_scores"] == 8 * L * L * 14  # the heads of a rank


def test_4b_dry_run_plans_causal_attention_on_neuron(shared_run):
    out, results = shared_run("native_4b_dry_run")
    r = results["dry_run"]
    assert r["attention"]["path"] == "sdpa_causal" and r["attention"]["score_bytes"] == 0
    assert "[dry run] attention on neuron: causal SDPA, documents not masked" in \
        (out.parent / "native_4b_dry_run.log").read_text()


# The 4B preset's trainer config as its dry run builds it, its attention then set to document masking (the choice
# its recipe will take from a flag), planned for Neuron: one sharded meta build a process.
MASKED_4B = """
import json, sys
from pathlib import Path
import torch
from common import device
device.route_torchtitan_device("cpu")
sys.path.insert(0, "examples")
from train_native_qwen3 import RECIPE
from common.harness import dryrun
from common.recipe import Inputs
from common.torchtitan_fixes import SDPADocumentAttention
cfg = RECIPE.presets["qwen3_4b"]()
target = device.DeviceInfo(torch.device("meta"), "neuron", "fake", 0, 0, 64)
tc, _ = RECIPE.trainer_config(cfg, target, Path(sys.argv[1]), Inputs())
for _fqn, node, _p, _a in tc.model_spec.model.traverse(SDPADocumentAttention.Config):
    node.document_mask = "on"
r = dryrun.dry_run(tc, shape=RECIPE.model_shape(cfg, tc, Inputs()), world_size=64, per_core_gib=24.0,
                   published_params=None, label="qwen3_4b masked")
print(dryrun.format_table(r))
print(json.dumps({k: r[k] for k in ("attention", "total_bytes", "activation_terms", "fits")}))
"""


def test_4b_dry_run_with_document_masking_adds_the_scores(tmp_path, shared_run):
    c = shared_run("native_4b_dry_run")[1]["dry_run"]
    proc = run_python([sys.executable, "-c", MASKED_4B, str(tmp_path / "masked")], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["attention"]["path"] == "sdpa_document_mask_neuron" and m["attention"]["score_bytes"] == 7 * GIB
    assert "attention on neuron: SDPA with the packed-document mask on Neuron" in proc.stdout
    # full activation checkpointing at TP 1: the layer's backward, now with the scores, outgrows the chunked loss
    assert m["activation_terms"]["decoder_backward_phase"] > m["activation_terms"]["loss_phase"]
    added = m["total_bytes"] - c["total_bytes"]
    assert 5 * GIB < added < 7.2 * GIB, added / GIB
