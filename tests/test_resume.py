"""Resume after a kill: a run killed with SIGKILL resumes from its last torchtitan checkpoint
with the same command and then produces the losses of an uninterrupted run; an HF export killed
half-way leaves the previous complete export (or nothing), never a half-written folder."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from conftest import ROOT, kill_after_checkpoint, read_results, run_example, script_env

SCRIPT = "train_native_qwen3.py"
RUN = ("--steps", "8", "--checkpoint_every", "2", "--no-export", "--seed", "3", "--seq_len", "64")


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, prepared_assets):
    run_example(SCRIPT, *RUN, "--out_dir", str(tmp_path / "straight"))
    straight = read_results(tmp_path / "straight")
    assert straight["steps"] == list(range(1, 9)) and straight["resumed_from_step"] == 0

    killed = tmp_path / "killed"
    kill_after_checkpoint(SCRIPT, *RUN, out_dir=killed, step=4)
    run_example(SCRIPT, *RUN, "--out_dir", str(killed))  # the same command
    resumed = read_results(killed)
    start = resumed["resumed_from_step"]
    assert start >= 4 and resumed["steps"] == list(range(start + 1, 9)), resumed["steps"]
    expected = straight["losses"][start:]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], expected)) <= 1e-5, (resumed["losses"], expected)
    # losses.jsonl keeps the killed run's steps: the whole curve (results, loss.png) spans the kill
    assert resumed["history"]["steps"] == list(range(1, 9))
    assert max(abs(a - b) for a, b in zip(resumed["history"]["losses"], straight["losses"])) <= 1e-5


def test_rerun_never_resumes_from_a_model_only_or_partial_save(tmp_path, prepared_assets):
    """torchtitan's last save is a model-only HF save (an index, no .metadata) that the export moves to
    OUT_DIR/hf_export; a run killed before that leaves it in OUT_DIR/checkpoint (made here from the export, which
    is that folder plus config and tokenizer). The same command again removes it, resumes from the last whole
    checkpoint, and trains the last steps again."""
    run = ("--steps", "4", "--checkpoint_every", "2", "--seed", "3", "--out_dir", str(tmp_path))
    run_example(SCRIPT, *run)
    first = read_results(tmp_path)
    last = tmp_path / "checkpoint" / "step-4"
    shutil.copytree(tmp_path / "hf_export", last)
    assert (last / "model.safetensors.index.json").is_file() and not (last / ".metadata").exists()
    proc = run_example(SCRIPT, *run)
    again = read_results(tmp_path)
    assert "step-4 is not a whole checkpoint" in proc.stdout
    assert again["resumed_from_step"] == 2 and again["steps"] == [3, 4], again["steps"]
    assert max(abs(a - b) for a, b in zip(again["losses"], first["losses"][2:])) <= 1e-5


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
