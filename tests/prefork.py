"""A pre-forking runner for the tests' command lines: one process imports the heavy stack (torch,
torchtitan, transformers, datasets, ...) once, then forks a child per command, which runs the
script (or `-m` module) as `python` would run it as `__main__`, with the command's argv, working
folder and environment, its stdout and stderr in files, and the script's own exit code.

Every command that starts a Python process spends 5 to 10 s of a 2-core CPU importing the stack
before its first line runs; the test suite starts about two hundred of them. A forked child
starts with those modules imported and nothing else: the repository is not on its path and none
of its modules are loaded (the script imports `common/` itself, as it does under `python`), no
torch state has been touched (no op has run, no thread pool, no process group), and the child is
a process of its own, so `os._exit`, signals, fds and its own subprocesses behave as they do in a
fresh interpreter. A command a test signals or kills while it runs starts in the background here
too (its parent is this runner, not the test); one started with `python -c` or with another
PYTHONPATH starts with `subprocess.Popen`.

Protocol: one JSON request per line on stdin, one JSON reply per line on the original stdout:
  - {"argv", "cwd", "env", "stdout", "stderr", "timeout"}: run the command to its end (its process group killed
    past `timeout`) -> {"rc", "timed_out"};
  - {"op": "start", "argv", "cwd", "env", "stdout", "stderr"} -> {"pid"}: the command in the background, for a test
    that signals or kills it while it runs (`stderr` equal to `stdout`: one file for both; SIGINT as a command typed
    in a terminal has it);
  - {"op": "wait", "pid", "timeout"} -> {"rc", "timed_out"} (the command left running past `timeout`), and
    {"op": "poll", "pid"} -> {"rc"} (null while it runs).
Requests are served one at a time, as a test sends them; background commands run meanwhile."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

# What the examples import. torchtitan binds its device when it is first imported, and the examples route
# it to theirs before that (common/device.py); with `--torchtitan` it is imported here too, routed to the
# CPU by the repository's own route_torchtitan_device (every test runs on the CPU), and each child's
# route then finds it there. Without the flag each child imports it (a shadow torchtitan on the path).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "numpy", "safetensors.torch", "transformers",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.llama.modeling_llama", "datasets", "tokenizers", "pyarrow", "pyarrow.parquet",
           "pandas", "matplotlib", "matplotlib.pyplot", "psutil")
TORCHTITAN = ("torchtitan.trainer", "torchtitan.models.qwen3", "torchtitan.components.validate",
              "torchtitan.hf_datasets.text_datasets", "torchtitan.experiments.transformers_modeling_backend")


def _preload(torchtitan: bool) -> None:
    import gc
    import threading

    gc.disable()  # the imports take about a fifth less CPU time; one collection at the end leaves the state a fresh
    try:  # interpreter's imports leave (every object in the oldest generation), for the children
        _import_all(torchtitan)
    finally:
        gc.enable()
        gc.collect()
    # Forking is only safe while this process has one thread (a lock held by another thread would
    # stay held in every child).
    if threading.active_count() != 1:
        raise SystemExit(f"prefork: {threading.active_count()} threads after the imports; refusing to fork")


def _import_all(torchtitan: bool) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module this stack lacks is imported by the script, or fails there
            print(f"prefork: {name} not preloaded: {exc!r}", file=sys.stderr, flush=True)
    if any(name.startswith("torchtitan") for name in sys.modules):
        raise SystemExit("prefork: a preloaded module imported torchtitan")
    if torchtitan:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, root)
        try:
            importlib.import_module("common.device").route_torchtitan_device("cpu")
        finally:  # none of the repository stays loaded: each child imports its own common/
            sys.path.remove(root)
            for name in [n for n in sys.modules if n == "common" or n.startswith("common.")]:
                del sys.modules[name]
        for name in TORCHTITAN:
            importlib.import_module(name)


def _run_child(req: dict, proto_fds: tuple[int, int]) -> None:
    """In the forked child: become `python ARGV...` and exit as it would. Never returns."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        os.setpgrp()  # its own process group: a timeout kills the command and everything it started
        for fd in proto_fds:
            os.close(fd)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            if fd == 2 and path == req["stdout"]:
                os.dup2(1, 2)
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if req.get("op") == "start":  # SIGINT as in a terminal (the server may have inherited it ignored)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        # What the interpreter does at exit: wait for non-daemon threads, run atexit, flush.
        try:
            threading._shutdown()  # noqa: SLF001 (the interpreter's own exit step)
            atexit._run_exitfuncs()  # noqa: SLF001
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group and every process below the child (torchrun starts each
    worker in a session of its own)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for p in below:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve() -> None:
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    os.dup2(2, 1)  # anything printed here goes to stderr, never into the replies
    _preload(torchtitan="--torchtitan" in sys.argv[1:])
    reader = os.fdopen(proto_in, "r")
    writer = os.fdopen(proto_out, "w")
    writer.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    writer.flush()
    ended: dict[int, int] = {}  # pid -> wait status, of every command that has ended and not been asked about

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            ended[pid] = status

    def wait(pid: int, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reap()
            if pid in ended:
                return {"rc": os.waitstatus_to_exitcode(ended.pop(pid)), "timed_out": False}
            if deadline is not None and time.monotonic() > deadline:
                return {"rc": None, "timed_out": True}
            time.sleep(0.02)

    for line in reader:
        req = json.loads(line)
        op = req.get("op", "run")
        if op in ("run", "start"):
            pid = os.fork()
            if pid == 0:
                _run_child(req, (proto_in, proto_out))
            if op == "start":
                reply = {"pid": pid}
            else:
                reply = wait(pid, req["timeout"])
                if reply["timed_out"]:
                    _kill_group(pid)
                    reply = dict(wait(pid, None), timed_out=True)
        elif op == "wait":
            reply = wait(req["pid"], req["timeout"])
        else:  # poll
            reap()
            reply = {"rc": os.waitstatus_to_exitcode(ended.pop(req["pid"])) if req["pid"] in ended else None}
        writer.write(json.dumps(reply) + "\n")
        writer.flush()


if __name__ == "__main__":
    serve()
