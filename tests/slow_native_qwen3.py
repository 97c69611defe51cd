"""examples/train_native_qwen3.py with slowed guard components, for the stop tests: the same recipe, flags and run
(common.harness.lifecycle.run), launched the way users launch it (python, the scripts' own launch, torchrun), with
a checkpoint manager whose stop save sleeps SLOW_STOP_SAVE_S seconds before torchtitan's save (a large model's save
on a shared file system, at no CPU cost; every resumable save's write SLOW_SAVE_S seconds more, with
--async_checkpoint in the background write) and a validator whose held-out batches take SLOW_EVAL_BATCH_S seconds more
(a long evaluation). Both are read from this test script's environment, which torchrun passes on to the workers.

    SLOW_STOP_SAVE_S=31 python tests/slow_native_qwen3.py --nproc_per_node 2 --steps 8 --out_dir OUT
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.harness import lifecycle  # noqa: E402

STOP_SAVE_S = float(os.environ.get("SLOW_STOP_SAVE_S", "0"))
SAVE_S = float(os.environ.get("SLOW_SAVE_S", "0"))  # every resumable save, periodic ones too
EVAL_BATCH_S = float(os.environ.get("SLOW_EVAL_BATCH_S", "0"))


class SlowHooks(lifecycle.GuardHooks):
    def components(self) -> dict:
        from torchtitan.components.checkpointer.dcp import AsyncMode  # torchtitan routed by now

        made = super().components()
        checkpoint, validator = made["checkpoint"], made["validator"]

        class SlowCheckpointer(checkpoint):
            @dataclass(kw_only=True, slots=True)
            class Config(checkpoint.Config):
                pass

            def _save(self, curr_step: int, last_step: bool = False) -> bool:
                if self.stop is not None and self.stop.stopped_at == curr_step:
                    time.sleep(STOP_SAVE_S)
                return super()._save(curr_step, last_step)

            def dcp_save(self, *args, to_hf: bool = False, **kwargs):  # the write itself: timed as the save
                if to_hf or not SAVE_S:
                    return super().dcp_save(*args, to_hf=to_hf, **kwargs)
                if kwargs.get("async_mode") != AsyncMode.ASYNC:
                    time.sleep(SAVE_S)
                    return super().dcp_save(*args, to_hf=to_hf, **kwargs)
                # --async_checkpoint: the write, in torchtitan's background thread, ends SAVE_S later
                written, slowed = super().dcp_save(*args, to_hf=to_hf, **kwargs), Future()
                written.add_done_callback(lambda done: threading.Timer(SAVE_S, _pass_on, (done, slowed)).start())
                return slowed

        class SlowGate(validator.gate_class):
            def __call__(self, done: int, have: bool) -> bool:
                time.sleep(EVAL_BATCH_S)
                return super().__call__(done, have)

        class SlowValidator(validator):
            @dataclass(kw_only=True, slots=True)
            class Config(validator.Config):
                pass

            gate_class = SlowGate

        return {**made, "checkpoint": SlowCheckpointer, "validator": SlowValidator}


def _pass_on(done: Future, slowed: Future) -> None:
    error = done.exception()
    slowed.set_exception(error) if error is not None else slowed.set_result(done.result())


def recipe():
    path = ROOT / "examples" / "train_native_qwen3.py"
    spec = importlib.util.spec_from_file_location("train_native_qwen3", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.RECIPE


if __name__ == "__main__":
    sys.exit(lifecycle.run(recipe(), hooks=SlowHooks))
