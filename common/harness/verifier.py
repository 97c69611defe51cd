"""One verifier process serves every check of a training run (the load check at step 1, the export check at the
end): torch and transformers are imported once, each folder is read anew, one check at a time.

On the CPU the run forks it before it has a device, a process group, other threads or a model (`start_verifier`);
elsewhere the first check starts `python -m common.harness.verifier serve`. A check from another thread while
none runs gets a process of its own (`_one_shot`). Either way the verifier dies with the run, however
that ends (the kernel's parent-death signal), and is killed when the run is interrupted or fails while waiting.
A verifier killed while the run is stopping gives no verdict (CheckInterrupted).

    python -m common.harness.verifier serve   # a JSON request a line on stdin, a reply a line on stdout
    python -m common.harness.verifier verify EXPORT_DIR --reference REF.safetensors --out check.json

`verify` checks an export on its own, its inputs first: --reference a reference of the export's shape, --out a
new file or a previous check's JSON.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from common import export, results
from common.errors import ArgumentParser, UserError, one_line
from common.harness.stops import STOP_SIGNALS
from common.processes import die_with_parent, fork_is_safe

_server: list = []  # the run's verifier (`serve`, or a forked child), while it lives
_server_lock = threading.Lock()
_stopping: list = []  # () -> whether the run has been told to stop (common/harness/stops.py), when installed


class CheckInterrupted(KeyboardInterrupt):
    """A check that ended without a verdict: its verifier was killed by a signal while the run was being stopped.
    Neither a pass nor a fail: the run ends as interrupted, what was checked is left as it was (an export staged)."""


def install(stopping=None) -> None:
    """From here on, every check of this process goes to the run's verifier (common.export.use_service).
    `stopping() -> bool`: whether the run has got a stop signal; a verifier killed meanwhile gives no verdict."""
    export.use_service(check)
    if stopping is not None:
        _stopping[:] = [stopping]


def check(request: dict) -> tuple[int, str]:
    """One check for common.export: (exit code, error line), or CheckInterrupted when it has no verdict."""
    code, error = _check(request)
    if (interrupted := no_verdict(code)) is not None:
        raise interrupted
    return code, error


def _check(request: dict) -> tuple[int, str]:
    with _server_lock:
        if _server and _server[0].poll() is not None:
            _server.clear()
        if _server or threading.current_thread() is threading.main_thread():
            return _served(request)
    return _one_shot(request)


def no_verdict(code: int) -> CheckInterrupted | None:
    """The verifier ended with `code` during a check: a CheckInterrupted when that was a signal's doing while the run
    is stopping (or a stop signal's, which the verifier ignores: someone else sent it), else None (a verdict)."""
    if code >= 0 or not (-code in STOP_SIGNALS or (_stopping and _stopping[0]())):
        return None
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    return CheckInterrupted(f"the checks' verifier ended by {name} during a check, while the run was stopping: no "
                            "verdict")


def start_verifier(device_type: str, wanted: bool = True, stopping=None) -> None:
    """Serve this run's checks from one verifier. On the CPU, fork it now, before this process has a device, a
    process group, other threads or a model (the Transformers backend patches transformers' classes when it builds
    one): it starts with the stack imported (4-5 CPU-seconds less than `serve`) and computes on one thread (the
    parent's OpenMP pool is not in it). Elsewhere (a Neuron runtime must not be forked; an accelerator run's
    verifier keeps a fresh process's threads), and where a fork is not safe (processes.fork_is_safe), the first check
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

    import torch

    arm()
    for fd in parents:
        os.close(fd)
    for sig in STOP_SIGNALS:  # the run's stop handlers are the run's; its stop is not this check's verdict:
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
        _server.append(python_module("common.harness.verifier", "serve", stdin=subprocess.PIPE,
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
        return code, last_line(proc.log.read()) if no_verdict(code) is None else ""
    reply = json.loads(reply)
    return reply["code"], reply.get("error", "")


def python_module(module: str, *args: str, **popen) -> subprocess.Popen:
    """`python -m MODULE ARGS` of this repository, dying with this process (SIGKILL) and ignoring the run's stop
    signals: a Ctrl-C or a SIGTERM to the process group stops the run, which then ends or kills it; it is never the
    verdict of a check that the signal cut short."""
    repo_root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=f"{repo_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    arm = die_with_parent()

    def start() -> None:
        arm()
        for sig in STOP_SIGNALS:  # ignored across exec: Python keeps an ignored SIGINT ignored
            signal.signal(sig, signal.SIG_IGN)

    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, text=True, preexec_fn=start, **popen)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error:")), (lines or ["?"])[-1])


def _one_shot(request: dict) -> tuple[int, str]:
    """One check in a process of its own (`python -m common.export REQUEST`) that dies with the run and ignores its
    stop signals: (exit code, its error line)."""
    proc = python_module("common.export", json.dumps(request), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, stderr = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode, last_line(stderr) if proc.returncode else ""


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
            verify_to(Path(req["export_dir"]), Path(req["reference"]), Path(req["out"]), files=req["files"])
            reply = {"code": 0}
        except UserError as e:
            reply = {"code": 2, "error": one_line(str(e))}
        except Exception as e:  # as the last line of a one-shot verifier's traceback
            reply = {"code": 1, "error": one_line(f"{type(e).__name__}: {e}")}
        gc.collect()  # the model read is freed before the next check
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def verify_to(export_dir: Path, reference: Path, out: Path, files: bool) -> dict:
    """common.export.verify_to with its inputs checked: --out before the work (a bad one is named now, not after the
    model has run), --reference before the weights are read."""
    _check_out(out, export_dir, reference)
    return export.verify_to(export_dir, reference, out, files, check_reference=_check_reference)


REFERENCE_TENSORS = {"input_ids": ("I64", "I32"), "position_ids": ("I64", "I32"),
                     "logits": ("F32", "F16", "BF16", "F64")}


def _check_reference(reference: Path, config: dict) -> None:
    """--reference of the verifier: a regular safetensors file holding input_ids and position_ids ([batch, tokens],
    integers) and the trained model's logits ([batch, tokens, vocab_size], floats). Read from its header, before
    anything is loaded; each way it can be wrong is one UserError naming it."""
    from common.checkpoint import require_regular_file, safetensors_header

    if not os.path.lexists(reference):
        raise UserError(f"--reference {reference} does not exist")
    require_regular_file(reference)
    try:
        header = safetensors_header(reference)
    except UserError as e:
        raise UserError(f"--reference is not a readable safetensors file: {e}") from None
    missing = [k for k in REFERENCE_TENSORS if k not in header]
    if missing:
        raise UserError(f"--reference {reference} holds no {', '.join(missing)}: it is not an export check's "
                        "reference (input_ids, position_ids, logits)")
    shapes = {k: header[k]["shape"] for k in REFERENCE_TENSORS}
    wrong = [f"{k}: {header[k]['dtype']}" for k, kinds in REFERENCE_TENSORS.items() if header[k]["dtype"] not in kinds]
    vocab = config.get("vocab_size")
    if (len(shapes["input_ids"]) != 2 or 0 in shapes["input_ids"] or shapes["position_ids"] != shapes["input_ids"]
            or shapes["logits"][:2] != shapes["input_ids"] or len(shapes["logits"]) != 3
            or (isinstance(vocab, int) and shapes["logits"][2] != vocab)):
        wrong.append("shapes " + ", ".join(f"{k} {v}" for k, v in shapes.items())
                     + f" (expected [batch, tokens] twice and [batch, tokens, {vocab}])")
    if wrong:
        raise UserError(f"--reference {reference} does not fit the export: {'; '.join(wrong)}")


CHECK_KEYS = ("missing_keys", "unexpected_keys", "tied_lm_head", "max_abs_logit_diff")  # in every check's JSON
CHECK_MAX = 16 << 20  # bytes: a check's JSON is a few KiB


def is_check_json(path: Path) -> bool:
    """Whether the regular file at `path` holds an export check's JSON (what `verify_to` writes)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(CHECK_MAX + 1)
        check = json.loads(raw.decode("utf-8")) if len(raw) <= CHECK_MAX else None
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(check, dict) and all(k in check for k in CHECK_KEYS)


def _check_out(out: Path, export_dir: Path, reference: Path) -> None:
    """--out of the verifier: a new file, or a previous check's JSON it replaces; never --reference, nothing inside
    the folder it checks, no other file (a user's weights, notes): each is a UserError naming it, the file kept."""
    results.refuse_non_file(out, what="a file for the check's JSON", fix="give a file path")
    where = Path(out).parent.resolve() / Path(out).name  # the name written (a link there is replaced, not followed)
    if where == Path(reference).resolve() or Path(out).resolve() == Path(reference).resolve():
        raise UserError(f"--out {out} is the --reference file: the check would replace it; give another path")
    folder = Path(export_dir).resolve()
    if folder in where.parents or folder in Path(out).resolve().parents or where == folder:
        raise UserError(f"--out {out} lies inside {export_dir}, the folder it checks: the check would change it; "
                        "give a path outside it")
    if os.path.exists(out) and not is_check_json(Path(out)):
        raise UserError(f"--out {out} is an existing file that is not an export check's JSON: it is left alone; give "
                        "a new path, or a previous check's file")


def _main(argv: list[str] | None = None) -> int:
    import gc

    gc.disable()  # the import of transformers takes about a fifth less CPU time; `serve` collects after each check
    p = ArgumentParser(description="The export checks' verifier: a run's (serve), or one export's (verify).")
    commands = p.add_subparsers(dest="cmd", required=True)
    commands.add_parser("serve", help="a JSON request a line on stdin, a reply a line on stdout")
    verify = commands.add_parser("verify", help="re-read an HF export and compare its logits with a reference")
    verify.add_argument("export_dir", type=Path)
    verify.add_argument("--reference", type=Path, required=True,
                        help="safetensors file with input_ids, position_ids and the trained model's logits")
    verify.add_argument("--out", type=Path, required=True, help="where to write the check as JSON")
    verify.add_argument("--weights_only", action="store_true", help="a checkpoint, not an export: no tokenizer needed")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
        return _serve(sys.stdin, replies)
    try:
        check = verify_to(args.export_dir, args.reference, args.out, files=not args.weights_only)
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(json.dumps(check))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
