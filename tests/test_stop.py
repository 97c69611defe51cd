"""A rented hour is never lost: a stop signal ends a multi-process training run at a step boundary with a
torchtitan checkpoint of that step and exit code 75, and the same command resumes it with the losses of a run that
never stopped, on the same number of ranks or (--reshard) another. Signals go to the scripts' own launcher and its
torchrun together (a host's shutdown), to one worker only, to a torchrun of the user's, and to one node's launcher of
a run over two nodes; a SIGKILL of the launcher leaves no worker training. Where torchrun itself gets the signal, the
stop save is made to take 31 s (tests/slow_native_qwen3.py, the same recipe with a checkpoint manager that sleeps
before torchtitan's save, as a large model's save on a shared file system takes), past torchrun's default 30 s before
it kills its workers. No process outlives any of these runs. One-process stops (--time_limit, a second signal, a
signal during an evaluation) and the refusal of a rerun that is not the same run: tests/test_stop_one_process.py;
the MoE script's resume on another world size: tests/test_reshard.py."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import time

import psutil
import pytest

from common.harness import reshard
from common.harness.stops import EXIT_STOPPED, STOP_GRACE_S
from conftest import ROOT, assert_clean_error, example_command, read_results, run_example, run_in_process
from stop_helpers import (LOSS_BOUND, SCRIPT, STEPS, TWO_RANKS, by_batch, close, command_line, finish,
                          no_process_outlives, same_state, start, take_lock_naming_holders, trace, wait_for_step,
                          workers)


@pytest.fixture(scope="module")
def uninterrupted(shared_run) -> dict:
    """The 2-rank run that never stops, every rank's batches traced (conftest.SHARED_RUNS)."""
    return shared_run("native_2_ranks_8_steps")[1]


SLOW_SAVE_S = "31"  # a stop save that outlasts torchrun's default 30 s between its SIGTERM and SIGKILL


def slow_command(cmd: list[str]) -> list[str]:
    """`cmd` (an example_command of the native script) with tests/slow_native_qwen3.py in the script's place."""
    return [str(ROOT / "tests" / "slow_native_qwen3.py") if a.endswith(SCRIPT) else a for a in cmd]


def _stop(cmd: list[str], out, log, after: int, target: str, slow_save=None, ranks: int = 2) -> tuple[dict, int, str]:
    """Start `cmd` (with `slow_save`, a monkeypatch: its stop save takes 31 s), wait for step `after`, send SIGTERM
    to `target` ("launcher": the process started; "launcher and torchrun": both at once, as a host's shutdown
    signals every process; "one worker": the rank-1 worker only, rank 0 learns of it through the per-step
    agreement), and check the stop of its `ranks` workers: one step for every rank, a whole checkpoint of it, no
    process left. (stopped, exit code, output)."""
    if slow_save is not None:
        slow_save.setenv("SLOW_STOP_SAVE_S", SLOW_SAVE_S)  # read when the command starts: for this command only
        cmd = slow_command(cmd)
    proc = start(cmd, log)
    if slow_save is not None:
        slow_save.delenv("SLOW_STOP_SAVE_S")
    wait_for_step(proc, out, after)
    found = workers(proc, ranks)
    assert len(found) == ranks, found
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    if target == "one worker":
        found[1].send_signal(signal.SIGTERM)
    else:
        torchrun = [p for p in family if "torch.distributed.run" in command_line(p)]
        for pid in [proc.pid, *(torchrun if target == "launcher and torchrun" else [])]:
            psutil.Process(pid).send_signal(signal.SIGTERM)
    err = finish(proc)
    no_process_outlives(family)
    stopped = read_results(out)["stopped"]
    assert stopped and stopped["step"] >= after and stopped["reason"] == "SIGTERM", (stopped, err[-3000:])
    assert stopped["step"] < STEPS, stopped  # steps are left to resume
    assert (out / "checkpoint" / f"step-{stopped['step']}" / ".metadata").is_file()
    return stopped, proc.returncode, err


def _stopped_cleanly(stopped: dict, code: int, err: str, torchrun_signalled: bool = False) -> None:
    """Exit 75 with the resume line, and no traceback (but torchrun's own report of the signal it got, where it
    got one)."""
    own = "torch.distributed.elastic.multiprocessing.api.SignalException: Process"
    assert code == EXIT_STOPPED and err.count("Traceback") == (err.count(own) if torchrun_signalled else 0), \
        err[-3000:]
    assert f"[stopped] {stopped['reason']} after step {stopped['step']}: checkpoint" in err, err[-3000:]


