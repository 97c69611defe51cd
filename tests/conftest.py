"""Shared helpers: run an example as a subprocess (the real CLI) and read its results.json."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import psutil
import pytest

# One torch thread in the test processes too (the commands they start get one from script_env): the suite runs
# three test processes on two cores, and an OpenMP thread of a test that runs torch in its own process (the bug
# replay's in-process runs, the op and parity tests) spins waiting for a busy core. Set before anything here
# imports torch, which reads it when it loads. Measured: the op, parity and compile-audit files with one core
# kept busy took 21.0 CPU-s with torch's default two threads and 14.3 with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))  # the examples' own helper packages (compat_check, hf_backend)

from common import paths  # noqa: E402


def script_env() -> dict:
    # One torch thread per script process (as torchrun gives each worker): two test workers share the 2 cores
    # of CI, and a second thread per process only waits for a busy core.
    # glibc's malloc hands every tensor above its mmap threshold back to the OS when it is freed, and a CPU training
    # step frees and maps again its activations and gradients each step: a third of a tiny step's time went to
    # the kernel's page faults. Large settings keep them in the heap (test processes only; the scripts as they
    # are). What they change: docs/testing.md.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ["OMP_NUM_THREADS"],
               MALLOC_MMAP_THRESHOLD_="4294967296", MALLOC_TRIM_THRESHOLD_="17179869184")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def sigint_as_in_a_terminal() -> None:
    """Popen's preexec_fn for a command that a test sends SIGINT: SIGINT at its default, as a command typed in a
    terminal has it. A test run started in the background of a non-interactive shell (`make test &` in a
    script) inherits SIGINT ignored, and so would the command: the test's Ctrl-C would then never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def example_command(script: str, *args: str, torchrun: int = 0) -> list[str]:
    """The command line of an example: plain python, or torchrun with `torchrun` processes."""
    path = str(ROOT / "examples" / script)
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                path, *args]
    return [sys.executable, path, *args]


