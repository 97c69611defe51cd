"""Stopping a one-process training run and resuming only the same run: --time_limit stops it before the budget
ends, its evaluation counted; a signal during an evaluation ends it at a batch and saves that step; the held-out
losses of the whole run survive the stops; a second signal during the stop save ends it at once and the previous
checkpoint stays usable; a rerun that differs from the run that wrote the checkpoints is refused in one line before
anything is built, and --steps at or below the newest checkpoint trains nothing."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from common.harness.resume import whole_checkpoints
from common.harness.stops import DEADLINE, EXIT_STOPPED
from conftest import assert_clean_error, example_command, read_results, run_example, run_in_process
from stop_helpers import ONE_RANK, SCRIPT, close, finish, start, wait_for_step


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, prepared_assets) -> tuple[Path, tuple[str, ...], dict]:
    """One process, 6 steps, never stopped: a whole checkpoint at step 3 (--checkpoint_every 3; without an export
    nothing is saved at the last step) and the losses of an uninterrupted run, as its results.json had them
    (tests below rerun into the folder). Its environment holds the launcher's DEADLINE, long past: a plain run
    is no worker of the launcher's and ignores it."""
    out = tmp_path_factory.mktemp("checkpointed")
    run = (*ONE_RANK, "--checkpoint_every", "3", "--out_dir", str(out))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DEADLINE, "1.0")  # 1970
        run_example(SCRIPT, *run)
    assert whole_checkpoints(out) == [3]
    return out, run, read_results(out)


def _held_out_batches_started(log: Path) -> int:
    """Evaluations begun, as torchtitan's log says (each builds the held-out dataloader)."""
    return log.read_text(errors="replace").count("Preparing local_validation dataset")


def test_time_limit_and_a_signal_during_an_evaluation_stop_at_once_and_the_held_out_losses_survive(
        checkpointed, tmp_path, monkeypatch):
    """Held out every 2 steps (steps 1, 2, 4, 6), three runs of the same command:

    1. --time_limit 0.2 (12 s) with no margin, --eval_steps 100000 (hours of held-out batches): the budget counts
       the evaluation, so the run stops after step 1 without evaluating it (at the step, or at the first held-out
       batch), exit 75, no held-out batch evaluated.
    2. Resumed without the limit, 3 held-out batches, each made to last 1.5 s more (tests/slow_native_qwen3.py): step 2 is
       evaluated; SIGTERM once the evaluation of step 4 has begun ends it at the next batch, saves step 4, exit 75.
    3. Resumed again: steps 5 and 6, step 6 evaluated. results.json's eval_losses holds steps 2 and 6, the one of
       step 2 as the second run had it (kept in eval_losses.jsonl), and the training losses are those of a run
       that never stopped."""
    _, _, straight = checkpointed
    out = tmp_path / "o"
    run = (*ONE_RANK, "--out_dir", str(out), "--eval_every", "2")
    # an evaluation of 100000 batches takes hours: run_example's timeout fails a run that started one
    proc = run_example(SCRIPT, *run, "--eval_steps", "100000", "--time_limit", "0.2", "--stop_margin_s", "0",
                       check=False)
    assert proc.returncode == EXIT_STOPPED, proc.stdout[-2000:] + proc.stderr[-2000:]
    first = read_results(out)
    assert first["stopped"] == {"reason": "time_limit", "step": 1, "checkpoint": str(out / "checkpoint" / "step-1")}
    assert first["eval_losses"] == [] and "validate step" not in proc.stdout + proc.stderr
    assert "run the same command again" in proc.stdout

    monkeypatch.setenv("SLOW_EVAL_BATCH_S", "1.5")
    slow = [str(Path(__file__).with_name("slow_native_qwen3.py")) if a.endswith(SCRIPT) else a
            for a in example_command(SCRIPT, *run, "--eval_steps", "3")]
    second = start(slow, tmp_path / "log2")
    monkeypatch.delenv("SLOW_EVAL_BATCH_S")
    wait_for_step(second, out, 4)
    deadline = time.monotonic() + 120
    while _held_out_batches_started(tmp_path / "log2") < 2:  # step 2's, then step 4's
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "log2").read_text()[-3000:]
        time.sleep(0.05)
    second.send_signal(signal.SIGTERM)
    log = finish(second)
    assert second.returncode == EXIT_STOPPED and "Traceback" not in log, log[-3000:]
    cut = re.search(r"\[stop\] SIGTERM: the evaluation of step 4 ended after (\d) held-out batches; saving step 4",
                    log)
    assert cut and int(cut.group(1)) < 3, log[-3000:]
    stopped = read_results(out)
    assert stopped["stopped"]["step"] == 4 and (out / "checkpoint" / "step-4" / ".metadata").is_file()
    assert [r["step"] for r in stopped["eval_losses"]] == [2], stopped["eval_losses"]

    run_example(SCRIPT, *run, "--eval_steps", "3")
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == 4 and close(resumed["history"]["losses"], straight["losses"])
    assert [r["step"] for r in resumed["eval_losses"]] == [2, 6], resumed["eval_losses"]
    assert resumed["eval_losses"][0] == stopped["eval_losses"][0]


