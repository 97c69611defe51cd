"""The stop guards' parts that need no training run. The runs that stop: tests/test_stop.py,
tests/test_stop_one_process.py."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import ROOT, script_env
from stop_helpers import alive


PLAN_PARENT = """
import fcntl, os, sys, time
sys.path.insert(0, sys.argv[1])
from common.harness import pilot
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)  # as the out_dir lock is held when the run plans
print(pilot._plan_in_a_child(lambda: time.sleep(120) or 1, "cpu", lambda device: None), flush=True)
"""


def test_the_dry_run_plans_child_dies_with_the_run(tmp_path):
    """kill -9 of a run while its dry-run plan child plans (pilot._plan_in_a_child; the plan here is a sleep of
    two minutes): the child dies with it at once, so the out_dir lock (the child holds a copy of its descriptor) is
    free again, and nothing prints a traceback."""
    lock, err = tmp_path / ".run.lock", tmp_path / "stderr"
    with open(err, "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", PLAN_PARENT, str(ROOT), str(lock)], env=script_env(),
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    started = [parent.pid]
    try:
        deadline = time.monotonic() + 120
        while not (children := psutil.Process(parent.pid).children()):
            assert parent.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        child = children[0].pid
        started.append(child)
        time.sleep(3)  # the child has imported torch and plans
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while alive([child]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive([child]), "the plan child outlived the run that forked it"
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nothing holds the run's lock
        finally:
            os.close(fd)
        assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)
