"""--dataset and --dataset_path (common/paths.py training_dataset): --dataset_path is read only for c4_test and
refused with any other dataset; --dataset takes a single JSON-lines file as well as a folder, with the same
checks."""
from __future__ import annotations

import json
import os
import re

import pytest

from common import paths
from common.errors import UserError
from conftest import assert_clean_error, run_in_process

from common import device  # noqa: E402

# before the in-process tests import torchtitan (it binds its device at import): a training run in this process
# after them (--device auto) would otherwise find it bound to another device
device.route_torchtitan_device(device.resolve_device_type("auto"))


def _folder(path, texts=("a training document",)):
    path.mkdir()
    (path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("dataset", ["corpus", "FOLDER"])
def test_dataset_path_with_another_dataset_than_c4_test_is_refused(dataset, tmp_path):
    """It was ignored silently: `--dataset corpus --dataset_path D` trained on the corpus."""
    other = _folder(tmp_path / "other")
    dataset = str(_folder(tmp_path / "data")) if dataset == "FOLDER" else dataset
    with pytest.raises(UserError, match=re.escape(f"--dataset_path {other} is read only with --dataset c4_test")):
        paths.training_dataset(dataset, str(other))
    assert paths.training_dataset("c4_test", str(other)) == ("c4_test", str(other.resolve()))


def test_dataset_path_alone_is_one_error_line_before_the_out_dir(tmp_path):
    other = _folder(tmp_path / "other")
    out = tmp_path / "o"
    proc = run_in_process("train_native_qwen3.py", "--dataset_path", str(other), "--out_dir", str(out))
    assert_clean_error(proc, "--dataset_path", "--dataset c4_test")
    assert not (out / "results.json").exists()


def test_a_jsonl_file_is_a_one_file_dataset(tmp_path):
    """`--dataset my.jsonl` trains on that file (it said "pass its folder"), read by torchtitan's text dataset."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    data = tmp_path / "my.jsonl"
    texts = [f"document {i}: the quick brown fox" for i in range(paths.HELD_OUT_EVERY + 1)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    name, path = paths.training_dataset(str(data), None)
    paths.register_own_data()
    assert path == str(data.resolve())
    # the held-out share (every 100th document) is left out, as from a folder without a validation split
    assert [r["text"] for r in DATASETS[name].loader(path)] == texts[:99] + texts[100:]


@pytest.mark.parametrize("content, needle", [
    (b"", "holds no non-empty 'text'"),
    (b'{"content": "a sentence"}\n', "cannot be read as JSON lines with a 'text' field"),
    (bytes(range(256)) * 16, "cannot be read as JSON lines"),
])
def test_a_bad_jsonl_file_is_one_error(content, needle, tmp_path):
    data = tmp_path / "my.jsonl"
    data.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(f"dataset file {data}") + ".*" + re.escape(needle)):
        paths.training_dataset(str(data), None)


def test_a_file_that_is_not_json_lines_or_not_a_file_is_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n")
    with pytest.raises(UserError, match=re.escape(f"--dataset {text} is a file but not JSON lines")):
        paths.training_dataset(str(text), None)
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=re.escape(f"--dataset {fifo} is a FIFO")):
        paths.training_dataset(str(fifo), None)