def _resumed(out, start_step: int, uninterrupted: dict) -> None:
    resumed = read_results(out)
    assert resumed["resumed_from_step"] == start_step and resumed["stopped"] is None, resumed["stopped"]
    assert resumed["history"]["steps"] == list(range(1, STEPS + 1))
    assert close(resumed["history"]["losses"], uninterrupted["losses"]), (resumed["history"], uninterrupted["losses"])


def _users_torchrun(args: tuple, processes: int) -> list[str]:
    """A torchrun of the user's, started as the docs say (--shutdown-timeout STOP_GRACE_S)."""
    cmd = example_command(SCRIPT, *args, torchrun=processes)
    cmd.insert(cmd.index(str(ROOT / "examples" / SCRIPT)), f"--shutdown-timeout={STOP_GRACE_S}")
    return cmd


TP2 = ("--tensor_parallel_degree", "2")


@pytest.fixture(scope="module")
def chain(tmp_path_factory, uninterrupted):
    """One 8-step run of two ranks, stopped three times and resumed each time, one launch per stop, every process's
    batches traced and each resume's starting state dumped (the reshard debug switch), --reshard on every command
    (and the checkpoint of every stop kept, for the comparison with each resume's starting state):

    1. The scripts' own launch: SIGTERM to the launcher and its torchrun together after step 2 (a host's shutdown),
       the stop save taking 31 s: torchrun waits for it (the launcher gives it --shutdown-timeout STOP_GRACE_S).
    2. The same command at tensor parallel 2 (one data-parallel rank of two processes) resumes there; SIGTERM to
       its rank-1 worker only, a step later.
    3. On 1 rank, the command is refused without --reshard, and with it but another --lr (each on a copy of the
       folder, in this process: they end in the checks before a launch).
    4. A torchrun of the user's with one process (the world size 2 -> 1), started as the docs say, resumes there;
       SIGTERM to torchrun a step later and a stop save of 31 s.
    5. A torchrun of the user's with two processes (1 -> 2) trains the remaining steps."""
    root = tmp_path_factory.mktemp("stop_chain")
    out = root / "o"
    args = (*TWO_RANKS, "--reshard", "--keep_checkpoints", "4", "--out_dir", str(out))  # each stop's checkpoint kept
    stops, resumed_from = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(reshard.DEBUG_ENV, str(root / "debug"))
        own = example_command(SCRIPT, *args, "--nproc_per_node", "2")
        stops.append(_stop(own, out, root / "log1", 2, "launcher and torchrun", slow_save=mp))
        stops.append(_stop([*own, *TP2], out, root / "log2", stops[-1][0]["step"] + 1, "one worker"))
        resumed_from.append(read_results(out)["resumed_from_step"])
        refused = {}
        for name, extra in (("no flag", TWO_RANKS), ("lr", (*TWO_RANKS, "--reshard", "--lr", "0.01"))):
            copy = root / f"refused {name}"
            shutil.copytree(out, copy, symlinks=True)  # an in-process command keeps its out_dir's lock
            refused[name] = run_in_process(SCRIPT, *extra, "--out_dir", str(copy))
        stops.append(_stop(_users_torchrun(args, 1), out, root / "log3", stops[-1][0]["step"] + 1, "launcher",
                           slow_save=mp, ranks=1))
        resumed_from.append(read_results(out)["resumed_from_step"])
        run_example(SCRIPT, *args, torchrun=2)
    return {"root": root, "out": out, "stops": stops, "refused": refused, "results": read_results(out),
            "resumed_from": resumed_from, "straight": uninterrupted}


def test_a_stop_signal_to_the_launcher_one_worker_or_torchrun_saves_and_the_same_command_resumes(chain):
    """Each stop: every rank at one step with a whole checkpoint of it, results.json says so, no process left. The
    scripts' own launch (launcher and torchrun signalled, or one worker): exit 75 with the resume line and no
    traceback but torchrun's report of its signal. The user's torchrun signalled: rank 0 prints the resume line (the
    exit, non-zero, is torchrun's to report: it reports the signal it got itself). Each launch resumed from the
    stop before it; the last trains to the end."""
    (first, code1, err1), (second, code2, err2), (third, code3, err3) = chain["stops"]
    _stopped_cleanly(first, code1, err1, torchrun_signalled=True)
    _stopped_cleanly(second, code2, err2)
    assert code3 != 0 and f"[stopped] SIGTERM after step {third['step']}: checkpoint" in err3, err3[-3000:]
    assert chain["resumed_from"] == [first["step"], second["step"]]
    res = chain["results"]
    assert res["resumed_from_step"] == third["step"] and res["stopped"] is None, res["stopped"]
    assert res["history"]["steps"] == list(range(1, STEPS + 1))


