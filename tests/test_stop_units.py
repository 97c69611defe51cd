"""The stop guards' parts that need no training run: what --time_limit takes, the launcher's deadline reaching only
its own workers, the grace a torchrun gives its workers' stop save, and the dry-run plan's child dying with the run
that forked it. The runs that stop: tests/test_stop.py, tests/test_stop_one_process.py."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from common.errors import UserError
from common import results
from common.harness import launcher, stops
from conftest import ROOT, assert_clean_error, run_example, run_in_process, script_env
from stop_helpers import SCRIPT, alive, take_lock_naming_holders


@pytest.mark.parametrize("text", ["", " ", "none", "soon"])
def test_a_time_limit_that_is_not_minutes_or_an_end_time_is_one_error_line(tmp_path, text):
    proc = run_in_process(SCRIPT, "--steps", "1", "--no-export", "--time_limit", text, "--out_dir", str(tmp_path))
    assert_clean_error(proc, f"--time_limit {text!r} is neither minutes (90) nor an end time")
    assert not (tmp_path / "results.json").exists()


def test_a_lock_whose_named_holder_has_ended_says_its_processes_still_hold_the_folder(tmp_path):
    """A self-launched run's torchrun and workers inherit the launcher's lock: when the launcher is gone (killed) and
    they still save, the refusal says so instead of naming a dead pid as the holder."""
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid of this host that has ended
    lock = tmp_path / results.LOCK
    lock.write_text(f"pid {dead.pid} on {socket.gethostname()} since 2026-12-06 05:00:00 UTC: python x.py\n")
    with open(lock) as held:  # held by "its workers": another open file description of this process
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match=f"pid {dead.pid} has ended, but the processes it started .* still hold"):
            launcher.hold_out_dir(tmp_path)
        lock.write_text(f"pid {os.getpid()} on {socket.gethostname()} since 2026-12-06 05:00:00 UTC: python x.py\n")
        with pytest.raises(UserError) as alive_holder:  # a holder that runs is named as it is, nothing added
            launcher.hold_out_dir(tmp_path)
        assert "has ended" not in str(alive_holder.value) and f"pid {os.getpid()} on" in str(alive_holder.value)


def test_the_launchers_deadline_is_read_only_by_its_own_workers(monkeypatch, tmp_path):
    """QWEN3_RECIPES_DEADLINE left in the environment of a plain run (or a torchrun of the user's) is not that run's
    limit; a worker of the scripts' own launch reads it, and a value that is no time is one error line. The
    launcher hands its workers its own deadline or none, never one it inherited."""
    monkeypatch.delenv(stops.SELF_LAUNCHED, raising=False)
    monkeypatch.setenv(stops.DEADLINE, "1.0")
    assert stops.deadline(None) is None
    assert abs(stops.deadline("2") - (time.time() + 120)) < 5
    monkeypatch.setenv(stops.DEADLINE, "abc")
    assert stops.deadline(None) is None

    monkeypatch.setenv(stops.SELF_LAUNCHED, str(tmp_path / "stopped"))
    monkeypatch.setenv(stops.DEADLINE, "1234567890.5")
    assert stops.deadline("2") == 1234567890.5  # every worker the launcher's one end time
    for bad in ("abc", "nan", "-5", "inf"):
        monkeypatch.setenv(stops.DEADLINE, bad)
        with pytest.raises(UserError, match=f"QWEN3_RECIPES_DEADLINE='{bad}' from the launcher is not a time"):
            stops.deadline(None)

    inherited = {stops.DEADLINE: "1.0", "PATH": "/bin"}
    env = launcher.worker_env(inherited, tmp_path / "m", None)
    assert stops.DEADLINE not in env and env[stops.SELF_LAUNCHED] == str(tmp_path / "m") and env["PATH"] == "/bin"
    assert launcher.worker_env(inherited, tmp_path / "m", 99.5)[stops.DEADLINE] == "99.5"


KILLED_PARENT = """
import os, subprocess, sys, threading, time
for _ in range(3):  # a launcher has several threads (pyarrow's allocator among them)
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
count = [sys.executable, "-c", {counter!r}, {out!r}]
subprocess.Popen([sys.executable, "-S", {parent!r}, str(os.getpid()), *count])
time.sleep(600)
"""
COUNTER = """
import signal, sys, time
from pathlib import Path
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
Path(sys.argv[1]).write_text("ready")
while not got:
    time.sleep(0.01)
time.sleep(3)  # what more arrives
Path(sys.argv[1]).write_text(str(len(got)))
"""


def test_torchrun_gets_one_sigterm_when_a_launcher_of_several_threads_is_killed(tmp_path):
    """Linux sends the parent-death signal each time a process is reparented, once for each thread of a parent that
    ends: started by the launcher itself, torchrun got SIGTERM up to once per launcher thread after a kill -9 and
    passed each on (a second signal ends a worker at once). Through common/harness/torchrun_parent.py it gets one.
    Here a 4-thread "launcher" starts a counter of SIGTERMs that way and is killed with SIGKILL."""
    from common.harness import torchrun_parent

    assert torchrun_parent.STOP_SIGNALS == stops.STOP_SIGNALS  # the signals it leaves to the launcher
    out = tmp_path / "count"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_PARENT.format(
        counter=COUNTER, out=str(out), parent=torchrun_parent.__file__)])
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text() == "ready"):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    while out.read_text() == "ready":
        assert time.monotonic() < deadline + 30
        time.sleep(0.1)
    assert out.read_text() == "1"


REPEATED = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from common.harness.stops import StopControl
control = StopControl(end=None, margin_s=0.0, is_main=True)
control.install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # within DUPLICATE_S: a launcher passing on the signal this process got
print("still stopping at a step boundary:", control.reason, flush=True)
time.sleep(StopControl.DUPLICATE_S + 0.5)
os.kill(os.getpid(), signal.SIGTERM)  # a second signal
time.sleep(30)
print("still running after the second signal", flush=True)
"""


def test_a_second_signal_ends_the_process_at_once_and_a_passed_on_repeat_does_not():
    """StopControl's rule in a process of its own (it ends the process): the same signal again within DUPLICATE_S is
    the one already being handled (a launcher passing on what the process got), a signal after it ends the process at
    once with one line and the signal's exit code. The rule mid-save in a training run: the extended
    test_a_second_signal_during_the_stop_save_ends_the_run_at_once (tests/test_stop_one_process.py)."""
    proc = subprocess.run([sys.executable, "-c", REPEATED.format(root=str(ROOT))], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "still stopping at a step boundary: SIGTERM\n", proc.stdout
    assert proc.stderr.count("[stop] SIGTERM: finishing this step") == 1, proc.stderr
    assert proc.stderr.endswith("error: SIGTERM again: ended at once; the last complete checkpoint in the out_dir stays "
                                "usable\n"), proc.stderr


def test_the_grace_a_torchrun_gives_its_workers_stop(monkeypatch):
    """What torch 2.14's torchrun waits between passing on a signal and SIGKILL: --shutdown-timeout (either
    spelling, before the script), PET_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30. The scripts' own
    launch gives it STOP_GRACE_S, and passes on SIGUSR1 too."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    script = ["examples/train_native_qwen3.py", "--steps", "3"]
    grace = stops.torchrun_grace_s
    assert grace([*torchrun, *script], {}) == stops.TORCHRUN_DEFAULT_GRACE_S == 30
    assert grace([*torchrun, "--shutdown-timeout", "600", *script], {}) == 600
    assert grace([*torchrun, "--shutdown_timeout=900", *script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}) == 900
    assert grace([*torchrun, *script, "--shutdown-timeout", "600"], {}) == 30  # the script's flag, not torchrun's
    assert grace([*torchrun, *script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}) == 120
    assert grace([*torchrun, *script], {"PET_SHUTDOWN_TIMEOUT": "240", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}) == 240
    flags = launcher.torchrun_stop_flags()
    assert grace([*torchrun, *flags, *script], {}) == stops.STOP_GRACE_S
    assert "SIGUSR1" in flags[1] and "SIGTERM" in flags[1]


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
        time.sleep(3)  # the child has imported torch and plans
        below = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]  # the plan child, and any of its
        started.extend(below)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(below) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(below), "the plan child outlived the run that forked it"
        os.close(take_lock_naming_holders(tmp_path))  # free: nothing holds the run's lock (else its holders named)
        assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)


def test_one_flag_sets_the_process_groups_timeout_before_and_after_step_1(tmp_path):
    """torchtitan lowers every process group's timeout to comm.train_timeout_seconds (100 s by default) after the
    first step: a stop save in which one rank waits longer for the slowest shard write would be aborted. The
    Trainer.Config a run builds takes --comm_timeout_s there and at the start (device.setup's group, 600 s by
    default)."""
    import torch

    from common import device
    from common.cli import parse_config
    from common.recipe import Inputs
    from slow_native_qwen3 import recipe

    native = recipe()
    device.route_torchtitan_device("cpu")
    dev = device.DeviceInfo(torch.device("meta"), "cpu", "fake", 0, 0, 1)
    for argv, seconds in (([], 600), (["--comm_timeout_s", "1800"], 1800)):
        cfg = parse_config(native.config, native.presets, argv, native.doc, native.default_preset)
        tc, _ = native.trainer_config(cfg, dev, tmp_path, Inputs())
        assert (tc.comm.init_timeout_seconds, tc.comm.train_timeout_seconds, cfg.comm_timeout_s) == (seconds,) * 3


def _fake_fi_info(folder, output: str, code: int = 0):
    """A `fi_info` on PATH that prints `output` (what libfabric's tool prints per endpoint: `provider: efa` ...)."""
    folder.mkdir()
    tool = folder / "fi_info"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {code}\n")
    tool.chmod(0o755)
    return folder


def test_a_multi_node_launch_checks_efa_and_node_0_before_torchrun(tmp_path, monkeypatch):
    """--nnodes 2 on CPU with --check_efa (always on for --device neuron): `fi_info -p efa` listing no endpoint, or
    no fi_info at all, is one line naming the node; a node other than 0 waits visibly for node 0's endpoint and
    names it when it never answers. A host with EFA gets AWS's variables for its workers."""
    two = ("--steps", "1", "--no-export", "--nnodes", "2", "--master_port", "1", "--rendezvous_wait_s", "2")
    none = _fake_fi_info(tmp_path / "none", "fi_getinfo: -61 (No data available)", code=61)
    PATH = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{none}:{PATH}")
    proc = run_example(SCRIPT, *two, "--check_efa", "--out_dir", str(tmp_path / "o1"), check=False)
    assert_clean_error(proc, "node 0 of 2: `fi_info -p efa` lists no EFA endpoint")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UserError, match="node 1 of 2: no fi_info on PATH"):
        launcher.check_efa("node 1 of 2")
    efa = _fake_fi_info(tmp_path / "efa", "provider: efa\n    fabric: efa\nprovider: efa\n    fabric: efa")
    monkeypatch.setenv("PATH", f"{efa}:{PATH}")
    assert len(launcher.check_efa("node 0 of 2")) == 2
    for var in launcher.EFA_ENV:  # restored after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    launcher.check_nodes(SimpleNamespace(device="cpu", guards=SimpleNamespace(
        check_efa=True, node_rank=0, nnodes=2, master_addr="127.0.0.1", master_port=0)))  # 0: any free port
    assert {v: os.environ[v] for v in launcher.EFA_ENV} == launcher.EFA_ENV
    proc = run_example(SCRIPT, *two, "--node_rank", "1", "--out_dir", str(tmp_path / "o2"), check=False)
    assert "[launch] node 1 of 2: waiting for node 0 at 127.0.0.1:1 (up to 2 s" in proc.stdout, proc.stdout[-2000:]
    assert_clean_error(proc, "node 1 of 2: node 0's endpoint 127.0.0.1:1 did not accept a connection in 2 s")


