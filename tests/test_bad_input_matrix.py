"""The bad-input matrix (issue 8): each row ends in one readable `error:` line naming the problem,
a non-zero exit, no traceback, and no results.json. Checkpoint rows start from a valid Qwen3
saved by transformers and break one thing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_clean_error, run_example


def _save_qwen3(path):
    """A small valid Qwen3 written by transformers: untied, grouped-query attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good_qwen3")
    _save_qwen3(path)
    return path


def _copy(good, dst):
    shutil.copytree(good, dst)
    return dst


def _edit_tensors(folder, fn):
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def missing_folder(good, tmp):
    return tmp / "nope"


def empty_folder(good, tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty"


def truncated_safetensors(good, tmp):
    bad = _copy(good, tmp / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return bad


def wrong_shape(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_tensors(bad, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    return bad


def wrong_dtype(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_tensors(bad, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)))
    return bad


def missing_key(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_tensors(bad, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    return bad


def extra_key(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_tensors(bad, lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(4)))
    return bad


def other_architecture(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_config(bad, architectures=["LlamaForCausalLM"], model_type="llama")
    return bad


def needs_remote_code(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_config(bad, auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    return bad


CHECKPOINT_ROWS = [
    (missing_folder, "does not exist"),
    (empty_folder, "is empty"),
    (truncated_safetensors, "truncated"),
    (wrong_shape, "wrong shapes [model.norm.weight: [65]"),
    (wrong_dtype, "non-float weights [model.norm.weight: I32]"),
    (missing_key, "missing keys [model.layers.1.mlp.down_proj.weight]"),
    (extra_key, "unexpected keys [model.layers.1.mlp.extra.weight]"),
    (other_architecture, "LlamaForCausalLM"),
    (needs_remote_code, "needs remote code"),
]


@pytest.mark.parametrize("make, needle", CHECKPOINT_ROWS, ids=[r[0].__name__ for r in CHECKPOINT_ROWS])
def test_bad_checkpoint(make, needle, good, tmp_path):
    ckpt = make(good, tmp_path)
    proc = run_example("train_native_qwen3.py", "--hf_checkpoint", str(ckpt), "--out_dir", str(tmp_path / "o"),
                       check=False)
    assert_clean_error(proc, needle)
    assert not (tmp_path / "o" / "results.json").exists()


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_example("train_native_qwen3.py", "--out_dir", str(blocker / "out"), check=False)
    assert_clean_error(proc, f"--out_dir {blocker / 'out'} cannot be written")


CLI_ROWS = [
    ("train_native_qwen3.py", ["--preset", "qwen3_999b"], "invalid choice: 'qwen3_999b'"),
    ("train_native_qwen3.py", ["--stepz", "3"], "unrecognized arguments: --stepz"),
    ("train_native_qwen3.py", ["--steps", "0"], "--steps must be positive, got 0"),
    ("train_native_qwen3.py", ["--steps", "-3"], "--steps must be positive, got -3"),
    ("train_native_qwen3.py", ["--global_batch_size", "3", "--nproc_per_node", "2"],
     "global batch 3 is not a multiple of local batch 2 x 2 ranks"),
    ("rope_parity.py", ["--seq_len", "200", "--lnc", "2", "--check_kernel_shape"],
     "sequence length 200 is not a multiple of 128 x LNC = 256"),
]


@pytest.mark.parametrize("script, args, needle", CLI_ROWS, ids=[" ".join(r[1]) for r in CLI_ROWS])
def test_bad_flag(script, args, needle, tmp_path, prepared_assets):
    proc = run_example(script, "--out_dir", str(tmp_path), *args, check=False)
    assert_clean_error(proc, needle)
    assert not (tmp_path / "results.json").exists()