def test_a_resume_on_another_layout_needs_the_flag_and_the_same_run(chain):
    no_flag, lr = chain["refused"]["no flag"], chain["refused"]["lr"]
    assert_clean_error(no_flag, "world size 1 (checkpoint: 2", "--tensor_parallel_degree 1 (checkpoint: 2)",
                       "add --reshard")
    assert_clean_error(lr, "--lr 0.01 (checkpoint: 0.003)")
    assert no_flag.returncode == lr.returncode == 2
    assert "add --reshard" not in lr.stderr  # the flag does not help there


def test_resumed_on_another_layout_the_run_trains_as_if_it_never_stopped(chain, shared_run, tmp_path):
    """Resumed at tensor parallel 2, then on 1 rank, then on 2 (data parallel): after each change of layout the
    resumed state (weights, optimizer state, LR schedule, step) is the checkpoint's, tensor for tensor; each step
    trains on the same sequences as the run that never stopped (the debug trace of every process), none twice and
    none left out; the losses are that run's to an ulp until the first change, within LOSS_BOUND after it."""
    out, res, root = chain["out"], chain["results"], chain["root"]
    s1, s2, s3 = (stop["step"] for stop, _, _ in chain["stops"])
    assert 2 <= s1 < s2 < s3 < STEPS, (s1, s2, s3)
    assert [(s["steps"], s["world_size"], s["stopped"]) for s in res["segments"]] == [
        ([1, s1], 2, "SIGTERM"), ([s1 + 1, s2], 2, "SIGTERM"), ([s2 + 1, s3], 1, "SIGTERM"),
        ([s3 + 1, STEPS], 2, None)]
    assert [s["data"].get("data_parallel", s["world_size"]) for s in res["segments"]] == [2, 1, 1, 2], res["segments"]
    assert [s["data"].get("resharded_from") for s in res["segments"]] == [  # the layout's changes
        None, {"step": s1, "world_size": 2, "tensor_parallel": 1}, {"step": s2, "world_size": 2, "tensor_parallel": 2},
        {"step": s3, "world_size": 1, "tensor_parallel": 1}]
    assert [s["tensor_parallel"] for s in res["segments"]] == [1, 2, 1, 1]
    assert f"[reshard] step {s1} of 2 ranks resumed on 2 ranks (tensor parallel 2: 1 data-parallel)" in \
        chain["stops"][1][2]
    assert all(s["data"]["shards"] == 2 and s["data"]["exact"] for s in res["segments"]), res["segments"]
    same_state(out, s1, root / "debug" / f"resumed-step{s1}-w2.pt", tmp_path)
    same_state(out, s2, root / "debug" / f"resumed-step{s2}-w1.pt", tmp_path)
    same_state(out, s3, root / "debug" / f"resumed-step{s3}-w2.pt", tmp_path)
    straight_dir, _ = shared_run("native_2_ranks_8_steps")
    ref = by_batch(trace(straight_dir.parent / f"{straight_dir.name}.trace"))
    lines = trace(root / "debug")
    assert len(ref) == STEPS * 2 and by_batch(lines) == ref  # 8 steps x 2 shards x 1 batch of 2 sequences
    assert {(line["world_size"], line["process"]) for line in lines if s1 < line["step"] <= s2} == {(1, 0), (1, 1)}
    assert {line["world_size"] for line in lines if s2 < line["step"] <= s3} == {1}
    losses, straight = res["history"]["losses"], chain["straight"]["losses"]
    assert close(losses[:s1], straight[:s1]), (losses, straight)
    worst = max(abs(a - b) for a, b in zip(losses, straight))
    assert len(losses) == STEPS and worst <= LOSS_BOUND, (worst, losses, straight)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.extended
