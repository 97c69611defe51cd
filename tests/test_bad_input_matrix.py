"""The bad-input matrix: each row ends in one readable `error:` line naming the problem, a
non-zero exit, no traceback, and no results.json. Checkpoint rows start from a valid Qwen3 saved
by transformers and break one thing; dataset and tokenizer rows break a copy of what set-up made;
flag rows give values that are NaN, infinite, out of range or absurdly large."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import UserError
from conftest import ROOT, assert_clean_error, run_example, run_in_process, run_module_in_process


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


def config_not_an_object(good, tmp):
    bad = _copy(good, tmp / "bad")
    (bad / "config.json").write_text("[]")
    return bad


def config_not_utf8(good, tmp):
    bad = _copy(good, tmp / "bad")
    (bad / "config.json").write_bytes(b"\xff\xfe{" + (good / "config.json").read_bytes())
    return bad


def architectures_a_string(good, tmp):
    bad = _copy(good, tmp / "bad")
    _edit_config(bad, architectures="Qwen3ForCausalLM")
    return bad


def header_of_the_wrong_shape(good, tmp):
    bad = _copy(good, tmp / "bad")
    data = (bad / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": "64", "data_offsets": 7}}).encode()
    header += b" " * (n - len(header))  # same length: the tensor data stays where it was
    (bad / "model.safetensors").write_bytes(data[:8] + header + data[8 + n:])
    return bad


def garbage_index(good, tmp):
    bad = _copy(good, tmp / "bad")
    (bad / "model.safetensors.index.json").write_text("{garbage")
    return bad


def index_names_a_missing_shard(good, tmp):
    bad = _copy(good, tmp / "bad")
    weight_map = {k: "model.safetensors" for k in load_file(str(bad / "model.safetensors"))}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
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
    (config_not_an_object, "holds a JSON list, not an object"),
    (config_not_utf8, "is not UTF-8 text"),
    (architectures_a_string, "architectures must be a list of class names"),
    (header_of_the_wrong_shape, "the header entry of model.norm.weight is malformed"),
    (garbage_index, "is not a safetensors index"),
    (index_names_a_missing_shard, "names shard files that are not in"),
]


@pytest.mark.parametrize("make, needle", CHECKPOINT_ROWS, ids=[r[0].__name__ for r in CHECKPOINT_ROWS])
def test_bad_checkpoint(make, needle, good, tmp_path):
    ckpt = make(good, tmp_path)
    proc = run_in_process("train_native_qwen3.py", "--hf_checkpoint", str(ckpt), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, needle)
    assert not (tmp_path / "o" / "results.json").exists()


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_in_process("train_native_qwen3.py", "--out_dir", str(blocker / "out"))
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
    ("train_native_qwen3.py", ["--lr", "nan"], "--lr must be a finite number, got nan"),
    ("train_hf_backend.py", ["--lr", "inf"], "--lr must be a finite number, got inf"),
    ("train_moe_nki.py", ["--per_core_gib=-inf"], "--per_core_gib must be a finite number, got -inf"),
    ("train_native_qwen3.py", ["--warmup_steps", "-1"], "--warmup_steps must not be negative, got -1"),
    ("train_hf_backend.py", ["--export_tolerance", "0"], "--export_tolerance must be positive, got 0.0"),
    ("train_moe_nki.py", ["--load_balance_coeff", "-0.5"], "--load_balance_coeff must not be negative"),
    ("train_native_qwen3.py", ["--attn_backend", "flex"], "--attn_backend flex needs CUDA"),
    ("train_hf_backend.py", ["--attn_backend", "flex"], "--attn_backend flex needs CUDA"),
    ("train_native_qwen3.py", ["--seq_len", "100000"], "--seq_len 100000 is more than the model's 2048 positions"),
    ("train_hf_backend.py", ["--seq_len", "100000"], "--seq_len 100000 is more than the model's 2048 positions"),
    ("train_moe_nki.py", ["--seq_len", "100000"], "--seq_len 100000 is more than the model's 4096 positions"),
    ("train_moe_nki.py", ["--num_experts", "1000000"], "--num_experts 1000000 is more than 1024"),
    ("train_native_qwen3.py", ["--local_batch_size", "100000"], "this run needs at least"),
    ("train_hf_backend.py", ["--local_batch_size", "100000"], "activations"),
    ("train_moe_nki.py", ["--local_batch_size", "100000", "--seq_len", "4096"], "lower them, or see --dry_run"),
    ("train_native_qwen3.py", ["--nproc_per_node", "64"], "--nproc_per_node 64 starts more processes than this host"),
    ("train_hf_backend.py", ["--nnodes", "2", "--node_rank", "2"], "--node_rank 2 is not below --nnodes 2"),
    ("train_moe_nki.py", ["--nproc_per_node", "2", "--hf_checkpoint", "/nonexistent"], "does not exist"),
    ("train_hf_backend.py", ["--nproc_per_node", "2", "--hf_checkpoint", "/nonexistent"], "does not exist"),
    ("train_native_qwen3.py", ["--global_batch_size", "0"], "--global_batch_size must be -1 or positive, got 0"),
    ("train_native_qwen3.py", ["--global_batch_size", "-5"], "--global_batch_size must be -1 or positive, got -5"),
    ("train_native_qwen3.py", ["--seq_len", "100"], "--seq_len must be a multiple of 8, got 100"),
    ("train_moe_nki.py", ["--seq_len", "1"], "--seq_len must be at least 8, got 1"),
    ("train_hf_backend.py", ["--seq_len", "1"], "--seq_len must be at least 2, got 1"),
    ("train_native_qwen3.py", ["--lr", "1e30"], "--lr 1e+30 is more than 10"),
    ("train_native_qwen3.py", ["--seed", "99999999999999999999999"],
     "--seed 99999999999999999999999 is more than 4294967295"),
    ("train_native_qwen3.py", ["--dry_run", "--dry_run_ranks", "1000000000000"],
     "--dry_run_ranks 1000000000000 is more than 100000"),
    ("rope_parity.py", ["--seq_len", "1"], "--seq_len must be 0 or at least 2, got 1"),
    ("rope_parity.py", ["--seq_len", "3000000"], "--seq_len 3000000 is more than 2048"),
    ("rope_parity.py", ["--model_batch", "1000000"], "--model_batch 1000000 is more than 1024"),
    ("rope_parity.py", ["--model_batch", "1024"], "--model_batch 1024 x --seq_len 256 is 262144 tokens"),
]


@pytest.mark.parametrize("script, args, needle", CLI_ROWS, ids=[" ".join([r[0], *r[1]]) for r in CLI_ROWS])
def test_bad_flag(script, args, needle, tmp_path, prepared_assets):
    """Every `error:` line a flag can cause, as a user types it: one line, exit 2, nothing written."""
    proc = run_in_process(script, "--out_dir", str(tmp_path), *args)
    assert_clean_error(proc, needle)
    assert proc.returncode == 2 and not (tmp_path / "results.json").exists()


def test_argparse_errors_are_one_line(tmp_path):
    proc = run_in_process("train_native_qwen3.py", "--stepz", "3")
    assert_clean_error(proc, "unrecognized arguments: --stepz")
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "error: unrecognized arguments: --stepz 3 (see --help)"]


def test_control_characters_in_a_path_or_flag_cannot_split_or_colour_the_error_line(tmp_path):
    """A path holding a newline and an escape sequence, and an unknown flag holding them: each error is one
    printable line (U+FFFD in their place), so nothing in it can be hidden, moved or recoloured."""
    hostile = str(tmp_path / "no\nwhere\x1b[31m")
    for args, needle in (((f"--hf_checkpoint", hostile), "no\ufffdwhere\ufffd[31m"),
                         (("--st\reps", "3"), "--st\ufffdeps")):
        proc = run_in_process("train_native_qwen3.py", *args, "--out_dir", str(tmp_path / "o"))
        assert_clean_error(proc, needle)
        assert "\x1b" not in proc.stderr and "\r" not in proc.stderr
        assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1, proc.stderr


SHORTENED_FLAG_ROWS = [  # (module, entry point, argv with a shortened flag, that flag)
    ("compat_check.lookup", "lookup_main", ["runs", "--nam", "qwen"], "--nam"),
    ("common.harness.verifier", "_main", ["verify", "e", "--reference", "r", "--out", "o", "--weights"],
     "--weights"),
    ("common.harness.checks", "_main", ["validate", "c", "--ar", "X"], "--ar"),
    ("common.harness.preflight", "main", ["--targ", "cpu"], "--targ"),
]


@pytest.mark.parametrize("module, entry, argv, flag", SHORTENED_FLAG_ROWS, ids=[r[0] for r in SHORTENED_FLAG_ROWS])
def test_every_command_line_refuses_shortened_flags(module, entry, argv, flag, capsys):
    """argparse would take `--nam` for `--name`; every entry point refuses it in one `error:` line."""
    main = getattr(importlib.import_module(module), entry)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: unrecognized arguments: ") and flag in err[0], err


def _dataset(tmp, name, content: bytes | None):
    folder = tmp / name
    folder.mkdir()
    if content is not None:
        (folder / "train.jsonl").write_bytes(content)
    return folder


DATASET_ROWS = [
    ("no_data_files", None),
    ("no_text_field", b'{"content": "a sentence"}\n' * 4),
    ("null_texts", b'{"text": null}\n' * 4),
    ("only_empty_texts", b'{"text": ""}\n{"text": "  "}\n' * 4),
    ("binary_garbage", bytes(range(256)) * 16),
    ("empty_file", b""),
]


@pytest.mark.parametrize("name, content", DATASET_ROWS, ids=[r[0] for r in DATASET_ROWS])
def test_bad_dataset(name, content, tmp_path, prepared_assets):
    folder = _dataset(tmp_path, name, content)
    proc = run_in_process("train_native_qwen3.py", "--dataset", str(folder), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, f"dataset folder {folder}")
    assert not (tmp_path / "o" / "results.json").exists()


def test_malformed_tokenizer(tmp_path, prepared_assets):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    proc = run_in_process("train_moe_nki.py", "--hf_assets", str(folder), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "cannot be read as a tokenizer")


def _one_token_tokenizer(folder):
    """A tokenizer that parses and encodes without an error, and maps every text to token 0."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir()
    Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    return folder


