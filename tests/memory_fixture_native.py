"""examples/train_native_qwen3.py with a fixture memory reader in place of the project's CPU device shim, for
tests/test_pilot.py: the same recipe and run (common.harness.lifecycle.run), whose device memory peak is scripted.

Like a real allocator's, the fixture's peak is the most allocated since the last `reset_peak_memory_stats` (which
torchtitan's MetricsProcessor calls after every logged step); each read of it stands for one step's allocations:
MEMORY_FIXTURE_GIB (comma-separated, the first read first) GiB, the last figure for every later read. With
"1,7,1" step 2 of 3 is the heaviest: a run that reads the peak once, after training, sees 1 GiB; one that
reads it at every step before torchtitan's reset sees 7.

    MEMORY_FIXTURE_GIB=1,7,1 python tests/memory_fixture_native.py --steps 3 --no-export --out_dir OUT

torchtitan is imported here, after the route to the CPU: the fixture replaces the memory functions of the one shim
torchtitan holds.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import device  # noqa: E402
from common.harness import lifecycle  # noqa: E402
from slow_native_qwen3 import recipe  # noqa: E402

WINDOWS = [float(x) * device.GIB for x in os.environ.get("MEMORY_FIXTURE_GIB", "1").split(",")]


class FixtureMemory:
    """The project's CPU shim (common.device), its peak reading scripted."""

    def __init__(self, shim):
        self.shim, self.peak, self.reads = shim, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.shim, name)

    def _allocate(self) -> float:
        self.peak = max(self.peak, WINDOWS[min(self.reads, len(WINDOWS) - 1)])
        self.reads += 1
        return self.peak

    def max_memory_allocated(self, device=None) -> int:
        return int(self._allocate())

    def memory_stats(self, device=None) -> dict:
        return dict.fromkeys(("active_bytes.all.peak", "reserved_bytes.all.peak"), int(self.peak))

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = 0.0


_shim = device._cpu_device_module
device._cpu_device_module = lambda: FixtureMemory(_shim())  # what common.device routes torchtitan to on CPU
device.peak_memory_bytes = lambda device_type: int(FixtureMemory(_shim())._allocate())  # and reads itself

# torchtitan's modules copy its device module when they are imported: the shim the route gives it gets the
# fixture's memory functions in place, seen by every copy.
device.route_torchtitan_device("cpu")
import torchtitan.tools.utils as tt_utils  # noqa: E402

_fixture = FixtureMemory(tt_utils.device_module)
for _name in ("max_memory_allocated", "memory_stats", "reset_peak_memory_stats"):
    setattr(tt_utils.device_module, _name, getattr(_fixture, _name))

if __name__ == "__main__":
    sys.exit(lifecycle.run(recipe()))
