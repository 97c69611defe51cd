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
    assert len(launcher.check_efa("node 0 of 2")) == 2


def test_the_efa_devices_are_counted_against_the_neuron_devices_as_trn2_pairs_them(tmp_path, monkeypatch):
    """trn2 connects each Trainium2 chip to its own EFA interface (16 and 16 on a trn2.48xlarge): the launch counts
    the EFA devices `fi_info -p efa` lists (by their endpoints' domains, an RDM and a datagram endpoint each) against
    the /dev/neuronN devices, one line; fewer EFA devices than chips is a warning naming the fix."""
    listing = "\n".join(f"provider: efa\n    fabric: efa\n    domain: rdmap{16 + i}s27-{kind}"
                        for i in range(16) for kind in ("rdm", "dgrm"))
    monkeypatch.setattr(launcher, "EFA_BIN", _fi_info(tmp_path / "efa", listing))
    monkeypatch.setenv("PATH", "/nonexistent")
    efa = launcher.check_efa("node 0 of 2")
    assert len(efa) == 16 and "rdmap16s27" in efa
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [f"neuron{i}" for i in range(16)] + ["neuron_sys", "null"]:
        (dev / name).write_text("")
    assert launcher.efa_pairing("node 0 of 2", efa, dev) == (
        "[launch] node 0 of 2: 16 EFA device(s) for 16 Neuron device(s): one for each chip, as trn2 pairs them (each "
        "NeuronCore uses its chip's EFA interface)")
    short = launcher.efa_pairing("node 1 of 2", set(sorted(efa)[:4]), dev)
    assert short.startswith("[launch] node 1 of 2: warning: 4 EFA device(s) for 16 Neuron device(s)"), short
    assert "launch the instance with all its EFA interfaces" in short


def _nodes(**kw):
    base = dict(device="neuron", check_efa=False, node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=1,
                rendezvous_wait_s=0.1)
    kw = {**base, **kw}
    return SimpleNamespace(device=kw.pop("device"), guards=SimpleNamespace(**kw))


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
    launcher.check_nodes(_nodes(device="cpu", node_rank=0, master_port=0))  # 0: any free port


def _record(*flags: str) -> dict:
    """The run record a node computes for the scripts' tiny recipe started with `flags` (resume.run_record, which a
    resume must match and the launch hands its workers)."""
    from common.harness import lifecycle, resume
    from slow_native_qwen3 import recipe

    native = recipe()
    cfg = lifecycle.parse(native, ["--no-export", "--out_dir", "o", *flags])
    return resume.run_record(native.name, cfg, world_size=cfg.guards.nproc_per_node * cfg.guards.nnodes, dataset=None)


def _node(rank: int, record: dict, stack: dict | None = None, nnodes: int = 2, nproc: int = 1) -> dict:
    return {"node": rank, "host": f"host{rank}", "stack": stack if stack is not None else launcher.node_stack(),
            "settings": {"--nnodes": nnodes, "--nproc_per_node": nproc, **launcher.node_settings(record)}}


def test_nodes_started_with_other_settings_are_one_line_naming_the_node_and_each_setting():
    """67.1: another --lr on node 1 trained; another --nnodes or --nproc_per_node was accepted (the record then held
    node 0's world size); another --steps ended in gloo tracebacks. Each is named against node 0's value."""
    same = _record("--steps", "3")
    launcher.compare_nodes([_node(0, same), _node(1, _record("--steps", "3"))])  # the same command: nothing to say
    with pytest.raises(UserError, match=r"^node 1 \(host1\) was started with other settings than node 0 \(host0\): "
                                        r"--lr 0\.03 \(node 0: 0\.003\); run the same command on every node, only "
                                        r"--node_rank differing$"):
        launcher.compare_nodes([_node(0, same), _node(1, _record("--steps", "3", "--lr", "0.03"))])
    with pytest.raises(UserError) as said:
        launcher.compare_nodes([_node(1, _record("--steps", "5"), nnodes=3, nproc=2), _node(0, same)])
    assert str(said.value) == ("node 1 (host1) was started with other settings than node 0 (host0): --nnodes 3 "
                               "(node 0: 2), --nproc_per_node 2 (node 0: 1), --steps 5 (node 0: 3); run the same "
                               "command on every node, only --node_rank differing")