def test_across_nodes_a_signal_to_one_nodes_launcher_stops_every_node_at_one_step(uninterrupted, tmp_path):
    """The scripts' own launch across nodes, here two on one host (--nnodes 2, one process each, node 0 at
    127.0.0.1): SIGHUP to node 1's launcher only, after step 3. Every rank stops at the same step with one
    checkpoint; both launchers exit 75 without a traceback and say how to resume; the same two commands then
    train on to the losses of the 2-rank run that never stopped."""
    out, port = tmp_path / "o", str(_free_port())

    def node(rank: int) -> list[str]:
        return example_command(SCRIPT, *TWO_RANKS, "--nnodes", "2", "--node_rank", str(rank), "--master_port", port,
                               "--out_dir", str(out))

    nodes = [start(node(rank), tmp_path / f"log{rank}") for rank in (0, 1)]
    wait_for_step(nodes[0], out, 3)
    family = [p.pid for n in nodes for p in psutil.Process(n.pid).children(recursive=True)]
    assert len(family) >= 4  # a torchrun and a worker per node
    nodes[1].send_signal(signal.SIGHUP)  # the launcher passes on the signal it got: the record names it
    logs = [finish(n) for n in nodes]
    no_process_outlives(family)
    stopped = read_results(out)["stopped"]
    assert stopped and stopped["step"] >= 3 and stopped["reason"] == "SIGHUP", stopped
    for n, log in zip(nodes, logs):
        _stopped_cleanly(stopped, n.returncode, log)

    nodes = [start(node(rank), tmp_path / f"again{rank}") for rank in (0, 1)]
    logs = [finish(n) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [log[-3000:] for log in logs]
    _resumed(out, stopped["step"], uninterrupted)


@pytest.mark.extended
def test_a_node_whose_packages_differ_from_node_0s_is_named_before_the_build(tmp_path, monkeypatch):
    """Two "nodes" on one host (--nnodes 2, one process each), node 1's transformers another version
    (tests/other_stack_native.py): every rank gathers the stacks right after the process group exists, and the run
    ends before anything is built, node 0's console naming node 1 and the package."""
    port, out = str(_free_port()), tmp_path / "o"
    monkeypatch.setenv("OTHER_STACK_NODE", "1")
    entry = str(ROOT / "tests" / "other_stack_native.py")
    nodes = [start([a if not a.endswith(SCRIPT) else entry for a in example_command(
        SCRIPT, *TWO_RANKS, "--nnodes", "2", "--node_rank", str(rank), "--master_port", port, "--out_dir", str(out))],
        tmp_path / f"log{rank}") for rank in (0, 1)]
    logs = [finish(n) for n in nodes]
    assert all(n.returncode != 0 for n in nodes), [log[-2000:] for log in logs]
    named = [line for line in logs[0].splitlines() if line.startswith("error: node 1 (")]
    assert named and "runs another stack than node 0" in named[0] and "transformers 4.0.0 (node 0: " in named[0], \
        logs[0][-3000:]
    assert not (out / "losses.jsonl").exists()


def test_a_stop_while_torchrun_waits_for_the_other_nodes_exits_75_with_a_line(tmp_path):
    """Node 0 of two started alone: its torchrun waits for node 1 and has no worker. A SIGUSR1 (SLURM's --signal)
    then reaches no worker: the launch says so and exits 75 (run the same command again), not torchrun's -10 read
    as 246."""
    out = tmp_path / "o"
    proc = start(example_command(SCRIPT, *TWO_RANKS, "--nnodes", "2", "--node_rank", "0", "--master_port",
                                 str(_free_port()), "--out_dir", str(out)), tmp_path / "log")
    deadline = time.monotonic() + 120
    while not [p for p in psutil.Process(proc.pid).children() if "torch.distributed.run" in command_line(p.pid)]:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(3)  # torchrun at its rendezvous
    proc.send_signal(signal.SIGUSR1)
    err = finish(proc)
    assert proc.returncode == EXIT_STOPPED, (proc.returncode, err[-3000:])
    assert "[stopped] SIGUSR1 before any worker of this node started" in err, err[-3000:]


def test_kill_9_of_the_launcher_leaves_no_worker_and_the_out_dir_is_held_until_the_run_is_gone(tmp_path):
    """A --nproc_per_node 2 run of 200 steps holds its out_dir: a second run into it refuses in one line naming the
    holder (the launcher: its pid and command). SIGKILL to the launcher: torchrun gets SIGTERM when its parent dies
    and its workers stop at the next step with a checkpoint, so nothing trains on (without that they would train
    for minutes, racing any rerun); the OS releases the lock with them: the product's own lock (what a rerun takes
    first) is then taken (within 10 s, else the test names the processes holding it), and the loss history has each
    step once, in order, up to the checkpointed one.
    (A rerun resuming a SIGTERM stop of two ranks: the test above.)"""
    from common.harness.checks import read_progress

    out = tmp_path / "o"
    proc = start(example_command(SCRIPT, "--steps", "200", "--no-export", "--seq_len", "64", "--nproc_per_node", "2",
                                 "--out_dir", str(out)), tmp_path / "log")
    wait_for_step(proc, out, 2)
    second = run_in_process(SCRIPT, "--steps", "3", "--no-export", "--out_dir", str(out))
    assert_clean_error(second, "is in use by another run", f"pid {proc.pid}", "train_native_qwen3.py")
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # torchrun and its two workers
    proc.kill()
    proc.wait()
    no_process_outlives(family)
    stopped = read_results(out)["stopped"]
    assert stopped and stopped["reason"] == "SIGTERM", stopped
    assert (out / "checkpoint" / f"step-{stopped['step']}" / ".metadata").is_file()
    history = [r["step"] for r in read_progress(out / "losses.jsonl")]
    assert history == list(range(1, stopped["step"] + 1)), history
    fd = take_lock_naming_holders(out)  # refused while any process of the run still held it
    try:
        assert (out / ".run.lock").read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        os.close(fd)

