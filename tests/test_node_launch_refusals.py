"""Several nodes, refused before torchrun in one line on the node that has the problem: a --master_addr that is
empty or does not resolve (every node), a --master_port node 0 cannot bind; and a stop signal to a node that waits
for node 0 ends it with the stop's exit code and line, as node 0's launch does in the same wait."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.errors import UserError
from common.harness import launcher
from common.harness.stops import EXIT_STOPPED

REPO = Path(__file__).resolve().parents[1]


def _nodes(**kw):
    base = dict(device="cpu", check_efa=False, node_rank=0, nnodes=2, master_addr="127.0.0.1", master_port=1,
                rendezvous_wait_s=0.1)
    kw = {**base, **kw}
    return SimpleNamespace(device=kw.pop("device"), guards=SimpleNamespace(**kw))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_master_addr_that_does_not_resolve_or_is_empty_is_one_line_on_every_node(rank):
    with pytest.raises(UserError, match=rf"^node {rank} of 2: --master_addr 'no-such-host\.invalid' does not resolve "
                                        r"\(.+\): pass node 0's address or host name, the same on every node$"):
        launcher.check_nodes(_nodes(node_rank=rank, master_addr="no-such-host.invalid"))
    with pytest.raises(UserError, match=rf"^node {rank} of 2: --master_addr is empty \(an unset shell variable\?\): "
                                        r"pass node 0's address or host name, the same on every node$"):
        launcher.check_nodes(_nodes(node_rank=rank, master_addr=""))


def test_a_master_port_in_use_on_node_0_is_one_line_before_torchrun():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UserError, match=rf"^node 0 of 2: --master_port {port} cannot be bound on this host "
                                            r"\(.+\): another process holds it \(an earlier run"):
            launcher.check_nodes(_nodes(master_port=port))
    launcher.check_port_free(port, "node 0 of 2")  # free again: taken


WAITER = textwrap.dedent("""
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, {repo!r})
    from common.harness import launcher
    launcher.wait_for_endpoint("127.0.0.1", {port}, 60.0, "node 1 of 2")  # check_nodes' wait, without torch
    print("not stopped", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_a_stop_signal_to_a_node_waiting_for_node_0_exits_75_with_a_line(sig):
    """A node started before node 0 waits for it (up to --rendezvous_wait_s); a stop signal then (a SLURM requeue,
    a spot reclaim) ends it with EXIT_STOPPED, which the documented SLURM script requeues on, and one line."""
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", WAITER.format(repo=str(REPO), port=port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = proc.stdout.readline()  # the wait's own line: the node is waiting now
        assert "waiting for node 0" in line, line + proc.stderr.read()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 5))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_STOPPED, (proc.returncode, out, err)
    assert out.strip() == (f"[stopped] {sig.name} while node 1 of 2 waited for node 0 at 127.0.0.1:{port}: nothing "
                           "was trained by this launch; run the same command again"), (out, err)
    assert "Traceback" not in err