def test_a_degenerate_tokenizer_is_refused_whatever_its_cache_marker_says(tmp_path, prepared_assets):
    """A one-entry vocabulary encodes "Hello world" without an error (the check this replaced), and would train on
    token 0: a text must encode into distinct tokens and decode back. The verdict kept in the cache folder is a
    file this check wrote: a marker made by hand (empty) does not skip the check, a dangling link there is never
    followed (its target is not created)."""
    import hashlib

    import tokenizers

    from common import checkpoint

    folder = _one_token_tokenizer(tmp_path / "tok")
    data = (folder / "tokenizer.json").read_bytes()
    marker = checkpoint.CACHE_DIR.parent / "tokenizers-read" / \
        f"{hashlib.sha256(data).hexdigest()}-{tokenizers.__version__}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "created_through_the_link"
    try:
        marker.write_text("")
        with pytest.raises(UserError, match="is not a language model's tokenizer"):
            checkpoint.check_tokenizer(folder)
        marker.unlink()
        marker.symlink_to(target)
        with pytest.raises(UserError, match="is not a language model's tokenizer"):
            checkpoint.check_tokenizer(folder)
        assert not target.exists() and marker.is_symlink()
    finally:
        marker.unlink(missing_ok=True)
    proc = run_in_process("train_native_qwen3.py", "--hf_assets", str(folder), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "is not a language model's tokenizer", "encodes to")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, prepared_assets):
    """The set-up's Qwen3 tokenizer (151,669 ids) against a Qwen3 checkpoint with 1,000 embedding rows."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ckpt = tmp_path / "small_vocab"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=1024)).save_pretrained(ckpt)
    proc = run_in_process("train_native_qwen3.py", "--hf_checkpoint", str(ckpt), "--out_dir", str(tmp_path / "o"))
    assert_clean_error(proc, "has 151669 tokens and the model", "only 1000 embedding rows")


@pytest.mark.parametrize("script", ["train_native_qwen3.py", "train_hf_backend.py", "train_moe_nki.py",
                                    "rope_parity.py", "generate_compat_check.py"])
def test_help_lists_every_flag(script):
    """`--help` works for every example (help strings are formatted by argparse, '%' included), and says what each
    preset is: its docstring's whole first paragraph (a trn2 preset names its sources there)."""
    import re
    import runpy

    proc = run_in_process(script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-2000:]
    from common import cli
    from common.harness.lifecycle import SECTIONS

    found = runpy.run_path(str(ROOT / "examples" / script), run_name="help_check")
    names = found["RECIPE"].config if "RECIPE" in found else found["Config"]
    for _, f in cli.flag_fields(names, SECTIONS if "RECIPE" in found else None):
        assert f"--{f.name}" in proc.stdout, f.name
    shown = " ".join(re.sub(r"-\n\s+", "-", proc.stdout).split())  # argparse's wrapping undone
    for preset, make in found["PRESETS"].items():
        assert " ".join(make.__doc__.split("\n\n")[0].split()) in shown, preset