def test_the_cores_export_check_ends_with_the_run_that_started_it(tmp_path):
    """`python -m common.export` (the core's export and load check, a process of its own) is told its parent: when the
    run is gone (a stop signal or a kill during the check) it ends too, instead of checking on under pid 1. Here the
    run is a process that starts the check and is gone at once: the check ends before its first line of output (on
    its own, this request prints one error line, the folder does not exist, or a traceback if it broke)."""
    import json

    request = {"export_dir": str(tmp_path / "no_export"), "reference": str(tmp_path / "ref.pt"),
               "out": str(tmp_path / "check.json"), "files": True}
    starter = ("import json, os, subprocess, sys\n"
               "r = json.loads(sys.argv[1]); r['parent'] = os.getpid()\n"
               "err = open(sys.argv[2], 'w')\n"
               "p = subprocess.Popen([sys.executable, '-m', 'common.export', json.dumps(r)], stderr=err)\n"
               "print(p.pid, flush=True)\n"
               "os._exit(0)\n")
    err = tmp_path / "check.err"
    run = subprocess.run([sys.executable, "-c", starter, json.dumps(request), str(err)],
                         env={**script_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    check = int(run.stdout.split()[0])
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(check).wait(timeout=300)  # ended by its parent-death check, not left running
    assert not alive([check])
    assert err.read_text() == "", err.read_text()  # it never got to the check


def test_a_worker_of_the_scripts_own_launch_takes_its_launchers_run_record(tmp_path, monkeypatch, prepared_assets):
    """The scripts' own launch hands its workers the run record it checked (record.json beside the stop marker), so
    no rank hashes the training data again (every rank of a trn2 host reading the same corpus at once before step
    1): `check` in a worker takes that record as it is; in any other process, or where the file is unreadable, it
    computes its own."""
    import json

    from common.harness import launcher, lifecycle
    from slow_native_qwen3 import recipe

    guarded = recipe()
    out = tmp_path / "o"
    out.mkdir()
    cfg = lifecycle.parse(guarded, ["--steps", "2", "--no-export", "--out_dir", str(out)])
    own = lifecycle.check(guarded, cfg, out).record
    assert own["data"]["files"], own  # the data's identity, hashed
    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.setenv(launcher.SELF_LAUNCHED, str(launch / "stopped"))
    assert launcher.launched_record() is None  # no record.json: the worker computes its own
    assert lifecycle.check(guarded, cfg, out).record == own
    handed = {**json.loads(json.dumps(own)), "data": {"path": "as the launcher hashed it", "files": {}}}
    (launch / launcher.LAUNCH_RECORD).write_text(json.dumps(handed))
    assert lifecycle.check(guarded, cfg, out).record == handed
    (launch / launcher.LAUNCH_RECORD).write_text("{not json")
    assert lifecycle.check(guarded, cfg, out).record == own
