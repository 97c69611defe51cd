"""Launching a training run: the world size it will have, whether the batch splits over it, and the self-launch
under torchrun (`--nproc_per_node N` without torchrun, on one host or, with `--nnodes`, the same command on each
host) with its checks of cores and memory.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from common.device import GIB
from common.errors import UserError, one_line
from common.results import HELD_LOCKS, hold_lock
from common.harness import torchrun_parent
from common.harness.preflight import NEURON_SYSTEM
from common.harness.stops import DEADLINE, EXIT_STOPPED, FAILED_MARK, SELF_LAUNCHED, STOP_GRACE_S, STOP_SIGNALS


def under_launcher() -> bool:
    """Inside torchrun (or any launcher that set the rank variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def planned_world_size(cfg) -> int:
    """The world size this run will have: the launcher's, or --nproc_per_node x --nnodes for a self-launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) if under_launcher() else cfg.guards.nproc_per_node * cfg.guards.nnodes


def launches(cfg) -> bool:
    """This process starts the run's workers (torchrun below it): more than one process, and no launcher above."""
    return (cfg.guards.nproc_per_node > 1 or cfg.guards.nnodes > 1) and not under_launcher()


PROCESS_GIB = 1.5  # one tiny-preset training process on CPU: torchtitan logs about 1.4 GiB resident at step 1


def check_nproc(cfg) -> None:
    """Before a self-launch: a node rank below --nnodes, no more processes than the host has cores (CPU) or GPUs,
    and memory for their start-up, unless --oversubscribe."""
    if cfg.guards.node_rank >= cfg.guards.nnodes:
        raise UserError(f"--node_rank {cfg.guards.node_rank} is not below --nnodes {cfg.guards.nnodes} (node ranks "
                        f"are 0 to {cfg.guards.nnodes - 1})")
    nproc_per_node = cfg.guards.nproc_per_node
    if not launches(cfg) or nproc_per_node <= 1 or cfg.guards.oversubscribe:
        return
    import psutil
    import torch

    from common.device import resolve_device_type

    device_type = resolve_device_type(cfg.device)
    have = {"cpu": os.cpu_count() or 1, "cuda": torch.cuda.device_count() if device_type == "cuda" else 0}
    free = psutil.virtual_memory().available / GIB
    if device_type in have and nproc_per_node > have[device_type]:
        raise UserError(f"--nproc_per_node {nproc_per_node} starts more processes than this host has "
                        f"{'cores' if device_type == 'cpu' else 'GPUs'} ({have[device_type]}); pass --oversubscribe "
                        "to start them anyway")
    if nproc_per_node * PROCESS_GIB > free:
        raise UserError(f"--nproc_per_node {nproc_per_node} needs about {nproc_per_node * PROCESS_GIB:.0f} GiB to start "
                        f"and {free:.1f} GiB are free; pass --oversubscribe to start them anyway")


# AWS's variables for EFA between hosts ("When running an application make sure the following environment variables are
# set": aws-neuron-sdk@81ce03a:frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.rst:160-166; FORK_SAFE
# for kernels before 5.15: neuron-runtime/nrt-troubleshoot.rst:748-758), set for the workers where unset.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


def check_nodes(cfg) -> None:
    """Before a multi-node launch, on each host: a --master_addr that resolves, on Neuron one the other hosts can
    reach (not loopback); EFA present where it must be (--device neuron, or --check_efa) with AWS's variables set;
    on node 0 a --master_port it can bind, on the others node 0's rendezvous endpoint reachable (a node started
    before node 0 waits for it, saying so, up to --rendezvous_wait_s; a stop signal then exits EXIT_STOPPED). Each
    failure is one UserError naming this node."""
    from common.device import resolve_device_type

    node = f"node {cfg.guards.node_rank} of {cfg.guards.nnodes}"
    # every node: torchrun would wait on a name that never resolves
    addresses = resolve_master(cfg.guards.master_addr, node)
    neuron = cfg.device == "neuron" or resolve_device_type(cfg.device) == "neuron"
    if neuron and all_loopback(addresses):  # two "nodes" on one CPU host over loopback (the tests) stay allowed
        raise UserError(f"{node}: --master_addr {cfg.guards.master_addr} is this host's loopback address, which no "
                        f"other host reaches: with --nnodes {cfg.guards.nnodes} pass node 0's address (`hostname -I` on "
                        "node 0), the same on every node")
    if cfg.guards.check_efa or neuron:
        efa = check_efa(node)
        if neuron:
            print(efa_pairing(node, efa), file=sys.stderr if len(efa) < len(neuron_devices()) else sys.stdout,
                  flush=True)
        for var, value in EFA_ENV.items():
            os.environ.setdefault(var, value)  # the workers inherit them (torchrun passes its environment on)
    if cfg.guards.node_rank:
        wait_for_endpoint(cfg.guards.master_addr, cfg.guards.master_port, cfg.guards.rendezvous_wait_s, node)
    else:  # torchrun's store on this node binds the port: one another process holds is its traceback
        check_port_free(cfg.guards.master_port, node)


def resolve_master(addr: str, node: str) -> list[str]:
    """The addresses --master_addr resolves to; an empty one, or one that does not resolve, is one UserError naming
    this node (torchrun would raise a ValueError for the empty one, and on node 0 wait for the other without end)."""
    fix = "pass node 0's address or host name, the same on every node"
    if not addr.strip():
        raise UserError(f"{node}: --master_addr is empty (an unset shell variable?): {fix}")
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)})
    except (OSError, UnicodeError, ValueError) as e:
        problem = one_line(getattr(e, "strerror", None) or str(e))
        raise UserError(f"{node}: --master_addr {addr!r} does not resolve ({problem}): {fix}") from None