def _not_a_file(path, kind: str) -> None:
    """Put a folder (with a file in it) or a FIFO where a file is expected."""
    import os

    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "keep.txt").write_text("someone's")


NOT_A_FILE_ROWS = [(name, kind) for name in ("model.safetensors", "model.safetensors.index.json")
                   for kind in ("fifo", "folder")]


@pytest.mark.parametrize("name, kind", NOT_A_FILE_ROWS, ids=[f"{n}-{k}" for n, k in NOT_A_FILE_ROWS])
def test_checkpoint_validate_refuses_a_fifo_or_folder_where_a_file_is_expected(name, kind, good, tmp_path):
    """A FIFO named like a checkpoint file hung `validate` (the read blocks); a folder of that name was an
    IsADirectoryError. Each is one line naming it, before anything is opened. A folder: in this process; a FIFO: a
    process of its own, whose timeout keeps a hang from holding the suite."""
    import sys

    from conftest import run_python

    ckpt = _copy(good, tmp_path / "ckpt")
    _not_a_file(ckpt / name, kind)
    if kind == "fifo":
        proc = run_python([sys.executable, "-m", "common.harness.checks", "validate", str(ckpt)], timeout=120)
    else:
        proc = run_module_in_process("common.harness.checks", "validate", str(ckpt))
    assert_clean_error(proc, f"{ckpt / name} is {'a FIFO' if kind == 'fifo' else 'a folder'}, not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_training_refuses_a_checkpoint_whose_safetensors_is_a_fifo_or_folder(kind, good, tmp_path):
    ckpt = _copy(good, tmp_path / "ckpt")
    _not_a_file(ckpt / "model.safetensors", kind)
    args = ("--hf_checkpoint", str(ckpt), "--out_dir", str(tmp_path / "o"))  # a FIFO: a process, its timeout
    proc = run_example("train_native_qwen3.py", *args, check=False, timeout=120) if kind == "fifo" else \
        run_in_process("train_native_qwen3.py", *args)  # against a hang
    assert_clean_error(proc, f"{ckpt / 'model.safetensors'} is {'a FIFO' if kind == 'fifo' else 'a folder'}")
    assert not (tmp_path / "o" / "results.json").exists()


def test_outputs_that_are_folders_or_fifos_are_refused_before_any_work(tmp_path):
    """results.json, losses.jsonl, loss.png, export_check.json ... in OUT_DIR must be absent or regular files (or
    links to them): `check_outputs` names the first that is a folder or a FIFO, and a writer never replaces one
    (before: a crash after training, IsADirectoryError from the rename)."""
    import os

    from common.errors import UserError
    from common.harness.checks import RUN_OUTPUTS, check_outputs
    from common.results import write_results

    assert {"results.json", "losses.jsonl", "loss.png", "export_check.json"} <= set(RUN_OUTPUTS)
    check_outputs(tmp_path)  # nothing there yet
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "elsewhere.png").write_bytes(b"png")
    (tmp_path / "loss.png").symlink_to(tmp_path / "elsewhere.png")  # a link to a regular file is one
    (tmp_path / "export_check.json").symlink_to(tmp_path / "nowhere.json")  # a dangling link is replaced
    check_outputs(tmp_path)
    for name, kind in (("results.json", "folder"), ("losses.jsonl", "fifo"), ("export_check.json", "folder"),
                       ("loss.png", "fifo")):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        _not_a_file(out / name, kind)
        with pytest.raises(UserError, match=f"{out / name} is {'a FIFO' if kind == 'fifo' else 'a folder'}, not a "
                                            "file this run writes"):
            check_outputs(out)
    with pytest.raises(UserError, match="is a folder, not a file this run writes"):
        write_results(tmp_path / "results_json", {"losses": [1.0]})
    assert (tmp_path / "results_json" / "results.json" / "keep.txt").read_text() == "someone's"
    assert os.listdir(tmp_path / "results_json") == ["results.json"]  # no temp file left beside it


