"""A training run's checks of a model folder (the load check at step 1, the export check at the end), each in a
process of its own: `python -m common.export REQUEST` (no state shared with the trainer, whose libraries may have
patched transformers), dying with the run however that ends (the kernel's parent-death signal) and ignoring the
run's stop signals. A check the run's stop cut short (its process killed while the run is stopping) gives no verdict
(CheckInterrupted): the run ends as interrupted, what was checked is left as it was.

    python -m common.harness.verifier verify EXPORT_DIR --reference REF.safetensors --out check.json

`verify` checks an export on its own, its inputs first: --reference a reference of the export's shape, --out a
new file or a previous check's JSON. `reference` writes the load check's reference (ReferenceLogits): transformers'
logits of an HF folder on the reference text.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from common import export, results
from common.errors import ArgumentParser, UserError, one_line
from common.harness.stops import STOP_SIGNALS
from common.processes import die_with_parent


class CheckInterrupted(KeyboardInterrupt):
    """A check that ended without a verdict: its process was killed by a signal while the run was being stopped.
    Neither a pass nor a fail: the run ends as interrupted, what was checked is left as it was (an export staged)."""


class Verifier:
    """The run's checks (common.export.verify_export_subprocess's `check`): one process each. `stopping() -> bool`:
    whether the run has got a stop signal; a check process killed meanwhile gives no verdict."""

    def __init__(self, stopping=None):
        self.stopping = stopping

    def __call__(self, request: dict) -> tuple[int, str]:
        """(exit code, error line), or CheckInterrupted when it has no verdict."""
        proc = python_module("common.export", json.dumps(request), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, stderr = proc.communicate()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        code = proc.returncode
        if (interrupted := no_verdict(code, self.stopping)) is not None:
            raise interrupted
        return code, last_line(stderr) if code else ""


def no_verdict(code: int, stopping=None) -> CheckInterrupted | None:
    """The check's process ended with `code`: a CheckInterrupted when that was a signal's doing while the run is
    stopping (or a stop signal's, which the check ignores: someone else sent it), else None (a verdict)."""
    if code >= 0 or not (-code in STOP_SIGNALS or (stopping is not None and stopping())):
        return None
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    return CheckInterrupted(f"the check's process ended by {name} during a check, while the run was stopping: no "
                            "verdict")


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


OWN_PROCESS_BYTES = 2 << 30  # above this, a Transformers-backend run's load check reference is a process of its own


class ReferenceLogits:
    """The load check's reference: transformers' float32 logits of the HF folder the run starts from, on the
    reference text, computed where it costs step 1 least:
    - where the trainer patches transformers (the Transformers backend) and the folder's weights are large
      (`own_process`: over OWN_PROCESS_BYTES), in a process of its own (`python -m common.harness.verifier
      reference`) started beside the run's imports and build (it depends on nothing the run builds): `wait` at step 1
      waits only for what is left of it;
    - where the trainer patches transformers and the weights are small (`now`), here, now, before the build patches
      it: seconds, where a second interpreter's imports beside the build cost several on a small host;
    - elsewhere in this process, at `wait` (transformers is imported here for the export check anyway)."""

    def __init__(self, hf_dir: Path, tokenizer_dir: Path, own_process: bool = True, now: bool = False):
        self.hf_dir, self.tokenizer_dir, self.proc, self.folder, self.ready = hf_dir, tokenizer_dir, None, None, None
        if now and not own_process:
            self.ready = self._compute()
        elif own_process:
            import tempfile

            self.folder = tempfile.TemporaryDirectory(prefix="qwen3-load-reference-")
            self.out = Path(self.folder.name) / "load_reference.safetensors"
            self.proc = python_module("common.harness.verifier", "reference", str(hf_dir), "--tokenizer",
                                      str(tokenizer_dir), "--out", str(self.out), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)

    def wait(self, stopping=None) -> dict:
        """{input_ids, position_ids, logits}; a UserError (its error line) where transformers cannot load the folder,
        CheckInterrupted where a stop cut the process short (`stopping() -> bool`: whether the run is stopping)."""
        from safetensors.torch import load_file

        if self.proc is None:
            got = self.ready if self.ready is not None else self._compute()
            if isinstance(got, UserError):
                raise got
            return got
        try:
            _, stderr = self.proc.communicate()
        except BaseException:
            self.close()
            raise
        code = self.proc.returncode
        if (interrupted := no_verdict(code, stopping)) is not None:
            raise interrupted
        if code:
            raise UserError(f"transformers cannot load it: {last_line(stderr)}")
        tensors = load_file(str(self.out))
        self.folder.cleanup()
        return tensors

    def _compute(self) -> dict | UserError:
        """reference_tensors in this process; the UserError of a folder transformers cannot load, kept for `wait`."""
        try:
            return reference_tensors(self.hf_dir, self.tokenizer_dir)
        except UserError as e:
            return e
        except Exception as e:  # noqa: BLE001  as the last line of the process's traceback
            return UserError(f"transformers cannot load it: {one_line(f'{type(e).__name__}: {e}')}")

    @staticmethod
    def large(hf_dir: Path) -> bool:
        """Whether the folder's weights are too large to load before the build without delaying it: over
        OWN_PROCESS_BYTES of safetensors (a float32 model of half a billion parameters)."""
        return sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors")) > OWN_PROCESS_BYTES

    def close(self) -> None:
        """Ends the process where it still runs (a run that ends before step 1, or resumes)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.folder is not None:
            self.folder.cleanup()


def reference_tensors(hf_dir: Path, tokenizer_dir: Path) -> dict:
    """transformers' float32 logits of the HF folder on common.export.REFERENCE_TEXT, with its input_ids and
    position_ids."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    ids = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).encode(export.REFERENCE_TEXT).ids
    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, position_ids=positions).logits.float().contiguous()
    return {"input_ids": tokens, "position_ids": positions, "logits": logits}


