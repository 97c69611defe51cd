"""The load check's reference (common/harness/verifier.py's ReferenceLogits: transformers' float32 logits of the HF
folder a run starts from), computed where it costs step 1 least: the same tensors in this process and in a process of
its own (a Transformers-backend run from a large model, off the path to step 1), and a folder transformers cannot load
failing at step 1's comparison, never before the build."""
from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from common.harness.verifier import OWN_PROCESS_BYTES, ReferenceLogits
from common.paths import asset_dir


def test_the_reference_is_the_same_here_and_in_a_process_of_its_own(prepared_assets):
    tiny = asset_dir("tiny_qwen3")
    apart = ReferenceLogits(tiny, tiny, own_process=True)  # started first: it runs while this process computes
    here = ReferenceLogits(tiny, tiny, own_process=False, now=True)
    assert here.proc is None and here.ready is not None and apart.proc is not None
    a, b = here.wait(), apart.wait()
    assert set(a) == set(b) == {"input_ids", "position_ids", "logits"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["logits"].dtype == torch.float32 and a["logits"].shape[:2] == a["input_ids"].shape


def test_only_a_large_folder_is_computed_apart(tmp_path, prepared_assets):
    """The tiny model's weights load before the build in well under a second; a folder over OWN_PROCESS_BYTES of
    safetensors (a 4B model's 8 GB) is loaded in a process of its own beside the build."""
    assert not ReferenceLogits.large(asset_dir("tiny_qwen3"))
    with open(tmp_path / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(OWN_PROCESS_BYTES + 1)  # sparse: the size is what is read
    assert ReferenceLogits.large(tmp_path)


def test_a_folder_transformers_cannot_load_fails_at_the_comparison(tmp_path, prepared_assets):
    """Computed before the build, a folder transformers refuses is kept as the check's failure for step 1 (where
    the run says the model is not the checkpoint), not raised from the checks."""
    tiny = asset_dir("tiny_qwen3")
    config = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    ref = ReferenceLogits(tmp_path, tiny, own_process=False, now=True)
    with pytest.raises(UserError, match="transformers cannot load it"):
        ref.wait()