def _verify_reference(path, vocab: int, drop: str | None = None):
    tensors = {"input_ids": torch.tensor([[1, 2, 3]]), "position_ids": torch.tensor([[0, 1, 2]]),
               "logits": torch.zeros(1, 3, vocab)}
    tensors.pop(drop, None)
    save_file(tensors, str(path))
    return path


VERIFY_ROWS = ["missing-reference", "reference-not-safetensors", "reference-without-logits", "out-a-folder"]


@pytest.mark.parametrize("row", VERIFY_ROWS)
def test_export_verify_bad_input_is_one_line(row, prepared_assets, tmp_path):
    """`python -m common.harness.verifier verify` with a --reference that is missing, not safetensors or without
    logits, or an --out that is a folder: one `error:` line each (before: four tracebacks), and nothing written."""
    import sys

    from conftest import run_python

    export = prepared_assets["tiny_qwen3"]  # a Qwen3 folder with config.json and tokenizer.json
    vocab = json.loads((export / "config.json").read_text())["vocab_size"]
    ref, out = tmp_path / "ref.safetensors", tmp_path / "check.json"
    needle = {
        "missing-reference": f"--reference {ref} does not exist",
        "reference-not-safetensors": "--reference is not a readable safetensors file",
        "reference-without-logits": f"--reference {ref} holds no logits",
        "out-a-folder": f"{out} is a folder, not a file for the check's JSON",
    }[row]
    if row == "reference-not-safetensors":
        ref.write_text("input_ids,position_ids,logits\n1,0,0.5\n")
    elif row != "missing-reference":
        _verify_reference(ref, vocab, drop="logits" if row == "reference-without-logits" else None)
    if row == "out-a-folder":
        out.mkdir()
        (out / "keep.txt").write_text("someone's")
    proc = run_module_in_process("common.harness.verifier", "verify", str(export), "--reference", str(ref),
                                 "--out", str(out))
    assert_clean_error(proc, needle)
    assert proc.returncode == 2
    if row == "out-a-folder":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()


def test_a_dataset_given_as_its_file_is_read_and_a_fifo_among_the_files_is_named(tmp_path):
    """`--dataset data/train.jsonl` (the file, not its folder) is a one-file dataset (tests/test_dataset_flags.py);
    a FIFO among a folder's training files is named (a read would block forever)."""
    from common import paths

    folder = _dataset(tmp_path, "data", b'{"text": "a sentence"}\n')
    assert paths.training_dataset(str(folder / "train.jsonl"), None) == (paths.OWN_DATA,
                                                                          str((folder / "train.jsonl").resolve()))
    os.mkfifo(folder / "train-2.jsonl")
    with pytest.raises(UserError, match="train-2.jsonl is a FIFO"):
        paths.training_dataset(str(folder), None)