def start_python(cmd: list[str], output: Path | str, cwd: Path = ROOT) -> subprocess.Popen:
    """`subprocess.Popen(cmd)` for a command that a test signals or kills while it runs: a process group of its
    own (a signal to the group reaches the command as a terminal's Ctrl-C would), SIGINT at its default as in a
    terminal, its stdout and stderr in the file `output` (os.devnull for none)."""
    with open(output, "ab") as log:
        return subprocess.Popen(cmd, cwd=cwd, env=script_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def run_python(cmd: list[str], *, env: dict | None = None, cwd: Path = ROOT,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` with the scripts' environment (script_env), in a process
    group of its own (as a command typed in a terminal: a signal the command sends its group stays in it)."""
    return subprocess.run(cmd, cwd=cwd, env=script_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True)


# The scripts that run as a process of their own even on one process: torchtitan's Transformers backend replaces
# transformers' init functions in the process it runs in (a test process that ran it would build every later
# transformers model through them).
OWN_PROCESS = ("train_hf_backend.py",)


def run_example(script: str, *args: str, torchrun: int = 0, timeout: int = 600, check: bool = True,
                process: bool = False) -> subprocess.CompletedProcess:
    """An example's command line, its exit code and output: under torchrun, self-launched (`--nproc_per_node`), a
    script of OWN_PROCESS or with `process` a real process (run_python); else in this test process (run_in_process,
    the script as `__main__` with the scripts' environment), without a fresh interpreter's seconds of imports."""
    cmd = example_command(script, *args, torchrun=torchrun)
    if torchrun or process or script in OWN_PROCESS or "--nproc_per_node" in args:
        proc = run_python(cmd, timeout=timeout)
    else:
        proc = run_in_process(script, *args, env=script_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_in_process(script: str, *args: str, cwd: Path | None = None,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """An example's command line run in this test process, as `python examples/SCRIPT ARGS` runs it: the script
    itself as `__main__` (its own `if __name__ == "__main__":` entry, not a function the test picks), with its
    arguments in sys.argv, its stdout and stderr captured, its exit code from SystemExit; a traceback that escapes
    it is its stderr with exit code 1, as the interpreter would print it. For the refusals, the checks and the
    one-process training runs that a test reads after they end (a run a test signals or kills runs as a process:
    start_python), without a fresh interpreter's seconds of imports. What the run changes in this process is put
    back: the environment, the folder, sys.argv, sys.path, the signal handlers, the root logger's handlers, the
    out_dir lock, the process group and the compiled graphs the run made (ended, as its process's end would end
    them). The
    repository's modules stay imported from one run to the next (a copied example runs as a process: run_python)."""
    import io
    import logging
    import runpy
    import traceback

    path = str(ROOT / "examples" / script)
    saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), sys.argv, list(sys.path)
    saved_sigs = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                                                   signal.SIGUSR2)}
    root_handlers = list(logging.getLogger().handlers)
    from common import results

    held = len(results.HELD_LOCKS)  # the out_dir locks this process holds (a process's end releases them)
    import torch
    import torch.distributed as dist

    grouped = dist.is_initialized()
    out, err, rc = io.StringIO(), io.StringIO(), 0
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd or ROOT)
        sys.argv = [path, *args]
        sys.path[0:0] = [os.path.dirname(path)]  # as python puts the script's folder first
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # torchrun's error handler cannot enable faulthandler on a captured stderr (it has no file descriptor)
            warnings.filterwarnings("ignore", "Unable to enable fault handler")
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:  # what the interpreter prints for an exception that escapes a script
                traceback.print_exc()
                rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        for s, handler in saved_sigs.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        logging.getLogger().handlers[:] = root_handlers
        while len(results.HELD_LOCKS) > held:  # the run's lock, released as its process's end would release it
            os.close(results.HELD_LOCKS.pop())
        if dist.is_initialized() and not grouped:  # the run's process group and meshes, ended as its process would
            dist.destroy_process_group()
        torch._dynamo.reset()  # what the run compiled: a later run compiles afresh, as a new process would
    return subprocess.CompletedProcess([sys.executable, path, *args], rc, out.getvalue(), err.getvalue())


def run_module_in_process(module: str, *argv: str):
    """`python -m MODULE ARGV` in this test process: the module's own command-line entry (`_main`, what its
    `__main__` runs) with ARGV, its stdout and stderr captured; a SystemExit's code or its return value is the exit
    code, an exception that escapes it is a traceback on stderr and exit code 1, as the interpreter would give."""
    import importlib
    import io
    import traceback

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = importlib.import_module(module)._main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  as the interpreter prints it
            traceback.print_exc()
            rc = 1
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], rc, out.getvalue(), err.getvalue())


def kill_when(script: str, *args: str, ready: Callable[[], bool], what: str, torchrun: int = 0,
              timeout: float = 400) -> None:
    """Run an example and SIGKILL it, every process of it, as soon as `ready()` holds; fail if it
    ends first or `what` does not happen within `timeout` seconds."""
    proc = start_python(example_command(script, *args, torchrun=torchrun), os.devnull)  # a process group of its own
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, f"run ended (exit {proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"no {what} in time"
            time.sleep(0.1)
    finally:
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every process below it, and wait until they are gone. A signal to the process group
    is not enough: torchrun starts each worker in a session of its own, so its workers would outlive it and
    finish the run. Each process is stopped before the kill, so none starts another between listing and kill."""
    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        while new := [p for p in (root, *root.children(recursive=True)) if p.pid not in procs]:
            for p in new:
                procs[p.pid] = p
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.suspend()
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    _, alive = psutil.wait_procs([p for pid, p in procs.items() if pid != proc.pid], timeout=60)
    assert not alive, f"still running after SIGKILL: {alive}"


def kill_after_checkpoint(script: str, *args: str, out_dir: Path, step: int, torchrun: int = 0) -> None:
    """Run an example, SIGKILL it (every process of it) once torchtitan's checkpoint for `step` is
    complete (its .metadata is written last), and check that it died mid-run."""
    marker = Path(out_dir) / "checkpoint" / f"step-{step}" / ".metadata"
    kill_when(script, *args, "--out_dir", str(out_dir), ready=marker.exists, what=f"the step-{step} checkpoint",
              torchrun=torchrun)
    assert not (Path(out_dir) / "results.json").exists()  # it really died mid-run


def read_results(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "results.json").read_text())


def known_noise(text: str) -> list[str]:
    """The lines of common/torchtitan_fixes.py's KNOWN_NOISE_LOGS and KNOWN_NOISE_WARNINGS found in a run's output:
    none in a clean run (quiet_known_noise leaves them out)."""
    import re

    from common.torchtitan_fixes import KNOWN_NOISE_LOGS, KNOWN_NOISE_WARNINGS

    return [n for n in KNOWN_NOISE_LOGS if n in text] + [w for w in KNOWN_NOISE_WARNINGS if re.search(w, text)]


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A bad input ends in a non-zero exit and one readable message, never a traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(errors) == 1, proc.stderr[-4000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


# Training runs that several test files read, each run once per test session (`shared_run`).
GOLDEN_DIR = ROOT / "tests" / "assets" / "golden_losses"
GOLDEN_TOL = 1e-3  # float32 on CPU: 0.0 run to run here; CPU kernels of other instruction sets may move it
# The arguments both training paths get when their losses are compared (the tiny preset's defaults, spelled out).
SAME_RUN = ("--dtype", "float32", "--seq_len", "128", "--local_batch_size", "2", "--warmup_steps", "2",
            "--lr", "3e-3", "--seed", "0")
# The native script's 2-rank runs: the tiny Qwen3 from its HF folder (made at set-up), 8 steps (room for two stops and
# steps after them), half the tiny preset's tokens, the global batch spelled out (a resume on another number of ranks
# keeps it). The stop tests' commands add --no-export; the shared run that never stops exports from FSDP shards.
TWO_RANKS_RUN = ("--hf_checkpoint", str(paths.asset_dir("tiny_qwen3", check=False)), "--steps", "8", "--seed", "1",
                 "--seq_len", "64", "--global_batch_size", "4")
TWO_RANKS = (*TWO_RANKS_RUN, "--no-export")
SHARED_RUNS = {  # name: (script, arguments, torchrun processes[, environment, "{out}" its out_dir])
    # the tiny preset, 10 steps, exported, its losses compared with the golden ones; validated at step 1 and every
    # 2 steps (2 batches), TensorBoard on (tests/test_eval.py)
    "native_tiny": ("train_native_qwen3.py", ("--preset", "tiny", "--steps", "10", "--compare_losses",
                                              str(GOLDEN_DIR / "train_native_qwen3.tiny.json"),
                                              "--loss_tolerance", str(GOLDEN_TOL), "--eval_every", "2",
                                              "--eval_steps", "2", "--tensorboard"), 0),
    # the tiny Qwen3 from its HF folder under torchrun, 3 steps of SAME_RUN (the HF backend's extended comparison)
    "native_tiny_2_ranks": ("train_native_qwen3.py", ("--hf_checkpoint", "{tiny_qwen3}", "--steps", "3", *SAME_RUN), 2),
    # the other two training paths, validated at step 1 and every 2 steps, exported: the HF backend priced, 10 steps
    # (its compiled run, tests/test_compile.py, is this command compiled), the MoE script 6 steps under torchrun over 2
    # processes (its 2-rank test reads it too)
    "hf_tiny": ("train_hf_backend.py", ("--steps", "10", "--eval_every", "2", "--eval_steps", "1", "--price_per_hour",
                                        "12.5"), 0),
    "moe_tiny_2_ranks": ("train_moe_nki.py", ("--steps", "6", "--eval_every", "2", "--eval_steps", "1"), 2),
    # the native 4B preset's dry run (trn2's 64 ranks planned on this CPU), its full run's time and cost projected,
    # as a process of its own: a second sharded meta build in one process fails in FSDP (tests/test_dry_run.py,
    # tests/test_attention_choice.py, tests/test_pilot.py)
    "native_4b_dry_run": ("train_native_qwen3.py", ("--preset", "qwen3_4b", "--dry_run", "--assumed_mfu", "0.3",
                                                    "--price_per_hour", "50"), 0),
    # the native script's 2-rank run (own launch), the one the stop and reshard tests' runs would be had they never
    # stopped: the tiny Qwen3 from its HF folder (load check before step 1), 8 steps, exported from FSDP shards, every
    # rank's batches traced (the reshard debug trace, in the folder `NAME.trace` beside the out_dir)
    # (and one torchtitan setting by its dotted name, at torchtitan's own default: tests/test_dotted_settings.py)
    "native_2_ranks_8_steps": ("train_native_qwen3.py", (*TWO_RANKS_RUN, "--nproc_per_node", "2",
                                                         "--training.max_norm", "1.0"), 0,
                               {"QWEN3_RECIPES_RESHARD_DEBUG": "{out}.trace"}),
}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, prepared_assets) -> Callable[[str], tuple[Path, dict]]:
    """shared_run(name) -> (out_dir, results) of one of SHARED_RUNS. The first test process that asks
    runs it; another that asks meanwhile waits for it (pytest-xdist runs test files in two processes,
    and their session root folder is shared). Tests only read the folder. What the command printed (stdout, then
    stderr) is in the file `name`.log beside it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared_runs"
    root.mkdir(exist_ok=True)

    def get(name: str) -> tuple[Path, dict]:
        script, args, torchrun, *env = SHARED_RUNS[name]
        args = [a.format(tiny_qwen3=prepared_assets["tiny_qwen3"]) for a in args]
        out, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")), pytest.MonkeyPatch.context() as mp:
            for var, value in (env[0] if env else {}).items():
                mp.setenv(var, value.format(out=out))
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)
                proc = run_example(script, *args, "--out_dir", str(out), torchrun=torchrun, process="--dry_run" in args)
                (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
                done.write_text(" ".join(args))
        return out, read_results(out)

    return get


@pytest.fixture(scope="session")
def prepared_assets():
    from tools import prepare_assets as assets

    return assets.prepare(["tokenizer", "corpus", "tiny_qwen3"])


# pytest-xdist hands whole files to its three workers (`--dist loadfile`), by default sorted by their number of tests:
# the files of a few long multi-process tests (the stop chain, the copies, the dry runs, the killed runs; in the
# extended tier the MoE reshard and the compatibility training rows) came last and ran on alone at the end. Handed
# out first, they run beside the many short in-process files, which fill the end; every other file keeps xdist's
# order (most tests first), given here (`--no-loadscope-reorder`). Measured: docs/testing.md.
FIRST_FILES = ("test_stop.py", "test_reshard.py", "test_compat_train.py", "test_copy.py", "test_copy_core.py",
               "test_dry_run.py", "test_compat_offline.py", "test_resume.py", "test_rank_logs.py")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extended: a further end-to-end run of a promise that `make test` already runs end to end once "
        "(a second launch layout, another recipe's copy, a bench's tiny mode); `make test` leaves these out, "
        "`make test-extended` runs them (docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    count = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    first = {name: i for i, name in enumerate(FIRST_FILES)}
    items.sort(key=lambda item: (first.get(item.path.name, len(FIRST_FILES)), -count[item.path.name]))  # stable


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A small tmpfs mounted at `folder` (a full disk for real, not a patched write); skips where it cannot be
    mounted (it needs root)."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)])
