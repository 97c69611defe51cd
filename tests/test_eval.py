"""Held-out loss during training (`--eval_every N --eval_steps K`, common/harness/evaluation.py): torchtitan's own
Validator on data the training stream never holds, its losses in results.json's `eval_losses` and loss.png; and
the same run's TensorBoard log (--tensorboard)."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from common.harness import evaluation
from common.errors import UserError
from conftest import GOLDEN_DIR, GOLDEN_TOL, assert_clean_error, run_example, run_in_process

from common import device  # noqa: E402

# before the in-process tests import torchtitan (it binds its device at import): a training run in this process
# after them (--device auto) would otherwise find it bound to another device
device.route_torchtitan_device(device.resolve_device_type("auto"))

STEPS, EVAL_EVERY, EVAL_STEPS, LOCAL_BATCH, SEQ_LEN = 10, 2, 2, 2, 128  # the tiny preset's batch and length
WINDOW = 32  # tokens: a held-out window found in the training stream is a leak
MIN_PIECE = 40  # characters: a held-out paragraph (piece) this long found in the training text is a leak


@pytest.fixture(scope="module")
def native_eval(shared_run):
    """The native tiny run (conftest.SHARED_RUNS): --steps 10 --eval_every 2 --eval_steps 2 --tensorboard."""
    out, res = shared_run("native_tiny")
    assert res["config"]["steps"] == STEPS and res["config"]["eval_every"] == EVAL_EVERY
    assert res["config"]["eval_steps"] == EVAL_STEPS
    return out, res, (out.parent / "native_tiny.log").read_text()


def test_held_out_loss_at_step_1_and_every_n_steps_and_it_falls(native_eval):
    out, res, log = native_eval
    evals = res["eval_losses"]
    assert [r["step"] for r in evals] == [1, 2, 4, 6, 8, 10]  # torchtitan validates at step 1 and every freq
    losses = [r["loss"] for r in evals]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.3, losses  # measured 11.92 -> 11.11
    # the numbers are torchtitan's own: its "validate step" log lines print them (4 decimals)
    logged = [(int(s), float(x)) for s, x in
              re.findall(r"validate step:\s*(\d+)\s.*?loss:\s*([\d.]+)", re.sub(r"\x1b\[[0-9;]*m", "", log))]
    assert [s for s, _ in logged] == [r["step"] for r in evals]
    assert all(abs(x - r["loss"]) < 1e-4 for (_, x), r in zip(logged, evals)), (logged, evals)
    # validating changes nothing in training: the training losses are the golden ones of the run without it
    golden = json.loads((GOLDEN_DIR / "train_native_qwen3.tiny.json").read_text())["losses"]
    assert max(abs(a - b) for a, b in zip(res["losses"], golden)) <= GOLDEN_TOL
    assert (out / "loss.png").stat().st_size > 1000


def test_tensorboard_losses_equal_results_json(native_eval):
    """--tensorboard: torchtitan's own TensorBoard logger writes OUT_DIR/tb; its loss scalars, read with
    TensorBoard's own reader, are the losses in results.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, r, _ = native_eval
    (run_dir,) = list((out / "tb").iterdir())
    events = EventAccumulator(str(run_dir))
    events.Reload()
    loss = events.Scalars("loss_metrics/global_avg_loss")
    assert [e.step for e in loss] == r["steps"]
    assert all(math.isclose(e.value, x, rel_tol=1e-6) for e, x in zip(loss, r["losses"])), (loss, r["losses"])
    assert "mfu(%)" in events.Tags()["scalars"]


def test_off_by_default(shared_run):
    _, res = shared_run("native_2_ranks_8_steps")  # no --eval_every
    assert res["eval_losses"] == []


def _texts(loader, folder: str) -> list[str]:
    return [row["text"] for row in loader(folder)]


