"""Unit tests for common/: the SDPA document-mask workaround, the CLI generator, checkpoint checks."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.models.common.attention import (  # noqa: E402
    create_varlen_metadata_for_document, get_causal_mask_mod, get_document_mask_mod)

from common import checkpoint, cli  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.torchtitan_fixes import SDPADocumentAttention  # noqa: E402
from common.results import replace_dir, write_results  # noqa: E402


def test_document_mask_matches_torchtitan_mask_mods():
    # two rows; row 0 holds three packed documents, row 1 starts mid-document
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 0, 1, 2, 3, 0, 1]])
    B, L = positions.shape
    meta = create_varlen_metadata_for_document(positions)
    ours = SDPADocumentAttention.document_causal_mask(meta, B, L, "cpu")[:, 0]
    doc, causal = get_document_mask_mod(positions), get_causal_mask_mod()
    b, q, k = torch.meshgrid(torch.arange(B), torch.arange(L), torch.arange(L), indexing="ij")
    h = torch.zeros_like(b)
    expected = doc(b, h, q, k) & causal(b, h, q, k)
    assert torch.equal(ours, expected)


def test_sdpa_attention_equals_per_document_attention():
    torch.manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    q, k, v = (torch.randn(1, 8, 4, 16) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 4 heads share 2 kv heads
    attn = SDPADocumentAttention(SDPADocumentAttention.Config())
    out = attn(q, k, v, attention_masks=create_varlen_metadata_for_document(positions))
    for start, end in ((0, 4), (4, 7), (7, 8)):  # each document on its own, plain causal
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, start:end].transpose(1, 2), k[:, start:end].transpose(1, 2), v[:, start:end].transpose(1, 2),
            is_causal=True, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out[:, start:end], ref, rtol=0, atol=1e-6)


@dataclass
class _Cfg:
    preset: str = "a"
    steps: int = field(default=3, metadata={"help": "steps"})
    name: str | None = None
    export: bool = True
    mode: Literal["x", "y"] = "x"


def _presets():
    def a():
        """first"""
        return _Cfg()

    def b():
        """second"""
        return _Cfg(steps=7, mode="y")
    return {"a": a, "b": b}


def test_cli_preset_then_flags():
    cfg = cli.parse_config(_Cfg, _presets(), ["--preset", "b", "--no-export", "--name", "n"], "", "a")
    assert (cfg.preset, cfg.steps, cfg.export, cfg.name, cfg.mode) == ("b", 7, False, "n", "y")
    cfg = cli.parse_config(_Cfg, _presets(), ["--steps", "5"], "", "a")
    assert (cfg.preset, cfg.steps, cfg.mode) == ("a", 5, "x")
    with pytest.raises(SystemExit):
        cli.parse_config(_Cfg, _presets(), ["--mode", "z"], "", "a")
    with pytest.raises(SystemExit):
        cli.parse_config(_Cfg, _presets(), ["--steps", "three"], "", "a")


def test_atomic_write_leaves_no_temp(tmp_path):
    target = tmp_path / "results.json"
    write_results(tmp_path, {"a": 1})
    write_results(tmp_path, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_replace_dir_swaps_whole_folders_and_keeps_the_old_one_on_failure(tmp_path):
    dest, new = tmp_path / "export", tmp_path / ".export.tmp"
    for folder, text in ((dest, "old"), (new, "new")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    replace_dir(new, dest)
    assert (dest / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["export"]
    with pytest.raises(OSError):
        replace_dir(tmp_path / "never_built", dest)  # the second rename fails
    assert (dest / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["export"]


def test_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot be written"):
        cli.check_out_dir(str(blocker / "sub"))


def test_remote_code_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(UserError, match="remote code"):
        checkpoint.validate_hf_checkpoint(tmp_path, checkpoint.QWEN3_DENSE)


def test_spec_round_trips_through_config_json():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    back = checkpoint.hf_config_from_qwen3(checkpoint.qwen3_spec_from_hf(hf).model)
    for key, value in hf.items():
        assert back[key] == value, key