def check_port_free(port: int, node: str) -> None:
    """Node 0: --master_port bound for a moment (on every interface, as torchrun's store binds it), so that a port
    another process holds is one UserError before torchrun, not its traceback. SO_REUSEADDR as the store's own: a
    port an earlier run left in TIME_WAIT is taken."""
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: the IPv4 bind decided
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                raise UserError(f"{node}: --master_port {port} cannot be bound on this host "
                                f"({one_line(e.strerror or str(e))}): another process holds it (an earlier run "
                                "still ending, another service): pass a free port, the same on every node") from None


def all_loopback(addresses: list[str]) -> bool:
    """Whether every address --master_addr resolves to (resolve_master) is a loopback one (127.0.0.0/8, ::1; a host
    name that /etc/hosts maps to 127.0.1.1 too)."""
    import ipaddress

    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


# Where AWS's EFA installer puts libfabric's tools (fi_info), which AWS then tells users to add to PATH: non-login,
# SLURM and container shells often lack it (aws-neuron-sdk@81ce03a:vllm-neuron/docs/getting-started/setup-guide.md:
# 186-192, "This installs Libfabric under `/opt/amazon/efa`" ... `export PATH=/opt/amazon/efa/bin:$PATH`).
EFA_BIN = Path("/opt/amazon/efa/bin")


def find_fi_info() -> str | None:
    """libfabric's fi_info: on PATH, else in AWS's EFA folder; None where neither has it."""
    import shutil

    return shutil.which("fi_info") or shutil.which("fi_info", path=str(EFA_BIN))


