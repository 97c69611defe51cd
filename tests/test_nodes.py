"""Several nodes, without a second host: where the launch looks for libfabric's fi_info, the loopback --master_addr
refused on Neuron before anything waits, and what the nodes compare once their process group exists (their
settings and their stacks, OS packages and libfabric included) so that one differing node is one line on every
node. The runs over two "nodes" on this host: tests/test_stop.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.errors import UserError
from common.harness import launcher


def _fi_info(folder, output: str):
    """A stand-in for libfabric's fi_info that prints `output` (what it prints per endpoint: `provider: efa` ...)."""
    folder.mkdir(parents=True)
    tool = folder / "fi_info"
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\n")  # printf: a builtin, found without PATH
    tool.chmod(0o755)
    return folder


def test_fi_info_is_found_in_awss_efa_folder_off_path_and_the_refusal_names_that_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    if not launcher.Path("/opt/amazon/efa/bin/fi_info").exists():  # this host has no EFA: the refusal names both
        with pytest.raises(UserError, match=r"^node 1 of 2: no fi_info on PATH nor in /opt/amazon/efa/bin \(where "
                                            "AWS's EFA installer puts it\\)"):
            launcher.check_efa("node 1 of 2")
    efa = _fi_info(tmp_path / "opt/amazon/efa/bin", "provider: efa\n    fabric: efa\nprovider: efa\n    fabric: efa")
    monkeypatch.setattr(launcher, "EFA_BIN", efa)  # AWS's folder, here under tmp_path: fi_info is not on PATH
    assert launcher.check_efa("node 0 of 2") == 2


def _nodes(**kw):
    base = dict(device="neuron", check_efa=False, node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=1,
                rendezvous_wait_s=0.1)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "127.0.1.1", "::1"])
def test_a_loopback_master_addr_with_several_nodes_is_refused_on_neuron_before_anything_waits(addr):
    """On Neuron, --nnodes 2 with the default --master_addr 127.0.0.1: one line on each node, before node 1 waits
    for node 0 (its wait would end only after --rendezvous_wait_s, the issue's 600 s) and before the EFA check."""
    for rank in (0, 1):
        with pytest.raises(UserError, match=rf"^node {rank} of 2: --master_addr {addr} is this host's loopback "
                                            r"address, which no other host reaches: with --nnodes 2 pass node 0's"):
            launcher.check_nodes(_nodes(node_rank=rank, master_addr=addr))


def test_two_nodes_over_loopback_stay_allowed_on_cpu():
    """Two "nodes" on one CPU host over loopback (the multi-node tests): node 0 has nothing to wait for."""
    launcher.check_nodes(_nodes(device="cpu", node_rank=0))