@pytest.mark.extended
def test_a_second_signal_during_the_stop_save_ends_the_run_at_once(checkpointed, tmp_path):
    """SIGTERM, then SIGTERM again while the stop save is being written: the run ends at once with one line (exit
    143), the half-written step folder is never loaded, and the same command resumes from the last whole
    checkpoint to the uninterrupted losses. The process is paused while the second signal is sent, so the signal
    arrives mid-save and after the one-second window in which a repeat counts as the same signal."""
    _, _, straight = checkpointed
    out = tmp_path / "o"
    run = (*ONE_RANK, "--checkpoint_every", "2", "--out_dir", str(out))
    for attempt in range(3):  # the pause must land inside a save of ~0.3 s; retried, never weakened
        shutil.rmtree(out, ignore_errors=True)
        proc = start(example_command(SCRIPT, *run), tmp_path / f"log{attempt}")
        wait_for_step(proc, out, 3)
        proc.send_signal(signal.SIGTERM)
        caught = None
        while proc.poll() is None and caught is None:
            folders = sorted((out / "checkpoint").glob("step-*"))
            partial = [f for f in folders if int(f.name[5:]) > 2 and not (f / ".metadata").exists()]
            if partial:
                proc.send_signal(signal.SIGSTOP)
                caught = partial[0] if not (partial[0] / ".metadata").exists() else None
                if caught is None:
                    proc.send_signal(signal.SIGCONT)
                    break
                time.sleep(1.2)
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)
        err = finish(proc)
        if caught is not None:
            break
    assert caught is not None, "no stop save caught in progress in three runs"
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        "error: SIGTERM again: ended at once; the last complete checkpoint in the out_dir stays usable"]
    assert not (caught / ".metadata").exists()
    run_example(SCRIPT, *run)
    resumed = read_results(out)
    assert resumed["resumed_from_step"] < int(caught.name[5:])
    assert close(resumed["history"]["losses"], straight["losses"])


# ---- a resume is the same run, or it is refused ------------------------------------------------------------




def _other_data(tmp_path: Path) -> Path:
    folder = tmp_path / "other_data"
    folder.mkdir()
    (folder / "data.jsonl").write_text("".join(json.dumps({"text": f"Another sentence, number {i}."}) + "\n"
                                               for i in range(200)))
    return folder


def _other_weights(tmp_path: Path, prepared_assets) -> Path:
    folder = tmp_path / "other_weights"
    shutil.copytree(prepared_assets["tiny_qwen3"], folder)
    return folder


REFUSED = [  # (flags changed on the rerun, what the error line names)
    (("--lr", "0.03"), "--lr 0.03 (checkpoint: 0.003)"),
    (("--seq_len", "64"), "--seq_len 64 (checkpoint: 128)"),
    (("--local_batch_size", "4"), "--local_batch_size 4 (checkpoint: 2)"),
    (("--global_batch_size", "4"), "--global_batch_size 4 (checkpoint: -1)"),
    (("--dtype", "bfloat16"), '--dtype "bfloat16" (checkpoint: "float32")'),
    (("--seed", "7"), "--seed 7 (checkpoint: 0)"),
    (("--warmup_steps", "1"), "--warmup_steps 1 (checkpoint: 2)"),
    (("--flavor", "0.6B"), '--flavor "0.6B" (checkpoint: "tiny")'),
    (("--dataset", "{other_data}"), "--dataset"),
    (("--hf_checkpoint", "{other_weights}"), "--hf_checkpoint"),
    (("--nproc_per_node", "2"), "world size 2 (checkpoint: 1"),
]


@pytest.mark.parametrize("changed, named", REFUSED, ids=[" ".join(r[0][:1]) for r in REFUSED])
def test_a_rerun_that_is_not_the_same_run_is_refused(checkpointed, tmp_path, prepared_assets, changed, named):
    out, run, _ = checkpointed
    before = sorted(p.name for p in (out / "checkpoint").iterdir())
    values = {"other_data": str(_other_data(tmp_path)) if "{other_data}" in changed else "",
              "other_weights": str(_other_weights(tmp_path, prepared_assets)) if "{other_weights}" in changed else ""}
    args = [a.format(**values) for a in changed]
    proc = run_in_process(SCRIPT, *run, "--steps", "8", *args)
    assert_clean_error(proc, "was written by another run, so this one cannot resume it", named,
                       "start anew with another --out_dir")
    assert "hf_export" not in proc.stderr  # the checkpoint's run had --no-export: no weights there to continue from
    assert proc.returncode == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == before  # nothing moved or deleted


@pytest.mark.parametrize("script", ["train_hf_backend.py", "train_moe_nki.py"])
def test_another_training_script_on_the_same_out_dir_is_refused(checkpointed, script):
    out, _, _ = checkpointed
    proc = run_in_process(script, "--steps", "8", "--no-export", "--out_dir", str(out))
    assert_clean_error(proc, "written by train_native_qwen3.py, this is " + script)


def test_steps_at_or_below_the_newest_checkpoint_train_nothing_and_a_larger_steps_continues(checkpointed):
    out, run, _ = checkpointed
    for steps in ("1", "3"):
        proc = run_in_process(SCRIPT, *run, "--steps", steps)
        assert_clean_error(proc, f"nothing to train: {out / 'checkpoint' / 'step-3'} is at step 3 and --steps is "
                                 f"{steps}")
    assert (out / "checkpoint" / "step-3" / ".metadata").is_file()
    proc = run_example(SCRIPT, *run, "--steps", "5", "--checkpoint_every", "4")  # the interval may change
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == [4, 5]
    # the learning-rate schedule is torchtitan's over --steps: a shorter (or longer) run decays it otherwise
    assert "[resume] --steps 5, the checkpoint's run had 6: the learning rate's decay" in proc.stdout, proc.stdout[-2000:]
