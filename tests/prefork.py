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


def _set_name(name: str) -> None:
    """The command's name as ps and /proc show it (comm: 15 bytes), instead of the runner's."""
    import ctypes

    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _run_child(req: dict, proto_fds: tuple[int, int]) -> None:
    """In the forked child: become `python ARGV...` and exit as it would. Never returns."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        inherit = req.get("inherit")  # a torchrun worker: its session and stdio are set already
        if not inherit:
            os.setpgrp()  # its own process group: a timeout kills the command and everything it started
        for fd in proto_fds:
            os.close(fd)
        for fd, path in () if inherit else ((1, req["stdout"]), (2, req["stderr"])):
            if fd == 2 and path == req["stdout"]:
                os.dup2(1, 2)
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if req.get("op") == "start" or inherit:  # SIGINT as in a terminal (the server may have inherited it ignored)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if not inherit:
            stdin = os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            os.close(stdin)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        _set_name(("w:" if inherit else "") + (argv[1] if argv[0] == "-m" else os.path.basename(argv[0])))
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


def _worker_child(req: dict, fds: list[int], close: list[int]) -> None:
    """In the forked child: become torchrun's worker `python -u ARGV...` (tests/torchrun_worker.py asked for it), with
    the stand-in's stdin, stdout and stderr, in a session of its own as torchrun starts a worker, and its stand-in's
    parent (torchrun) as the parent it sees. Never returns."""
    for fd in close:
        os.close(fd)
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    ppid, me, real = req["ppid"], os.getpid(), os.getppid
    # What the worker (not a process it forks) reads of its parent: common/device.py, the stop's grace line.
    os.getppid = lambda: ppid if os.getpid() == me else real()
    argv = [a for a in req["argv"] if a != "-u"]
    _run_child({"argv": argv, "cwd": req["cwd"], "env": req["env"], "inherit": True}, ())


# What must be the runner's own for a worker to be forked from it: anything else is imported, or read at start,
# differently (a shadow module on the path, another thread count or allocator setting).
SAME_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
            "PYTHONHASHSEED")


def serve() -> None:
    import select
    import socket

    proto_in = os.dup(0)
    proto_out = os.dup(1)
    os.dup2(2, 1)  # anything printed here goes to stderr, never into the replies
    args = sys.argv[1:]
    _preload(torchtitan="--torchtitan" in args)
    listener = None
    if "--workers" in args:  # torchrun's workers, asked for by tests/torchrun_worker.py
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = args[args.index("--workers") + 1]
        if os.path.exists(path):  # a runner before this one, ended
            os.unlink(path)
        listener.bind(path)
        listener.listen(64)
    writer = os.fdopen(proto_out, "w")
    writer.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    writer.flush()
    ended: dict[int, int] = {}  # pid -> wait status, of every command that has ended and not been asked about
    workers: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    pending: dict | None = None  # the request being answered: a run or a wait, until its command ends
    buffered = b""

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            conn = workers.pop(pid, None)
            if conn is None:
                ended[pid] = status
                continue
            try:
                conn.sendall(f"status {status}\n".encode())
            except OSError:
                pass
            conn.close()

    def answer(reply: dict) -> None:
        writer.write(json.dumps(reply) + "\n")
        writer.flush()

    def settle() -> None:
        nonlocal pending
        if pending is None:
            return
        pid = pending["pid"]
        if pid in ended:
            reply = {"rc": os.waitstatus_to_exitcode(ended.pop(pid)), "timed_out": False}
            if pending.get("killed"):
                reply["timed_out"] = True
        elif pending["deadline"] is not None and time.monotonic() > pending["deadline"]:
            if pending["op"] == "wait":
                reply = {"rc": None, "timed_out": True}
            else:  # a run past its timeout: its process group killed, then waited for
                _kill_group(pid)
                pending.update(killed=True, deadline=None)
                return
        else:
            return
        pending = None
        answer(reply)

    def request(req: dict) -> None:
        nonlocal pending
        op = req.get("op", "run")
        if op in ("run", "start"):
            pid = os.fork()
            if pid == 0:
                _run_child(req, (proto_in, proto_out, *([listener.fileno()] if listener else []),
                                 *(c.fileno() for c in workers.values())))
            if op == "start":
                answer({"pid": pid})
            else:
                pending = {"op": op, "pid": pid, "deadline": time.monotonic() + req["timeout"]}
        elif op == "wait":
            timeout = req["timeout"]
            pending = {"op": op, "pid": req["pid"], "deadline": None if timeout is None else time.monotonic() + timeout}
        else:  # poll
            reap()
            answer({"rc": os.waitstatus_to_exitcode(ended.pop(req["pid"])) if req["pid"] in ended else None})

    def worker(conn: socket.socket) -> None:
        msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        while not msg.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            msg += more
        req = json.loads(msg)
        if len(fds) != 3 or any(req["env"].get(k) != os.environ.get(k) for k in SAME_ENV):
            for fd in fds:
                os.close(fd)
            conn.sendall(b"exec\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            _worker_child(req, fds, [proto_in, proto_out, listener.fileno(), conn.fileno(),
                                     *(c.fileno() for c in workers.values())])
        for fd in fds:
            os.close(fd)
        workers[pid] = conn
        conn.sendall(f"pid {pid}\n".encode())

    while True:
        watched = [proto_in, *([listener] if listener else []), *workers.values()]
        if pending is not None:  # one request at a time: the next waits until this one is answered
            watched.remove(proto_in)
        readable, _, _ = select.select(watched, [], [], 0.02)
        for item in readable:
            if item is proto_in:
                chunk = os.read(proto_in, 1 << 20)
                if not chunk:
                    return
                buffered += chunk
                while b"\n" in buffered and pending is None:
                    line, buffered = buffered.split(b"\n", 1)
                    request(json.loads(line))
            elif item is listener:
                conn, _ = listener.accept()
                worker(conn)
            else:  # a stand-in's connection: it never writes, so this is its end (torchrun killed it): the worker too
                pid = next((p for p, c in workers.items() if c is item), None)
                if pid is not None and not item.recv(1):
                    _kill_group(pid)
        reap()
        settle()
        while b"\n" in buffered and pending is None:
            line, buffered = buffered.split(b"\n", 1)
            request(json.loads(line))


if __name__ == "__main__":
    serve()
