"""One verifier process serves every check of a training run (the load check at step 1, the export check at the
end): torch and transformers are imported once, each folder is read anew, one check at a time.

On the CPU the run forks it before it has a device, a process group, other threads or a model (`start_verifier`);
elsewhere the first check starts `python -m common.harness.verifier serve`. A check from another thread while
none runs gets a process of its own (common.export.one_shot). Either way the verifier dies with the run, however
that ends (the kernel's parent-death signal), and is killed when the run is interrupted or fails while waiting.

    python -m common.harness.verifier serve   # a JSON request a line on stdin, a reply a line on stdout
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from common import export
from common.device import die_with_parent, fork_is_safe
from common.errors import UserError, one_line

_server: list = []  # the run's verifier (`serve`, or a forked child), while it lives
_server_lock = threading.Lock()


def install(stopping=None) -> None:
    """From here on, every check of this process goes to the run's verifier (common.export.use_service).
    `stopping() -> bool`: whether the run has got a stop signal; a verifier killed meanwhile gives no verdict."""
    export.use_service(check)
    if stopping is not None:
        export.when_stopping(stopping)


def check(request: dict) -> tuple[int, str]:
    with _server_lock:
        if _server and _server[0].poll() is not None:
            _server.clear()
        if _server or threading.current_thread() is threading.main_thread():
            return _served(request)
    return export.one_shot(request)


def start_verifier(device_type: str, wanted: bool = True, stopping=None) -> None:
    """Serve this run's checks from one verifier. On the CPU, fork it now, before this process has a device, a
    process group, other threads or a model (the Transformers backend patches transformers' classes when it builds
    one): it starts with the stack imported (4-5 CPU-seconds less than `serve`) and computes on one thread (the
    parent's OpenMP pool is not in it). Elsewhere (a Neuron runtime must not be forked; an accelerator run's
    verifier keeps a fresh process's threads), and where a fork is not safe (device.fork_is_safe), the first check
    starts `python -m common.harness.verifier serve`. Either verifier ignores the run's stop signals (a Ctrl-C or
    SIGTERM to the process group stops the run, not its check); `stopping`: as `install`'s."""
    install(stopping)
    if not wanted or device_type != "cpu" or not fork_is_safe():
        return
    with _server_lock:
        if not _server:
            _server.append(_ForkedVerifier())
            _close_at_exit()


class _ForkedVerifier:
    """The verifier as a forked child (multiprocessing's fork context), with the Popen members the checks use."""

    def __init__(self) -> None:
        import multiprocessing

        requests, self_requests = os.pipe()
        self_replies, replies = os.pipe()
        self.log = tempfile.TemporaryFile("w+")  # its output, read if it ends during a check
        self._proc = multiprocessing.get_context("fork").Process(
            target=_forked_serve, name="verifier", daemon=True,
            args=(die_with_parent(), requests, replies, self.log.fileno(), (self_requests, self_replies)))
        self._proc.start()
        os.close(requests)
        os.close(replies)
        self.pid = self._proc.pid
        self.stdin = os.fdopen(self_requests, "w")
        self.stdout = os.fdopen(self_replies, "r")

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("verifier", timeout)
        return self._proc.exitcode


def _forked_serve(arm, requests: int, replies: int, log: int, parents: tuple[int, int]) -> None:
    """In the forked verifier: die with the run, keep none of its pipe ends, signal handlers, output or threads."""
    import gc
    import signal

    import torch

    arm()
    for fd in parents:
        os.close(fd)
    for sig in export.STOP_SIGNALS:  # the run's stop handlers are the run's; its stop is not this check's verdict:
        signal.signal(sig, signal.SIG_IGN)  # the run ends or kills this verifier (and it dies with the run)
    os.dup2(log, 1)  # never the run's stdout or stderr (a pipe someone reads to its end)
    os.dup2(log, 2)
    torch.set_num_threads(1)  # before any op
    gc.freeze()  # the run's imports
    gc.enable()
    _serve(os.fdopen(requests, "r"), os.fdopen(replies, "w"))


def _close_at_exit() -> None:
    atexit.unregister(_close_server)  # once, however many verifiers this process has started
    atexit.register(_close_server)  # at this process's exit its input ends, and it with it


def _served(request: dict) -> tuple[int, str]:
    if not _server:
        log = tempfile.TemporaryFile("w+")  # its output, read if it ends during a check
        _server.append(export.python_module("common.harness.verifier", "serve", stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log))
        _server[0].log = log
        _close_at_exit()
    proc = _server[0]
    try:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
    except BrokenPipeError:
        reply = ""
    except BaseException:
        _server.clear()
        proc.kill()
        proc.wait()
        raise
    if not reply:  # it ended during the check (killed, out of memory): its last words, as a one-shot's
        _server.clear()
        proc.wait()
        proc.log.seek(0)
        code = proc.returncode or 1
        return code, export.last_line(proc.log.read()) if export.no_verdict(code) is None else ""
    reply = json.loads(reply)
    return reply["code"], reply.get("error", "")


def _close_server() -> None:
    if _server:
        proc = _server.pop()
        proc.stdin.close()  # it ends at the end of its input
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _serve(requests, replies) -> int:
    """`python -m common.harness.verifier serve`: a JSON request a line on stdin ({export_dir, reference, out,
    files}), the check written to `out` as `verify` writes it, and a reply a line on stdout ({code, error}: 0, 2 for a folder or
    reference it refuses, 1 for anything else). Ends at the end of its input."""
    import gc

    for line in requests:
        req = json.loads(line)
        try:
            export.verify_to(Path(req["export_dir"]), Path(req["reference"]), Path(req["out"]), files=req["files"])
            reply = {"code": 0}
        except UserError as e:
            reply = {"code": 2, "error": one_line(str(e))}
        except Exception as e:  # as the last line of a one-shot verifier's traceback
            reply = {"code": 1, "error": one_line(f"{type(e).__name__}: {e}")}
        gc.collect()  # the model read is freed before the next check
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def _main(argv: list[str] | None = None) -> int:
    import gc

    gc.disable()  # the import of transformers takes about a fifth less CPU time; `serve` collects after each check
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["serve"]:
        print("error: usage: python -m common.harness.verifier serve", file=sys.stderr)
        return 2
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
    return _serve(sys.stdin, replies)


if __name__ == "__main__":
    sys.exit(_main())