def check_efa(node: str) -> set[str]:
    """The EFA devices `fi_info -p efa` lists (AWS's documented check), by the domain names of their endpoints
    (`rdmap16s27`, an RDM and a datagram endpoint each): none, or no fi_info, is a UserError."""
    import subprocess

    fi_info = find_fi_info()
    if fi_info is None:
        raise UserError(f"{node}: no fi_info on PATH nor in {EFA_BIN} (where AWS's EFA installer puts it): the EFA "
                        "software (libfabric) is not installed, and the ranks of several hosts talk over EFA (install "
                        "it: docs/first-hour-trn2.md, \"The second hour: two nodes\")")
    try:
        out = subprocess.run([fi_info, "-p", "efa"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"{node}: `fi_info -p efa` did not run: {one_line(str(e))}") from None
    endpoints = sum(1 for line in out.stdout.splitlines() if line.strip().startswith("provider:")
                    and line.split(":", 1)[1].strip() == "efa")
    if out.returncode != 0 or endpoints == 0:
        raise UserError(f"{node}: `fi_info -p efa` lists no EFA endpoint (exit {out.returncode}: "
                        f"{one_line(out.stderr or out.stdout) or 'no output'}): this host's EFA is not configured")
    domains = (line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if line.strip().startswith("domain:"))
    return {d.rsplit("-", 1)[0] for d in domains if d} or {f"endpoint {i}" for i in range(endpoints)}


def neuron_devices(dev: Path = Path("/dev")) -> list[str]:
    """The Neuron devices the driver exposes, /dev/neuronN (AWS's count of them: `ls /dev/neuron*`,
    aws-neuron-sdk@81ce03a:deploy/environments/docker-setup.rst:112)."""
    return sorted(p.name for p in dev.glob("neuron*") if p.name[len("neuron"):].isdigit())


def efa_pairing(node: str, efa: set[str], dev: Path = Path("/dev")) -> str:
    """The EFA devices against the Neuron devices, as AWS pairs them on trn2: each Trainium2 chip connected to its own
    EFA interface (16 and 16 on a trn2.48xlarge: aws-neuron-sdk@81ce03a:neuron-runtime/about/collectives.rst:110),
    each NeuronCore using its chip's (libfabric's "EFA NIC selection for trn2", ofiwg/libfabric#12251). A line for
    the launch: fewer EFA devices than chips is a warning (launched without all its EFA interfaces)."""
    chips = neuron_devices(dev)
    if len(efa) >= len(chips):
        return (f"[launch] {node}: {len(efa)} EFA device(s) for {len(chips)} Neuron device(s): one for each chip, as "
                "trn2 pairs them (each NeuronCore uses its chip's EFA interface)")
    return (f"[launch] {node}: warning: {len(efa)} EFA device(s) for {len(chips)} Neuron device(s): trn2 connects "
            "each chip to its own EFA interface (a trn2.48xlarge has 16), and the collectives of a chip without "
            "its interface cross the host or fail: launch the instance with all its EFA interfaces (its launch "
            "template's network interfaces: docs/first-hour-trn2.md, \"The second hour: two nodes\")")


class _StoppedWaiting(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def wait_for_endpoint(addr: str, port: int, wait_s: float, node: str) -> None:
    """Connect to node 0's rendezvous endpoint until it answers (a TCP connection, closed at once), printing once
    that this node waits; past `wait_s` seconds, one UserError naming the endpoint. A stop signal meanwhile ends the
    process with EXIT_STOPPED and one line, as a launch stopped before its workers started does (self_launch)."""

    def stop(signum, _frame):
        raise _StoppedWaiting(signum)

    before = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        _wait_for_endpoint(addr, port, wait_s, node)
    except _StoppedWaiting as e:
        print(f"[stopped] {signal.Signals(e.signum).name} while {node} waited for node 0 at {addr}:{port}: nothing "
              "was trained by this launch; run the same command again", flush=True)
        raise SystemExit(EXIT_STOPPED) from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _wait_for_endpoint(addr: str, port: int, wait_s: float, node: str) -> None:
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(wait_s, 0.1))):
                return
        except OSError as e:
            problem = one_line(e.strerror or str(e))
        if time.monotonic() >= deadline:
            raise UserError(f"{node}: node 0's endpoint {addr}:{port} did not accept a connection in {wait_s:g} s "
                            f"({problem}): start node 0 first, check --master_addr/--master_port and that TCP between "
                            "the hosts is open (the neuron backend also opens a random port on node 0)")
        if not said:
            print(f"[launch] {node}: waiting for node 0 at {addr}:{port} (up to {wait_s:g} s, --rendezvous_wait_s)",
                  flush=True)
            said = True
        time.sleep(1.0)


