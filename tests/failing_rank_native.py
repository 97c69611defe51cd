"""examples/train_native_qwen3.py whose local rank FAIL_RANK raises before it builds anything (a NeuronCore it cannot
allocate, a compiler that fails on one rank), for the rank-log tests: the same recipe, flags and run, launched the way
users launch it.

    FAIL_RANK=1 python tests/failing_rank_native.py --nproc_per_node 2 --steps 2 --out_dir OUT
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slow_native_qwen3 import lifecycle, recipe  # noqa: E402


class FailingHooks(lifecycle.GuardHooks):
    def configure(self, tc, dev, out_dir, found):
        if os.environ.get("LOCAL_RANK") == os.environ["FAIL_RANK"]:
            raise RuntimeError(f"rank {dev.rank} cannot reach its device (a failure of this rank alone)")
        return super().configure(tc, dev, out_dir, found)


if __name__ == "__main__":
    sys.exit(lifecycle.run(recipe(), hooks=FailingHooks))