def leaks(folder: str, tokenizer_dir: Path, *, steps: int = STEPS, eval_steps: int = EVAL_STEPS, train: str = "c4_test",
          held: str = evaluation.LOCAL_VALIDATION) -> list[str]:
    """Where the held-out data of `folder` (what the validator reads) occurs in its training data: texts read with
    torchtitan's own dataset loaders (`train`'s for training, `held`'s for the validator), then the token streams
    torchtitan's text dataset yields for `steps` training steps and one validation of `eval_steps` batches."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    evaluation.register_local_validation()
    train_name, held_name = train, held
    train = _texts(DATASETS[train_name].loader, folder)
    held_out = _texts(DATASETS[held_name].loader, folder)
    found = [f"held-out document {i} is a training document" for i, t in enumerate(held_out) if t in set(train)]
    joined = "\n".join(train)
    found += [f"held-out text {piece[:50]!r}... is in the training text" for doc in held_out
              for piece in doc.split("\n") if len(piece) >= MIN_PIECE and piece in joined]

    tok = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir))

    def stream(name: str, samples: int) -> list[list[int]]:
        ds = iter(HuggingFaceTextDataset(name, folder, tok, seq_len=SEQ_LEN, infinite=True))
        return [next(ds)[0]["input"].tolist() for _ in range(samples)]

    seen = {tuple(s[i:i + WINDOW]) for s in stream(train_name, steps * LOCAL_BATCH) for i in range(SEQ_LEN - WINDOW + 1)}
    validated = stream(held_name, eval_steps * LOCAL_BATCH)
    found += [f"validation sample {n} shares {WINDOW} tokens with the training stream" for n, s in enumerate(validated)
              if any(tuple(s[i:i + WINDOW]) in seen for i in range(SEQ_LEN - WINDOW + 1))]
    first = tok.decode(validated[0][1:64])  # after the document's first token: the decoded prefix of held-out text
    if first not in "\n".join(held_out):
        found.append(f"the validator's first sample {first[:60]!r} is not held-out text")
    return found


def test_held_out_texts_never_occur_in_the_training_stream(native_eval, prepared_assets):
    out, res, log = native_eval
    folder = json.loads((out / "checkpoint" / "run.json").read_text())["dataset"][1]  # what the run trained on
    assert f"the validation split of {folder}" in log  # what its validator read
    assert leaks(folder, prepared_assets["tokenizer"]) == []


def test_the_leak_check_catches_held_out_data_that_training_reads(tmp_path, prepared_assets):
    """The check above fails when the held-out file is the training file (its first 300 documents: more than 10
    steps of 2 x 128 tokens), or shares one document with it."""
    corpus = prepared_assets["corpus"]
    lines = (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    same = tmp_path / "same"
    same.mkdir()
    (same / "train.jsonl").write_text("".join(lines[:300]), encoding="utf-8")
    shutil.copy(same / "train.jsonl", same / "validation.jsonl")
    found = leaks(str(same), prepared_assets["tokenizer"])
    assert any("is a training document" in f for f in found) and any("tokens with the training" in f for f in found)

    one = tmp_path / "one"
    one.mkdir()
    (one / "train.jsonl").write_text("".join(lines[:300]), encoding="utf-8")
    held = (corpus / "validation.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (one / "validation.jsonl").write_text("".join([*held[:5], lines[250]]), encoding="utf-8")
    found = leaks(str(one), prepared_assets["tokenizer"], steps=1, eval_steps=1)
    assert found and all("held-out document 5 " in f or "is in the training text" in f for f in found), found


@pytest.mark.parametrize("run", ["hf_tiny", "moe_tiny_2_ranks"])
def test_other_training_paths_record_the_held_out_loss(run, shared_run):
    """train_hf_backend.py (10 steps) and train_moe_nki.py (6 steps on 2 processes; conftest.SHARED_RUNS), validated
    at step 1 and every 2 steps, the last step's validation before the export: the export and its check (and the HF
    backend's tied-embedding check) see the model as training left it (EvalRecorder re-shards)."""
    res = shared_run(run)[1]
    evals = res["eval_losses"]
    steps = {"hf_tiny": 10, "moe_tiny_2_ranks": 6}[run]
    assert res["steps"][-1] == steps and [r["step"] for r in evals] == [1, *range(2, steps + 1, 2)]
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    assert res["export_check"]["passed"] is True, res["export_check"]


def test_bad_eval_flags_are_one_error_line(tmp_path):
    assert_clean_error(run_in_process("train_native_qwen3.py", "--eval_every", "-1", "--out_dir", str(tmp_path)),
                       "--eval_every must not be negative")
    assert_clean_error(run_in_process("train_moe_nki.py", "--eval_every", "2", "--eval_steps", "0", "--out_dir",
                                      str(tmp_path)), "--eval_steps must be positive")
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    assert_clean_error(run_in_process("train_native_qwen3.py", "--eval_dataset_path", str(held_out), "--out_dir",
                                      str(tmp_path / "o")), "is read only with --eval_every N")
    assert not (tmp_path / "o").exists()  # refused before the out_dir is made