def check_same_stack(record: dict | None = None) -> None:
    """On a run over several hosts (WORLD_SIZE above LOCAL_WORLD_SIZE), right after the process group exists, before
    anything is built: each node's stack (node_stack: packages, the Neuron OS packages, libfabric) and settings (its
    --nnodes and --nproc_per_node as torchrun got them, and `record`, the run record it checked: every setting a
    resume must match; by default the one the scripts' own launch handed its workers) gathered over a gloo group from
    each node's local rank 0. A node that differs from node 0 is one UserError on every rank (compare_nodes)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() <= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return
    mine = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per node: the same command, packages and settings on each
        record = record if record is not None else launched_record()  # rank (and 64 dpkg queries at once, none)
        mine = {"node": int(os.environ.get("GROUP_RANK", "0")), "host": socket.gethostname(), "stack": node_stack(),
                "settings": None if record is None else {
                    # torchrun's own: the --nnodes and --nproc_per_node this node was started with (torch's
                    # local_elastic_agent sets both for every worker; static rendezvous: GROUP_WORLD_SIZE = --nnodes)
                    "--nnodes": _env_int("GROUP_WORLD_SIZE"), "--nproc_per_node": _env_int("LOCAL_WORLD_SIZE"),
                    **node_settings(record)}}
    everyone: list = [None] * dist.get_world_size()
    group = dist.new_group(backend="gloo")  # host objects over TCP, whatever the device's backend
    try:
        dist.all_gather_object(everyone, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    compare_nodes([n for n in everyone if n is not None])


def _env_int(name: str) -> int | str | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else value


def compare_nodes(nodes: list[dict]) -> None:
    """Each node's {"node", "host", "stack", "settings"} against node 0's: where any differ, one UserError naming
    each such node, its host, and each package and setting with node 0's value beside it. A value absent on both
    (an OS package on CPU) is equal; settings are compared only between nodes that both report them (a node under
    a torchrun of the user's reports none unless the caller passes its record)."""
    nodes = sorted(nodes, key=lambda n: n["node"])
    base, problems, fixes = nodes[0], [], {}
    for other in nodes[1:]:
        stack = _differing(base["stack"], other["stack"])
        settings = _differing(base["settings"], other["settings"]) if base["settings"] and other["settings"] else []
        if not stack and not settings:
            continue
        if stack:
            fixes["install the same packages on every node"] = True
        if settings:
            fixes["run the same command on every node, only --node_rank differing"] = True
        said = f"node {other['node']} ({one_line(other['host'])})"
        if stack:
            said += f" runs another stack than node 0 ({one_line(base['host'])}): {', '.join(stack)}"
        if settings:
            said += (" and was started with other settings: " if stack else
                     f" was started with other settings than node 0 ({one_line(base['host'])}): ") + ", ".join(settings)
        problems.append(said)
    if problems:
        raise UserError(f"{'; '.join(problems)}; {' and '.join(fixes)}")


def _differing(base: dict, other: dict) -> list[str]:
    """`name value (node 0: value)` for each key whose values differ (a key one side lacks: None there)."""
    out = []
    for key in sorted(set(base) | set(other), key=str):
        a, b = base.get(key), other.get(key)
        if a == b:
            continue
        if isinstance(a, dict) or isinstance(b, dict):  # files: which ones, not their hashes
            names = sorted(n for n in set(a or {}) | set(b or {}) if (a or {}).get(n) != (b or {}).get(n))
            out.append(f"{key} differ from node 0's ({', '.join(map(one_line, names[:5]))}"
                       f"{f' and {len(names) - 5} more' if len(names) > 5 else ''})")
        else:
            shown = [json.dumps(v, default=str) if key[:2] == "--" or not isinstance(v, (str, type(None))) else
                     "not installed" if v is None else v for v in (b, a)]  # packages: their version, as pip says
            out.append(f"{key} {one_line(shown[0])} (node 0: {one_line(shown[1])})")
    return out


def node_settings(record: dict) -> dict:
    """What every node's run record must share (common/harness/resume.py's run_record: the script, every setting a
    resume must match, --steps as the schedule's length, the data), flattened to `--flag: value`, leaving out what
    differs between hosts that hold the same files: modification times (the hf_checkpoint folder's safetensors are
    compared by name and size, the training files by size and hash)."""
    view = {"script": record.get("script"), "--steps": record.get("schedule_steps"), "data": record.get("dataset")}
    for key, value in (record.get("settings") or {}).items():
        view[f"--{key}"] = value
    weights = view.get("--hf_checkpoint")
    if isinstance(weights, dict):
        view["--hf_checkpoint"] = weights.get("path")
        view["--hf_checkpoint files"] = {"config.json": weights.get("config_sha256"), **{
            name: entry[0] for name, entry in (weights.get("safetensors") or {}).items()}}
    data = record.get("data")
    if isinstance(data, dict) and isinstance(data.get("files"), dict):
        view["training files"] = {name: {k: v for k, v in entry.items() if k != "mtime_ns"}
                                  for name, entry in data["files"].items() if isinstance(entry, dict)}
    return view


# The Neuron OS packages a multi-node run's collectives depend on (the runtime, collectives and driver AWS's update
# page installs: apt `aws-neuronx-dkms`, `aws-neuronx-runtime-lib`, `aws-neuronx-collectives`, the same names for dnf;
# aws-neuron-sdk@81ce03a:setup/pytorch/update-dlami.rst:149-151,171-173). Neuron 2.33.1 changed only these three.
NEURON_OS_PACKAGES = tuple(NEURON_SYSTEM)  # their names (the preflight holds them to the found stack's versions)


def node_stack() -> dict[str, str | None]:
    """What a node's ranks run on and two nodes must share: the pip packages results.json records
    (common.results.versions: nki and nki-library among them where installed), the Neuron OS packages where this host
    has them, and libfabric's version where fi_info is (all absent on CPU: absent on every node is equal)."""
    from common import results

    return {**results.versions(), **neuron_os_packages(), **libfabric_version()}


def neuron_os_packages() -> dict[str, str]:
    """NEURON_OS_PACKAGES installed here, by dpkg (Ubuntu) or rpm (Amazon Linux): {name: version}; {} where neither
    tool is or none of them is installed."""
    import shutil
    import subprocess

    if shutil.which("dpkg-query"):  # -W: what dpkg knows, the status beside each ("ii": installed)
        cmd = ["dpkg-query", "-W", "-f=${Package}\t${db:Status-Abbrev}\t${Version}\n", *NEURON_OS_PACKAGES]
    elif shutil.which("rpm"):  # rpm -q lists installed packages only (the rest as "package X is not installed")
        cmd = ["rpm", "-q", "--queryformat", "%{NAME}\tii\t%{VERSION}-%{RELEASE}\n", *NEURON_OS_PACKAGES]
    else:
        return {}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return installed_os_packages(out)


def installed_os_packages(listing: str) -> dict[str, str]:
    """NEURON_OS_PACKAGES from a `name<TAB>status<TAB>version` listing (neuron_os_packages' queries), installed only."""
    found = {}
    for line in listing.splitlines():
        name, status, version = (line.split("\t") + ["", "", ""])[:3]
        if name in NEURON_OS_PACKAGES and status.startswith("ii") and version:
            found[name] = version
    return found


def libfabric_version() -> dict[str, str]:
    """{"libfabric": version} as `fi_info --version` prints it (its line `libfabric: VERSION`: ofiwg/libfabric@af8ddbe
    util/info.c:356-357), {} where there is no fi_info or it prints no such line."""
    import subprocess

    fi_info = find_fi_info()
    if fi_info is None:
        return {}
    try:
        out = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("libfabric:")]
    return {"libfabric": found[0]} if found and found[0] else {}


