"""The parent the scripts' own launch gives torchrun: one thread, so that torchrun gets the parent-death SIGTERM once.

    python -S common/harness/torchrun_parent.py LAUNCHER_PID TORCHRUN_COMMAND...

Linux sends a process its parent-death signal each time it is reparented, and a parent's children are reparented
once for every thread of it that ends while they are its children. Started by the launcher itself (a process with
several threads: pyarrow's allocator among them), torchrun got SIGTERM once for each thread when the launcher was
killed with SIGKILL, passed each on to its workers (a second signal ends a run at once) and ended on the third, its
workers killed in the middle of their stop save. This process has one thread (started with -S, it imports only the
standard library): it dies with the launcher (SIGKILL; how often does not matter), starts torchrun with SIGTERM as
its parent-death signal, ignores the stop signals (the launcher passes them on to the workers itself; a host's
shutdown signals torchrun directly) and ends as torchrun ends, with its exit code or its signal.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# common.harness.stops.STOP_SIGNALS (not imported: this process loads nothing of the repository)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def main(argv: list[str]) -> int:
    launcher, command = int(argv[0]), argv[1:]
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:  # the launcher ended before the line above
        return 128 + signal.SIGKILL
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # torchrun: the stop signals at their default again (an ignored signal stays ignored over exec)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != me:
            os._exit(128 + signal.SIGTERM)
        try:
            os.execv(command[0], command)
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # torchrun ended by a signal: end by it too, as the launcher reads torchrun's end
        signal.signal(-code, signal.SIG_DFL)
        os.kill(me, -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
