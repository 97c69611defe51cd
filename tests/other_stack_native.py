"""examples/train_native_qwen3.py on a host whose packages differ from node 0's: on the node OTHER_STACK_NODE names,
transformers reports another version (as an older image would), for the multi-node preflight's test. The same recipe,
flags and run, launched the way users launch it.

    OTHER_STACK_NODE=1 python tests/other_stack_native.py --nnodes 2 --node_rank 1 ... --out_dir OUT
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slow_native_qwen3 import lifecycle, recipe  # noqa: E402

from common import results  # noqa: E402

if os.environ.get("GROUP_RANK") == os.environ["OTHER_STACK_NODE"]:
    real = results.versions
    results.versions = lambda: {**real(), "transformers": "4.0.0"}

if __name__ == "__main__":
    sys.exit(lifecycle.run(recipe()))