def hold_out_dir(out_dir: Path, node_rank: int = 0) -> None:
    """The out_dir's lock (common.results.hold_lock) for the whole run. The holder is the process the user started on
    node 0 (a self-launch's torchrun inherits it), or rank 0 under a torchrun of the user's."""
    if os.environ.get(SELF_LAUNCHED) or int(os.environ.get("RANK", "0")) != 0 or node_rank != 0:
        return
    hold_lock(Path(out_dir))


def self_launch(cfg, argv: list[str], out_dir: Path, deadline: float | None = None,
                record: dict | None = None) -> int:
    """Re-run this script under torchrun with --nproc_per_node workers on this host (with --nnodes > 1: this host's
    share of a run that the same command with another --node_rank starts on each other host); returns the exit
    code. A stop signal (SIGTERM, SIGINT, SIGUSR1, SIGHUP) to this process is passed to the workers, which finish
    their step, agree with every other rank (on every node) to stop there, save it and end (harness/stops.py); each
    node's launch then exits EXIT_STOPPED, also when torchrun got the signal too (a host's shutdown signals every
    process) and reports it its own way. A second signal kills every process of this node's share at once.
    torchrun gets SIGTERM, once, if this process dies (however: torchrun_parent.py), the workers SIGKILL if torchrun
    does: nothing outlives the launch. torchrun, when it gets a signal itself, passes it on (SIGUSR1 too) and waits
    STOP_GRACE_S for the workers' stop save before it kills them (its default, 30 s, is shorter than a large
    model's save). `record`: the run record this launcher checked, handed to the workers (launched_record) so that
    none computes it again."""
    import subprocess
    import tempfile

    rest, skip = [], False
    for arg in argv:  # drop our own --nproc_per_node (both `--flag N` and `--flag=N`)
        if skip:
            skip = False
        elif arg == "--nproc_per_node":
            skip = True
        elif not arg.startswith("--nproc_per_node="):
            rest.append(arg)
    where = (["--standalone"] if cfg.guards.nnodes == 1 else  # torchrun's static rendezvous at node 0's address
             [f"--nnodes={cfg.guards.nnodes}", f"--node_rank={cfg.guards.node_rank}",
              f"--master_addr={cfg.guards.master_addr}",
              f"--master_port={cfg.guards.master_port}"])
    logs = rank_logs_dir(out_dir, cfg.guards.node_rank)
    check_logs_dir(logs)
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={cfg.guards.nproc_per_node}",
           *rank_log_flags(cfg.guards.nproc_per_node, logs), *torchrun_stop_flags(), *rest]
    with tempfile.TemporaryDirectory(prefix="qwen3-launch-") as tmp:
        marker = Path(tmp) / "stopped"  # on this host: a worker that stopped the run says so here, and exits 0
        if record is not None:
            (Path(tmp) / LAUNCH_RECORD).write_text(json.dumps(record, default=str))
        env = worker_env(os.environ, marker, deadline)
        # torchrun sets this to 1 itself for several processes a node, after a 4-line banner saying so: set first,
        # the same setting without the banner (torch 2.14's torch/distributed/run.py)
        env.setdefault("OMP_NUM_THREADS", "1")
        started = time.time()
        parent = [sys.executable, "-S", torchrun_parent.__file__, str(os.getpid())]
        proc = subprocess.Popen([*parent, *cmd], start_new_session=True, env=env, pass_fds=tuple(HELD_LOCKS))
        first = []

        def stop(signum, _frame):  # only signals here: the main thread's wait() below sees the exit
            now = time.monotonic()
            if not first:  # the same signal to the workers: the stop record names the one that came
                first.extend((now, signum, False))
                first[2] = _signal_workers(proc.pid, signum)
            elif now - first[0] > 1.0:  # not the same signal sent to the whole process group
                os.write(2, f"error: {signal.Signals(signum).name} again: every process of the run killed at once; "
                            "the last complete checkpoint stays usable\n".encode())
                _kill_tree(proc.pid)
                os._exit(128 + signum)

        for sig in STOP_SIGNALS:
            signal.signal(sig, stop)
        code = proc.wait()
        failed = marker.with_name(FAILED_MARK)
        if failed.exists():  # a worker's check failed after training: its line, exit 2 (as without a launch)
            print(failed.read_text(errors="replace").strip(), file=sys.stderr, flush=True)
            return 2
        if not marker.exists():  # a stop's mark: every worker of this host saved and ended; torchrun's own exit
            if first and not first[2]:  # is not 0 when it got the signal too
                print(f"[stopped] {signal.Signals(first[1]).name} before any worker of this node started (torchrun "
                      "was starting them or waiting for the other nodes): nothing was trained by this launch; run "
                      "the same command again", flush=True)
                return EXIT_STOPPED
            if code < 0:  # torchrun itself ended by a signal: the shell's 128 + N, not sys.exit's 256 - N
                code = 128 - code
            if code:
                for line in failed_ranks(logs, started):
                    print(line, file=sys.stderr, flush=True)
            return code
        if cfg.guards.node_rank:  # node 0's rank 0 has said it; another node's own output says it here
            print(marker.read_text(errors="replace").strip(), flush=True)
        return EXIT_STOPPED


