"""--keep_checkpoints and the disk check: a run whose saves do not fit its out_dir's filesystem is refused before the
launch, in one line, on a small real filesystem (a tmpfs); the plan's arithmetic without training."""
from __future__ import annotations

from types import SimpleNamespace

from common.harness import dryrun
from conftest import assert_clean_error, run_example, tmpfs

MIB = 2**20


def _cfg(**kw):
    """The settings the plan reads: the recipe's (dtype, export, steps) and its guards section's."""
    top = {"dtype": "float32", "export": True, "steps": 10}
    guards = {"checkpoint_every": "0", "keep_checkpoints": 2, "async_checkpoint": False}
    return SimpleNamespace(**{**top, **{k: v for k, v in kw.items() if k in top}},
                           guards=SimpleNamespace(**{**guards, **{k: v for k, v in kw.items() if k not in top}}))


def test_the_plan_counts_the_checkpoints_kept_one_being_written_and_the_export():
    p = 1_000_000
    stop_only = dryrun.checkpoint_plan(p, _cfg())  # no periodic saves: a stop's one checkpoint
    assert stop_only["peak_checkpoints"] == 1 and stop_only["needed_bytes"] == 12 * p + 4 * p
    kept2 = dryrun.checkpoint_plan(p, _cfg(checkpoint_every="2"))  # 5 saves, 2 kept, a third while it is written
    assert (kept2["checkpoints_kept"], kept2["peak_checkpoints"]) == (2, 3)
    # all 5 kept: steps 2, 4, 6, 8 and a stop's (step 10's save is the export: tests/test_checkpoint_disk_plan.py)
    every = dryrun.checkpoint_plan(p, _cfg(checkpoint_every="2", keep_checkpoints=0))
    assert every["peak_checkpoints"] == 5 and every["needed_bytes"] == 5 * 12 * p + 4 * p
    resumed = dryrun.checkpoint_plan(p, _cfg(checkpoint_every="2", dtype="bfloat16", export=True), have=2)
    assert resumed["needed_bytes"] == 1 * 12 * p + 2 * p  # two already there; a bfloat16 export
    assert dryrun.checkpoint_plan(p, _cfg(export=False))["export_bytes"] == 0
    tied = dryrun.checkpoint_plan(p, _cfg(), shape={"vocab_size": 1000, "hidden_size": 10, "tie_word_embeddings": True})
    assert tied["checkpoint_bytes"] == 12 * p + 4 * 1000 * 10  # the tied embedding saved under both its names


def test_saves_that_do_not_fit_the_out_dir_are_refused_before_the_launch(tmp_path):
    """The tiny Qwen3 (9.8 M parameters: 149 MiB a checkpoint, its tied embedding twice; 37 MiB the export) on a
    200 MiB filesystem: a stop's one checkpoint and the export fit (187 MiB), three checkpoints at the peak of
    --checkpoint_every 2 do not (485 MiB)."""
    with tmpfs(tmp_path / "small_disk", "200m") as disk:
        proc = run_example("train_native_qwen3.py", "--steps", "10", "--checkpoint_every", "2",
                           "--nproc_per_node", "2", "--out_dir", str(disk / "run"), check=False)
        assert_clean_error(proc, "not enough disk for this run's saves: 0.5 GiB needed",
                           "3 checkpoint(s) of 0.15 GiB", "lower --keep_checkpoints")
        assert not (disk / "run" / "logs").exists() and not (disk / "run" / "checkpoint").exists()  # nothing launched
