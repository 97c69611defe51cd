"""Resume after a kill: a run killed with SIGKILL resumes from its last torchtitan checkpoint
with the same command and then produces the losses of an uninterrupted run, never from a model-only save newer
than that checkpoint; an HF export killed
half-way leaves the previous complete export (or nothing), never a half-written folder."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, kill_after_checkpoint, read_results, run_example, script_env

SCRIPT = "train_native_qwen3.py"
# The shared tiny run's training (conftest.SHARED_RUNS["native_tiny"]: the tiny preset, 10 steps; its held-out
# losses, TensorBoard and loss comparison change nothing it trains), saved every 4 steps and exported.
RUN = ("--preset", "tiny", "--steps", "10", "--checkpoint_every", "4")


@pytest.fixture(scope="module")
def killed(tmp_path_factory, shared_run) -> dict:
    """RUN SIGKILLed once its step-4 checkpoint is complete; in its checkpoint folder then a model-only save of the
    last step (torchtitan's last save, which the export moves to OUT_DIR/hf_export: a run killed between the two
    leaves it there; here the shared tiny run's export, which is that folder plus config and tokenizer); then the
    same command again, to the end."""
    tiny, straight = shared_run("native_tiny")
    out = tmp_path_factory.mktemp("resume") / "killed"
    kill_after_checkpoint(SCRIPT, *RUN, out_dir=out, step=4)
    last = out / "checkpoint" / "step-10"
    shutil.copytree(tiny / "hf_export", last)
    model_only = (last / "model.safetensors.index.json").is_file() and not (last / ".metadata").exists()
    proc = run_example(SCRIPT, *RUN, "--out_dir", str(out))  # the same command
    return {"straight": straight, "model_only": model_only, "proc": proc, "resumed": read_results(out)}


def test_resume_after_sigkill_matches_uninterrupted_run(killed):
    straight, resumed = killed["straight"], killed["resumed"]
    assert straight["steps"] == list(range(1, 11)) and straight["resumed_from_step"] == 0
    start = resumed["resumed_from_step"]
    assert start >= 4 and resumed["steps"] == list(range(start + 1, 11)), resumed["steps"]
    expected = straight["losses"][start:]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], expected)) <= 1e-5, (resumed["losses"], expected)
    # losses.jsonl keeps the killed run's steps: the whole curve (results, loss.png) spans the kill
    assert resumed["history"]["steps"] == list(range(1, 11))
    assert max(abs(a - b) for a, b in zip(resumed["history"]["losses"], straight["losses"])) <= 1e-5


def test_rerun_never_resumes_from_a_model_only_or_partial_save(killed):
    """The killed run's folder with a model-only save of step 10 (an index, no .metadata) after its whole step-4
    checkpoint: the same command removes it, says so, and resumes from the last whole checkpoint (the losses above:
    the uninterrupted run's)."""
    assert killed["model_only"]
    assert "step-10 is not a whole checkpoint" in killed["proc"].stdout
    assert killed["resumed"]["resumed_from_step"] in (4, 8) and killed["resumed"]["steps"][-1] == 10


_EXPORT_LOOP = r"""
import shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from common.export import complete_export
src, work = Path(sys.argv[2]), Path(sys.argv[3])
cfg = __import__("json").loads((src / "config.json").read_text())
print("ready", flush=True)
i = 0
while True:
    step = work / f"step-{i}"
    shutil.copytree(src, step)
    complete_export(step, work / "hf_export", cfg, src, {"loop": str(i)})
    i += 1
"""


def test_killed_export_leaves_a_complete_folder_or_none(tmp_path, prepared_assets):
    from transformers import AutoModelForCausalLM

    src = prepared_assets["tiny_qwen3"]
    for delay in (0.3, 1.1, 2.3):
        work = tmp_path / f"w{delay}"
        work.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", _EXPORT_LOOP, str(ROOT), str(src), str(work)],
                                stdout=subprocess.PIPE, text=True, env=script_env())
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        export = work / "hf_export"
        if export.exists():  # whatever the kill interrupted, the visible folder is a whole export
            assert json.loads((export / "config.json").read_text())["qwen3_recipes_versions"]["loop"]
            AutoModelForCausalLM.from_pretrained(export)
            assert (export / "tokenizer.json").is_file()


def test_a_run_starting_anew_over_a_finished_run_says_it_replaces_it(tmp_path, capsys, monkeypatch):
    """A finished run's folder (results.json, not stopped) and no checkpoint to resume: the rerun says it replaces
    the results and the export; a stopped run's folder (which it would resume) and an empty one say nothing."""
    import json

    from common.harness import lifecycle, stops

    monkeypatch.delenv(stops.SELF_LAUNCHED, raising=False)
    lifecycle.say_replaced(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"stopped": {"reason": "SIGTERM"}}))
    lifecycle.say_replaced(tmp_path)
    assert capsys.readouterr().out == ""
    (tmp_path / "results.json").write_text(json.dumps({"stopped": None, "losses": [1.0]}))
    (tmp_path / "hf_export").mkdir()
    lifecycle.say_replaced(tmp_path)
    out = capsys.readouterr().out
    assert out.startswith(f"[rerun] {tmp_path} holds a finished run's results") and "and its hf_export" in out