def reference_logits(hf_dir: Path, tokenizer_dir: Path, out: Path) -> None:
    """reference_tensors written to `out` (safetensors, atomically): the process of ReferenceLogits."""
    from safetensors.torch import save_file

    staged = out.with_name(f".{out.name}.{os.getpid()}")
    save_file(reference_tensors(hf_dir, tokenizer_dir), str(staged))
    os.replace(staged, out)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error:")), (lines or ["?"])[-1])


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
    """Whether the regular file at `path` holds an export check's JSON (what common.export.verify_to writes)."""
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
    p = ArgumentParser(description="The export check's verifier, on one export.")
    commands = p.add_subparsers(dest="cmd", required=True)
    verify = commands.add_parser("verify", help="re-read an HF export and compare its logits with a reference")
    verify.add_argument("export_dir", type=Path)
    verify.add_argument("--reference", type=Path, required=True,
                        help="safetensors file with input_ids, position_ids and the trained model's logits")
    verify.add_argument("--out", type=Path, required=True, help="where to write the check as JSON")
    verify.add_argument("--weights_only", action="store_true", help="a checkpoint, not an export: no tokenizer needed")
    reference = commands.add_parser("reference", help="transformers' logits of an HF folder on the reference text "
                                                      "(the load check's reference)")
    reference.add_argument("hf_dir", type=Path)
    reference.add_argument("--tokenizer", type=Path, required=True, help="the folder holding tokenizer.json")
    reference.add_argument("--out", type=Path, required=True, help="the safetensors file to write")
    args = p.parse_args(argv)
    try:
        if args.cmd == "reference":
            reference_logits(args.hf_dir, args.tokenizer, args.out)
            return 0
        # its inputs checked: --out before the work (a bad one is named now, not after the model has run),
        # --reference before the weights are read
        _check_out(args.out, args.export_dir, args.reference)
        check = export.verify_to(args.export_dir, args.reference, args.out, files=not args.weights_only,
                                 check_reference=_check_reference)
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(json.dumps(check))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