def rank_logs_dir(out_dir: Path, node_rank: int) -> Path:
    """Where a self-launch keeps this node's ranks' output: torchrun makes a folder of its own in it for each launch
    (`<run id>_<random>/attempt_0/<local rank>/stdout.log, stderr.log, error.json`), so a resume adds one."""
    return Path(out_dir) / "logs" / f"node{node_rank}"


def check_logs_dir(logs: Path) -> None:
    """The ranks' log folder (rank_logs_dir) and the OUT_DIR/logs above it made, or found as folders: a file or a
    symbolic link to nothing there is one UserError before torchrun (whose own mkdir would be its traceback)."""
    for folder in (logs.parent, logs):
        if folder.is_symlink() and not folder.exists():
            what = "a symbolic link to nothing"
        elif folder.exists() and not folder.is_dir():
            what = "a FIFO" if folder.is_fifo() else "a file"
        else:
            continue
        raise UserError(f"{folder} is {what}, not a folder: the scripts' own launch keeps each rank's output there; "
                        "move it out of --out_dir")
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{logs} cannot be made: {one_line(e.strerror or str(e))}") from None


def rank_log_flags(nproc_per_node: int, logs: Path) -> list[str]:
    """torchrun's flags for the ranks' output: local rank 0 on this console as it prints it (not prefixed, not
    delayed), every other local rank's stdout and stderr in files under `logs` (torchrun's --local-ranks-filter
    alone would send them to /dev/null), and each rank's uncaught exception in its error.json."""
    others = ",".join(f"{rank}:3" for rank in range(1, nproc_per_node))
    return ["--local-ranks-filter=0", f"--log-dir={logs}", *([f"--redirects={others}"] if others else [])]