def test_a_rerun_over_a_finished_run_says_where_it_starts(tmp_path, capsys, monkeypatch):
    """A finished run (results.json to step 3, not stopped) keeps no whole checkpoint of its last step. A rerun says
    in one line where it starts: anew from step 1 (no checkpoint; with the export's weights as the way to train on),
    or from the newest whole checkpoint before the last step, naming the steps trained again; a checkpoint written
    after the results (a later run's, killed since) is resumed without claiming it retrains the finished run."""
    import json

    from common.harness import lifecycle, stops

    monkeypatch.delenv(stops.SELF_LAUNCHED, raising=False)
    (tmp_path / "hf_export").mkdir()
    (tmp_path / "hf_export" / "config.json").write_text("{}")
    step = tmp_path / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    os.utime(step / ".metadata", ns=(10**18, 10**18))  # written before the results
    (tmp_path / "results.json").write_text(json.dumps({"stopped": None, "steps": [1, 2, 3]}))
    lifecycle.say_replaced(tmp_path, None)
    anew = capsys.readouterr().out
    assert anew.count("\n") == 1 and f"[rerun] {tmp_path} holds a finished run's results (to step 3, " in anew
    assert ("this run starts anew from step 1 (no whole checkpoint to resume: a finished run's last save is its "
            "export, model-only) and replaces them and its hf_export; to train on from its last weights instead "
            f"(optimizer and schedule anew), --hf_checkpoint {tmp_path / 'hf_export'} with another --out_dir") in anew
    lifecycle.say_replaced(tmp_path, 1)
    again = capsys.readouterr().out
    assert ("this run resumes from step 1, the newest whole checkpoint (a finished run's last save is its export, "
            "model-only), trains steps 2 to 3 again and replaces them and its hf_export; choose another --out_dir "
            "to keep both") in again, again
    os.utime(step / ".metadata", ns=(4 * 10**18, 4 * 10**18))  # written after the results: a later run's
    lifecycle.say_replaced(tmp_path, 1)
    later = capsys.readouterr().out
    assert "resumes from step 1" in later and "again" not in later, later


def test_train_longer_after_a_finished_run_says_it_resumes_before_its_last_step(tmp_path):
    """The issue's "train longer": 2 steps saved at step 1, then --steps 3 in the same out_dir. The rerun resumes
    from step 1 (the finished run's last save is no resumable checkpoint) and says so before anything trains."""
    out = tmp_path / "o"
    common = ("--checkpoint_every", "1", "--no-export", "--seq_len", "64", "--out_dir", str(out))
    run_example(SCRIPT, "--steps", "2", *common)
    proc = run_example(SCRIPT, "--steps", "3", *common)
    rerun = [line for line in proc.stdout.splitlines() if line.startswith("[rerun]")]
    assert len(rerun) == 1, proc.stdout[-3000:]
    assert "holds a finished run's results (to step 2, " in rerun[0], rerun
    assert "this run resumes from step 1, the newest whole checkpoint" in rerun[0] and "trains step 2 again" in \
        rerun[0], rerun
    assert read_results(out)["resumed_from_step"] == 1
