"""A torchrun worker served by tests/prefork.py: what torchrun starts for each rank in the tests (PYTHON_EXEC, the
executable torchrun documents for its workers, set by tests/conftest.py's script_env), in place of a fresh `python -u
SCRIPT ARGS`. It imports nothing but the standard library: it hands its command line, folder, environment, parent and
stdin/stdout/stderr to the pre-forked runner of this test process, which forks the worker from its imported stack;
then it stands for the worker towards torchrun: every signal it gets is passed on, it ends as the worker ends (the
same exit code, or killed by the same signal), and it dies with torchrun as a worker does (the kernel's parent-death
signal), which ends the worker too (the runner kills a worker whose stand-in is gone). Where the runner is not there,
or the worker's environment is not the runner's (another PYTHONPATH or thread settings), it becomes the real
interpreter (exec), as torchrun would have started it.

The first line of the file conftest.py writes is `#!PYTHON -S`; this source follows it."""
import ctypes
import json
import os
import signal
import socket
import sys

PYTHON = os.environ.get("QWEN3_TEST_PYTHON", "")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec_python() -> None:
    os.execv(PYTHON, [PYTHON, *sys.argv[1:]])


def main() -> None:
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # dies with torchrun, as a worker does
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    pending, worker = [], []

    def forward(signum, _frame):
        if worker:
            try:
                os.kill(worker[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in SIGNALS:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.environ["QWEN3_TEST_WORKERS"])
    except (OSError, KeyError):
        _exec_python()
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "ppid": parent}
    socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reader = sock.makefile("r")
    first = reader.readline().split()
    if not first or first[0] == "exec":
        sock.close()
        _exec_python()
    worker.append(int(first[1]))
    for signum in pending:
        forward(signum, None)
    last = reader.readline().split()
    if not last:  # the runner is gone: so is the worker
        os._exit(1)
    status = int(last[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


main()