def test_eval_steps_past_the_held_out_data_read_it_once(tmp_path, prepared_assets):
    """--eval_steps 100000 on a held-out file of two short documents: torchtitan's validator would loop them for
    hours; each evaluation reads them once (a few batches) and the first says how many there are. One step,
    evaluated at step 1."""
    data = tmp_path / "data"
    data.mkdir()
    corpus = prepared_assets["corpus"]
    lines = (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:40]), encoding="utf-8")
    (data / "validation.jsonl").write_text("".join(json.dumps({"text": f"Held-out document {i}. " * 60}) + "\n"
                                                   for i in range(2)), encoding="utf-8")
    out = tmp_path / "o"
    proc = run_example("train_native_qwen3.py", "--steps", "1", "--no-export", "--dataset", str(data),
                       "--eval_every", "1", "--eval_steps", "100000", "--out_dir", str(out), timeout=300)
    said = re.findall(r"\[eval\] the held-out data gives every rank (\d+) batches: each evaluation reads them once "
                      r"\(\d+ batches, not --eval_steps 100000\)", proc.stdout)
    assert len(said) == 1 and 1 <= int(said[0]) <= 4, proc.stdout[-3000:]
    evals = json.loads((out / "results.json").read_text())["eval_losses"]
    assert [r["step"] for r in evals] == [1] and math.isfinite(evals[0]["loss"]), evals


def test_a_local_held_out_folder_is_read_and_one_without_a_split_is_one_line(tmp_path):
    """--eval_dataset_path reads a local folder's validation split (for c4_test, whose folder has none); a folder
    without one is one error line."""
    from common.harness.evaluation import LOCAL_VALIDATION, eval_dataset

    train = tmp_path / "c4_like"
    train.mkdir()
    (train / "data.json").write_text('{"text": "a training document"}\n')
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    (held_out / "validation.jsonl").write_text('{"text": "a held-out document"}\n')
    assert eval_dataset(("c4_test", str(train)), str(held_out))[:2] == (LOCAL_VALIDATION, str(held_out.resolve()))
    with pytest.raises(UserError, match="has no validation split"):
        eval_dataset(("c4_test", str(train)), str(train))


def _held_out(folder: Path, case: str) -> Path:
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "a training document"}) + "\n")
    target = folder / "validation.jsonl"
    if case == "empty":
        target.write_text("")
    elif case == "not UTF-8":
        target.write_bytes(b"\xff\xfe\x00garbage\x81\n")
    elif case == "no text field":
        target.write_text(json.dumps({"content": "held out"}) + "\n")
    elif case == "only empty texts":
        target.write_text(json.dumps({"text": "  "}) + "\n")
    elif case == "a FIFO":
        import os

        os.mkfifo(target)
    return folder