def launch_logs(out_dir: Path) -> str | None:
    """The folder, relative to OUT_DIR, where torchrun keeps this launch's ranks' output (rank_logs_dir's, or a
    --log-dir of the user's torchrun inside OUT_DIR); None where it keeps none there."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <log dir>/<launch>/attempt_<n>/<local rank>/error.json
    if not error_file:
        return None
    try:
        return str(Path(error_file).resolve().parents[2].relative_to(Path(out_dir).resolve()))
    except (ValueError, IndexError):
        return None


def failed_ranks(logs: Path, since: float, tail: int = 2) -> list[str]:
    """After a launch that failed: for each local rank whose output went to a file in this launch (written since
    `since`) and which printed an `error:` line or a traceback, that rank's last such lines and the file."""
    lines = []
    for err in sorted(Path(logs).glob("*/attempt_*/*/stderr.log"), key=lambda p: (len(p.parent.name), p.parent.name)):
        try:
            if err.stat().st_mtime < since:
                continue
            text = err.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found = [line for line in text if line.startswith("error:") or line.startswith("Traceback")
                 or (line and not line[0].isspace() and ("Error:" in line or "Exception:" in line))]
        if found:
            last = "; ".join(one_line(line) for line in found[-tail:])
            lines.append(f"[launch] local rank {err.parent.name} failed: {last} (its whole output: {err})")
    return lines


def torchrun_stop_flags() -> list[str]:
    """torchrun's flags for a stop: wait STOP_GRACE_S after passing on a signal before killing the workers, and
    pass on SIGUSR1 (SLURM's --signal) as well as its default four."""
    return [f"--shutdown-timeout={STOP_GRACE_S}", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


LAUNCH_RECORD = "record.json"  # beside the stop marker: the run record the launcher checked


def launched_record() -> dict | None:
    """In a worker of the scripts' own launch: the run record its launcher computed and checked (the settings and the
    training data's identity, whose hashing would otherwise be repeated by every rank, 64 on a trn2 host, reading
    the same corpus at once); None in any other process, or where the file cannot be read (then it is computed)."""
    marker = os.environ.get(SELF_LAUNCHED)
    if not marker:
        return None
    try:
        record = json.loads((Path(marker).parent / LAUNCH_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def worker_env(environ, marker: Path, deadline: float | None) -> dict:
    """The workers' environment: where a stop is reported, and this launch's deadline; a DEADLINE this process
    inherited is not this launch's and is dropped."""
    from common.harness.phases import COMMAND_START, process_start

    env = {k: v for k, v in environ.items() if k not in (DEADLINE, COMMAND_START)}
    env[SELF_LAUNCHED] = str(marker)
    env[COMMAND_START] = repr(process_start())  # the workers count their time to step 1 from the user's command
    if deadline:
        env[DEADLINE] = repr(deadline)
    return env


def _signal_workers(pid: int, sig: int) -> bool:
    """`sig` to torchrun's workers (each in a session of its own), or to torchrun while it has none yet; whether
    there were workers. `pid`: torchrun's parent (torchrun_parent.py), which starts it at once."""
    import psutil

    try:
        parent, deadline = psutil.Process(pid), time.monotonic() + 5
        while not (torchrun := parent.children()) and time.monotonic() < deadline and parent.is_running():
            time.sleep(0.01)  # the parent forks torchrun first thing
        workers = [w for t in torchrun for w in t.children()]
    except psutil.NoSuchProcess:
        return False
    for target in workers or torchrun:
        try:
            target.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return bool(workers)


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun's parent and every process below it (torchrun's workers are in sessions of their own)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
