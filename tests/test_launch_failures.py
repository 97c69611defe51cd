"""The scripts' own launch (--nproc_per_node), where a failure is one line and the documented exit code, never
torchrun's failure table or traceback: a check that fails after training (the export check, --compare_losses) on
a worker ends the launch with exit 2 and its line; an OUT_DIR/logs that is no folder is refused before torchrun."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.errors import UserError
from common.harness import launcher, stops

REPO = Path(__file__).resolve().parents[1]
LINE = "losses differ from ref.json from step 2 (max abs diff 0.5, tolerance 1e-06) (details in results.json)"

# A worker as a training rank ends: rank 0's check fails after the last step (common.losses.finish_run raises it
# once results.json is written; the other ranks have ended), and the guarded run hands it to stops; what is left
# is common/cli.py's own handling of a UserError.
WORKER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from common.errors import UserError
    from common.harness import stops
    stop = stops.StopControl(end=None, margin_s=0.0, is_main=True, steps=1)
    stop.step_ended(1)  # the last step: nothing collective after it
    if os.environ["RANK"] == "0":
        try:
            raise UserError({line!r})
        except UserError as e:
            stops.exit_if_failed_after_training(e, stop)
            print(f"error: {{e}}", file=sys.stderr, flush=True)
            sys.exit(2)
""")


def _launch(tmp_path: Path, script: str) -> int:
    worker = tmp_path / "worker.py"
    worker.write_text(script)
    cfg = SimpleNamespace(guards=SimpleNamespace(nproc_per_node=2, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                                                 master_port=0))
    return launcher.self_launch(cfg, [str(worker)], tmp_path / "out")


def test_a_check_that_fails_after_training_under_the_scripts_own_launch_is_exit_2_and_one_line(tmp_path, capfd):
    code = _launch(tmp_path, WORKER.format(repo=str(REPO), line=LINE))
    out, err = capfd.readouterr()
    assert code == 2, out[-2000:] + err[-4000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [f"error: {LINE}"], err[-4000:]
    assert "ChildFailedError" not in err and "Traceback" not in err, err[-4000:]


def test_only_a_finished_workers_check_goes_to_its_launcher(tmp_path, monkeypatch):
    """Before the last step (a rank's error while the others may still be in a collective) the worker fails as any
    process does, so that torchrun ends the others; outside the scripts' own launch nothing changes either."""
    marker = tmp_path / "stopped"
    monkeypatch.setenv(stops.SELF_LAUNCHED, str(marker))
    stop = stops.StopControl(end=None, margin_s=0.0, is_main=True, steps=3)
    stops.exit_if_failed_after_training(UserError("x"), stop)  # no step yet: returns, the caller raises
    assert not marker.with_name(stops.FAILED_MARK).exists()
    stop.step_ended(3)
    with pytest.raises(SystemExit) as ended:
        stops.exit_if_failed_after_training(UserError("export check failed (a\nb)"), stop)
    assert ended.value.code == 0
    assert marker.with_name(stops.FAILED_MARK).read_text() == "error: export check failed (a\ufffdb)\n"  # one line
    monkeypatch.delenv(stops.SELF_LAUNCHED)
    stops.exit_if_failed_after_training(UserError("x"), stop)  # not a worker of the scripts' own launch


def test_an_error_every_rank_raised_at_one_agreed_point_goes_to_the_launcher_mid_run(tmp_path, monkeypatch):
    """An AgreedError (every rank raises it at the same point, from a collective decision: the held-out data has no
    batch for every rank) ends the worker for its launcher's one line even before the last step."""
    from common.errors import AgreedError

    marker = tmp_path / "stopped"
    monkeypatch.setenv(stops.SELF_LAUNCHED, str(marker))
    stop = stops.StopControl(end=None, margin_s=0.0, is_main=True, steps=3)
    stop.step_ended(1)
    with pytest.raises(SystemExit) as ended:
        stops.exit_if_failed_after_training(AgreedError("--eval_every: the held-out data holds no batch"), stop)
    assert ended.value.code == 0
    assert marker.with_name(stops.FAILED_MARK).read_text() == "error: --eval_every: the held-out data holds no batch\n"


@pytest.mark.extended
def test_held_out_data_without_a_batch_for_every_rank_under_the_scripts_own_launch_is_one_line_and_exit_2(tmp_path):
    """One short held-out document on 2 ranks of the scripts' own launch, evaluated at step 1 of 3: the documented
    line once, exit 2, no IndexError and no torchrun failure table."""
    from conftest import assert_clean_error, run_example

    held_out = tmp_path / "held_out"
    held_out.mkdir()
    (held_out / "validation.jsonl").write_text('{"text": "A short document."}\n')
    proc = run_example("train_native_qwen3.py", "--steps", "3", "--nproc_per_node", "2", "--no-export",
                       "--eval_every", "2", "--eval_dataset_path", str(held_out), "--out_dir", str(tmp_path / "o"),
                       check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert_clean_error(proc, "the held-out data holds no batch")
    assert "ChildFailedError" not in proc.stderr and "IndexError" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["file", "dangling link", "node folder a file"])
def test_an_out_dir_logs_that_is_no_folder_is_refused_before_torchrun(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    logs = out / "logs"
    if kind == "file":
        logs.write_text("mine\n")
    elif kind == "dangling link":
        logs.symlink_to(tmp_path / "gone")
    else:
        (logs / "node0").parent.mkdir()
        (logs / "node0").write_text("mine\n")
    where = logs / "node0" if kind == "node folder a file" else logs
    what = "a symbolic link to nothing" if kind == "dangling link" else "a file"
    with pytest.raises(UserError, match=rf"^{where} is {what}, not a folder: the scripts' own launch keeps each "
                                        r"rank's output there; move it out of --out_dir"):
        _launch(tmp_path, "raise SystemExit('never started')\n")
    assert sorted(p.name for p in out.iterdir()) == ["logs"]  # torchrun never started: no launch folder


def test_a_loss_comparison_that_fails_under_the_scripts_own_launch_is_one_line_and_exit_2(tmp_path):
    """The training script itself, 2 processes of its own launch: --compare_losses against a reference it cannot
    match fails after the last step with its one line, exit 2, and no torchrun failure table."""
    from conftest import assert_clean_error, run_example

    reference = tmp_path / "ref.json"
    reference.write_text('{"losses": [1.0, 1.0]}')
    proc = run_example("train_native_qwen3.py", "--steps", "2", "--nproc_per_node", "2", "--no-export",
                       "--seq_len", "32", "--local_batch_size", "1", "--compare_losses", str(reference),
                       "--out_dir", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert_clean_error(proc, "losses differ from")
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr, proc.stderr[-3000:]


def test_held_out_rows_fewer_than_the_ranks_split_without_an_index_error(monkeypatch):
    """torchtitan splits a map-style held-out dataset over the ranks by contiguous slices (datasets'
    split_dataset_by_node): one row on 2 ranks was an IndexError on rank 1. As an iterable dataset rank 1 gets no
    row, which the validator's gate reports in one line."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    from common.harness.evaluation import splittable

    monkeypatch.setenv("WORLD_SIZE", "2")
    rows = splittable(Dataset.from_list([{"text": "short"}]))
    assert [list(split_dataset_by_node(rows, rank, 2)) for rank in (0, 1)] == [[{"text": "short"}], []]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(splittable(Dataset.from_list([{"text": "short"}])), Dataset)  # enough rows: as it was