@pytest.mark.parametrize("case, needle", [
    ("empty", "holds no non-empty 'text'"), ("not UTF-8", "cannot be read as JSON lines"),
    ("no text field", "cannot be read as JSON lines with a 'text' field"),
    ("only empty texts", "holds no non-empty 'text'"),
    ("a FIFO", "validation.jsonl is a FIFO"),
])
def test_held_out_data_is_read_before_anything_is_built(tmp_path, case, needle):
    """Held-out data is read as the training data is, before a launch: until a held-out text turns up. Each way it
    can fail is one UserError naming the folder, from --eval_dataset_path and from the training folder's own split
    (torchtitan's validator would fail after step 1 with StopIteration, KeyError 'text' or a decode error)."""
    folder = _held_out(tmp_path / "data", case)
    with pytest.raises(UserError, match=re.escape(needle)) as given:
        evaluation.eval_dataset(("c4_test", str(tmp_path)), str(folder), read=True)
    assert "--eval_dataset_path" in str(given.value)
    with pytest.raises(UserError, match=re.escape(needle)):
        evaluation.eval_dataset(("c4_test", str(folder)), read=True)
    good = tmp_path / "good"
    good.mkdir()
    (good / "validation.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    assert evaluation.eval_dataset(("c4_test", str(folder)), str(good), read=True)[0] == "local_validation"


def test_text_less_held_out_data_is_one_line_before_step_1(tmp_path):
    folder = _held_out(tmp_path / "data", "no text field")
    out = tmp_path / "o"
    proc = run_in_process("train_native_qwen3.py", "--steps", "1", "--eval_every", "1", "--eval_dataset_path",
                          str(folder), "--out_dir", str(out))
    assert_clean_error(proc, "cannot be read as JSON lines with a 'text' field")
    assert not (out / "losses.jsonl").exists() and not (out / "results.json").exists()


def _own_data(folder: Path, corpus: Path, documents: int = 300) -> list[str]:
    """A folder of the user's own data without a validation split: train.jsonl, `documents` of the corpus from its
    301st (its first 300 repeat paragraphs between documents, Moby-Dick's extracts: text repeated inside the user's
    data is no leak of the share, but the check below could not tell)."""
    folder.mkdir()
    lines = (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[300:300 + documents]
    (folder / "train.jsonl").write_text("".join(lines), encoding="utf-8")
    return [json.loads(line)["text"] for line in lines]


def test_own_data_without_a_validation_split_is_held_out_from_its_own_files(tmp_path, monkeypatch, prepared_assets):
    """--eval_every on --dataset FOLDER without validation*.jsonl once streamed allenai/c4's validation split (the
    "held-out loss" of your data was C4's; offline, a traceback after step 1). The held-out data is a
    share of the folder's own documents, every HELD_OUT_EVERY-th, which training never reads, online or not."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from common import paths

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    texts = _own_data(tmp_path / "data", prepared_assets["corpus"])
    found = paths.training_dataset(str(tmp_path / "data"), None)
    name, path, what = evaluation.eval_dataset(found, read=True)
    assert name != "c4_validation" and path == str((tmp_path / "data").resolve()), (name, path, what)
    assert "every 100th document" in what and "training never reads" in what
    evaluation.register_held_out_share()
    paths.register_own_data()
    every = paths.HELD_OUT_EVERY
    assert [r["text"] for r in DATASETS[name].loader(path)] == texts[every - 1::every]  # documents 100, 200, 300
    assert [r["text"] for r in DATASETS[found[0]].loader(found[1])] == [
        t for i, t in enumerate(texts) if i % every != every - 1]


def test_the_held_out_share_never_occurs_in_the_training_stream(tmp_path, prepared_assets):
    from common import paths

    _own_data(tmp_path / "data", prepared_assets["corpus"])
    name, folder = paths.training_dataset(str(tmp_path / "data"), None)
    evaluation.register_held_out_share()
    paths.register_own_data()
    assert leaks(folder, prepared_assets["tokenizer"], train=name, held=evaluation.HELD_OUT_SHARE, eval_steps=1) == []


def test_own_data_too_small_for_a_held_out_share_is_one_line(tmp_path, prepared_assets):
    from common import paths

    _own_data(tmp_path / "data", prepared_assets["corpus"], documents=paths.HELD_OUT_EVERY - 1)
    found = paths.training_dataset(str(tmp_path / "data"), None)
    with pytest.raises(UserError, match="holds fewer than 100 documents, so its held-out share is empty: "
                                        "add a validation"):
        evaluation.eval_dataset(found, read=True)


def test_c4_test_without_a_validation_split_never_streams_the_hub(tmp_path, monkeypatch):
    """torchtitan's c4_test folder holds data.json only, read whole as torchtitan reads it: its held-out data is
    --eval_dataset_path's, and without one the run is refused in one line, online too (it streamed allenai/c4)."""
    (tmp_path / "data.json").write_text(json.dumps({"text": "one document"}) + "\n")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(UserError, match="has no validation split.*give --eval_dataset_path"):
        evaluation.eval_dataset(("c4_test", str(tmp_path)))
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    (held_out / "validation.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    assert evaluation.eval_dataset(("c4_test", str(tmp_path)), str(held_out))[:2] == (
        evaluation.LOCAL_VALIDATION, str(held_out.resolve()))


def test_a_run_on_own_data_evaluates_its_held_out_share_without_the_hub(tmp_path, prepared_assets):
    """One step on a folder without a validation split, --eval_every 1, HF_HUB_OFFLINE unset: no Hub, exit 0, a
    finite held-out loss at step 1 (before: step 1 trained, then Hub retries and a traceback)."""
    import os

    _own_data(tmp_path / "data", prepared_assets["corpus"])
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    out = tmp_path / "o"
    proc = run_in_process("train_native_qwen3.py", "--steps", "1", "--no-export", "--dataset", str(tmp_path / "data"),
                          "--eval_every", "1", "--eval_steps", "1", "--out_dir", str(out), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out share of" in proc.stdout + proc.stderr
    evals = json.loads((out / "results.json").read_text())["eval_losses"]
    assert [r["step"] for r in evals] == [1] and math.isfinite(evals[0]["loss"]), evals


def test_own_data_is_given_to_torchtitan_and_its_share_named_without_eval(tmp_path, prepared_assets):
    """Without --eval_every the held-out share is still left out of training (the training data never depends on
    whether a run evaluates): the run's notes say so, and torchtitan's dataloader finds the training data's name."""
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.trainer import Trainer

    from common import paths

    _own_data(tmp_path / "data", prepared_assets["corpus"])
    found = paths.training_dataset(str(tmp_path / "data"), None)
    tc = Trainer.Config()
    note = evaluation.apply_eval_settings(tc, 0, 4, found)
    assert not tc.validator.enable
    assert note == (f"data: every 100th document of {found[1]} is its held-out share, not trained on (--eval_every "
                    "evaluates on it)")
    assert found[0] == paths.OWN_DATA and paths.OWN_DATA in DATASETS
