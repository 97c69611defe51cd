"""The disk check counts what torchtitan 0.3.0's checkpointer really holds: its own CheckpointManager saving a small
model in this process (one gloo rank), its step folders watched while it saves, against `dryrun.checkpoint_plan`."""
from __future__ import annotations

import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common import device

device.route_torchtitan_device("cpu")  # before torchtitan is imported below

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from common.errors import UserError  # noqa: E402
from common.harness import dryrun  # noqa: E402

PARAMETERS = 1_000_000


def _cfg(**kw):
    """The settings the plan reads: the recipe's (dtype, export, steps) and its guards section's."""
    top = {"dtype": "float32", "export": True, "steps": 10}
    guards = {"checkpoint_every": "1", "keep_checkpoints": 2, "async_checkpoint": False}
    return SimpleNamespace(**{**top, **{k: v for k, v in kw.items() if k in top}},
                           guards=SimpleNamespace(**{**guards, **{k: v for k, v in kw.items() if k not in top}}))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def _save_like_a_run(folder, *, steps: int, keep: int, async_mode: str) -> tuple[int, list[str]]:
    """torchtitan's checkpointer as the scripts configure it (every step, keep_latest_k, the last step's save
    model-only: the export), saving after each of `steps` steps; returns the most resumable step folders seen at
    once (a thread lists the folder every half millisecond) and the folders left."""
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=keep,
                                   async_mode=async_mode, last_save_model_only=True)
    manager = CheckpointManager(cfg, dataloader=None, model_parts=[torch.nn.Linear(256, 256)], optimizers=None,
                                lr_schedulers=None, states={}, sd_adapter=None, base_folder=str(folder))
    checkpoints, export = folder / "checkpoint", f"step-{steps}"
    most, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            names = os.listdir(checkpoints) if checkpoints.is_dir() else []
            most[0] = max(most[0], sum(1 for n in names if re.fullmatch(r"step-\d+", n) and n != export))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, steps + 1):
            manager.save(step, last_step=step == steps)
            time.sleep(0.01)  # the next training step
        manager.maybe_wait_for_saving()
        manager.close()  # the purge thread joined: every removal done
    finally:
        done.set()
        watcher.join()
    return most[0], sorted(os.listdir(checkpoints))


def test_async_saves_hold_one_checkpoint_more_than_keep_checkpoints(one_rank):
    """torchtitan lists the folders to purge right after it starts a background write, before the write makes its
    own folder: it keeps 2 older ones beside the new (3 at rest), and a 4th is being written before the oldest goes."""
    plan = dryrun.checkpoint_plan(PARAMETERS, _cfg(async_checkpoint=True))
    assert (plan["checkpoints_kept"], plan["peak_checkpoints"]) == (3, 4), plan
    assert plan["needed_bytes"] == 4 * 12 * PARAMETERS + 4 * PARAMETERS
    most, _left = _save_like_a_run(one_rank / "async", steps=10, keep=2, async_mode="async")
    assert most <= plan["peak_checkpoints"], (most, plan)
    synchronous = dryrun.checkpoint_plan(PARAMETERS, _cfg())  # 2 kept, a 3rd while it is written
    assert (synchronous["checkpoints_kept"], synchronous["peak_checkpoints"]) == (2, 3)
    most, left = _save_like_a_run(one_rank / "sync", steps=10, keep=2, async_mode="disabled")
    assert most <= synchronous["peak_checkpoints"] and left == ["step-10", "step-8", "step-9"], (most, left)


def test_the_last_steps_save_is_the_export_not_a_resumable_checkpoint(one_rank):
    """--keep_checkpoints 0 --checkpoint_every 1 --steps 100: 99 resumable saves before the export at step 100, and
    room for a stop's save (at most one: a stop ends the run), never 101."""
    plan = dryrun.checkpoint_plan(PARAMETERS, _cfg(steps=100, keep_checkpoints=0))
    assert plan["peak_checkpoints"] == 100, plan
    assert plan["needed_bytes"] == 100 * 12 * PARAMETERS + 4 * PARAMETERS
    small = dryrun.checkpoint_plan(PARAMETERS, _cfg(steps=6, keep_checkpoints=0))
    most, left = _save_like_a_run(one_rank, steps=6, keep=0, async_mode="disabled")
    assert left == [f"step-{s}" for s in range(1, 7)] and most == 5  # step-6 is the export
    assert small["peak_checkpoints"] == most + 1  # the resumable saves it holds + a stop's


def test_the_refusal_names_the_asynchronous_saves_extra_checkpoint(tmp_path):
    plan = dryrun.checkpoint_plan(10**12, _cfg(async_checkpoint=True))  # 4 checkpoints of 11 TiB: never free
    with pytest.raises(UserError, match=r"4 checkpoint\(s\) .* drop --async_checkpoint \(it holds one more\)"):
        dryrun.check_disk(tmp_path, plan)
    with pytest.raises(UserError) as synchronous:
        dryrun.check_disk(tmp_path, dryrun.checkpoint_plan(10**12, _cfg()))
    assert "async" not in str(synchronous.value)
