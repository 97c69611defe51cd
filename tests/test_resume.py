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