def test_the_neuron_os_packages_and_libfabric_are_compared_absent_on_both_being_equal():
    """66.4: the runtime, collectives and driver OS packages, nki, nki-library and libfabric join the stack the
    nodes compare: one package of another version is named; on CPU (none of them here) two nodes are equal."""
    here = launcher.node_stack()
    assert not {"aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-dkms", "libfabric", "nki",
                "nki_library"} & set(here)  # this CPU host has none of them
    record = _record("--steps", "3")
    launcher.compare_nodes([_node(0, record, here), _node(1, record, dict(here))])
    neuron = {**here, "nki": "0.7.0", "aws-neuronx-runtime-lib": "2.35.30.0", "aws-neuronx-collectives": "2.35.43.0",
              "aws-neuronx-dkms": "2.31.7.0", "libfabric": "2.1.0"}
    with pytest.raises(UserError, match=r"^node 1 \(host1\) runs another stack than node 0 \(host0\): "
                                        r"aws-neuronx-collectives 2\.35\.44\.0 \(node 0: 2\.35\.43\.0\); install the "
                                        r"same packages on every node$"):
        launcher.compare_nodes([_node(0, record, neuron),
                                _node(1, record, {**neuron, "aws-neuronx-collectives": "2.35.44.0"})])
    # what the package manager lists (dpkg-query's Package, status, Version): installed ones only
    listing = ("aws-neuronx-collectives\tii \t2.35.43.0-1a2b3c\naws-neuronx-dkms\trc \t2.30.2.0\n"
               "aws-neuronx-runtime-lib\tii \t2.35.30.0-4d5e6f\n")
    assert launcher.installed_os_packages(listing) == {"aws-neuronx-collectives": "2.35.43.0-1a2b3c",
                                                       "aws-neuronx-runtime-lib": "2.35.30.0-4d5e6f"}


NODE = """
import os, sys
import torch.distributed as dist
from common.errors import UserError
from common.harness import launcher
dist.init_process_group("gloo")
try:
    launcher.check_same_stack()  # as the guarded run calls it, right after the process group exists
    print("no error")
except UserError as e:
    print("error:", e)
finally:
    dist.destroy_process_group()
"""


def test_two_nodes_exchange_their_settings_and_packages_and_each_names_node_1(tmp_path):
    """Two "nodes" of one process each on this host (gloo over loopback), as the scripts' own launch starts them:
    each worker's run record from its launcher (record.json), torchrun's variables. Node 1 was started with --lr
    0.03 and has another collectives package (a dpkg-query on its PATH that lists one): both nodes say so in the
    same line, before anything is built."""
    import json
    import socket
    import subprocess
    import sys

    from common.harness.stops import SELF_LAUNCHED
    from conftest import ROOT, script_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dpkg = tmp_path / "bin" / "dpkg-query"
    dpkg.parent.mkdir()
    dpkg.write_text("#!/bin/sh\nprintf 'aws-neuronx-collectives\\tii \\t2.35.43.0\\n'\n")
    dpkg.chmod(0o755)
    procs = []
    for rank, flags in ((0, ()), (1, ("--lr", "0.03"))):
        launch = tmp_path / f"launch{rank}"
        launch.mkdir()
        (launch / launcher.LAUNCH_RECORD).write_text(json.dumps(_record("--steps", "3", *flags)))
        env = {**script_env(), "PYTHONPATH": str(ROOT), SELF_LAUNCHED: str(launch / "stopped"), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
               "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if rank:
            env["PATH"] = f"{dpkg.parent}:{env['PATH']}"
        procs.append(subprocess.Popen([sys.executable, "-c", NODE], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    said = [p.communicate(timeout=120)[0].strip() for p in procs]
    host = socket.gethostname()
    assert said == [f"error: node 1 ({host}) runs another stack than node 0 ({host}): aws-neuronx-collectives "
                    f"2.35.43.0 (node 0: not installed) and was started with other settings: --lr 0.03 (node 0: "
                    "0.003); install the same packages on every node and run the same command on every node, only "
                    "--node_rank differing"] * 2, said
