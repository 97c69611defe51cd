"""Checkpoints in and out of a training run, around torchtitan's checkpointer:

- its settings and OUT_DIR's folders (which ones a run owns and may replace, stale saves cleared);
- the HF export at the end: the reference logits of the trained model, completing torchtitan's HF
  save (it writes only safetensors + index) into a folder transformers opens as is, and a
  verification that re-reads it with transformers in a separate process (`python -m common.export REQUEST`).

The verifier on its own, with its inputs checked: `python -m common.harness.verifier verify` (common/harness/).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import results
from common.checkpoint import TOKENIZER_FILES, checkpoint_tensors, read_hf_config, validate_hf_checkpoint
from common.errors import UserError, one_line


def apply_checkpoint_settings(cfg, *, steps: int, initial_hf: Path | None = None, dtype: str = "float32") -> None:
    """torchtitan's checkpointer as the three training scripts use it. Mid-run saves (none here; the harness's
    --checkpoint_every sets their interval) are distributed checkpoints of the whole training state (weights,
    optimizer, LR schedule, data loader position) in OUT_DIR/checkpoint/step-N; torchtitan resumes
    from the latest one when the same command runs again. The last save is model-only in HF
    safetensors: the export. `initial_hf` is an HF folder to start from when there is nothing to
    resume."""
    cfg.checkpoint.enable = True  # a stop signal or --time_limit may save any step (common/harness/stops.py)
    cfg.checkpoint.interval = steps + 1
    cfg.checkpoint.initial_load_path = str(initial_hf) if initial_hf else None
    cfg.checkpoint.initial_load_in_hf = initial_hf is not None
    cfg.checkpoint.last_save_model_only = True
    cfg.checkpoint.last_save_in_hf = True
    cfg.checkpoint.export_dtype = "float32" if dtype == "float32" else "bfloat16"
    cfg.checkpoint.load_only = False


MARKER = ".qwen3-recipes"  # in the folders a run creates and may later replace or delete


def owned(folder: Path) -> bool:
    """Did a run of these scripts create `folder`? (its marker file, or an export's version stamp)"""
    if (folder / MARKER).exists():
        return True
    try:
        return "qwen3_recipes_versions" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_replaceable(out_dir: Path, names=("checkpoint", "hf_assets", "hf_export", "hf_export.rejected",
                                            ".hf_export.tmp")) -> None:
    """Before a run: the folders it will replace in OUT_DIR are absent or its own, never a user's."""
    for name in names:
        folder = Path(out_dir) / name
        if folder.exists() and not owned(folder):
            raise UserError(f"{folder} exists and was not made by these scripts: it is left alone; move it or "
                            "choose another --out_dir")


def make_owned_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).touch()
    return folder


def clear_stale_checkpoints(out_dir: Path, is_main: bool) -> None:
    """A run resumes only from a whole distributed checkpoint (its .metadata is written last; the harness has checked
    that this command may continue it: common/harness/resume.py): a step folder without one is a save cut short, or the model-only
    HF save of a run killed before its export was completed, which torchtitan would load (it has an index) and
    fail on or resume without optimizer state; it is removed. Whole checkpoints are never removed. Only a folder a
    run made (its marker) is touched. Call on rank 0 before a barrier."""
    step_dir = Path(out_dir) / "checkpoint"
    if is_main:
        check_replaceable(out_dir, ("checkpoint",))
        for partial in sorted(step_dir.glob("step-*")):
            if partial.is_dir() and not (partial / ".metadata").is_file():
                print(f"[checkpoint] {partial} is not a whole checkpoint (a save cut short): removed", flush=True)
                results.remove(partial)
        make_owned_dir(step_dir)


REFERENCE_TEXT = ("The export check feeds this sentence to the trained model and to the exported "
                  "checkpoint re-read by transformers, and compares the logits.")


def model_logits(trainer, tokenizer_dir, *, pass_positions: bool = False):
    """(input_ids, position_ids, logits) of the trainer's model on REFERENCE_TEXT. Every rank runs
    the forward (FSDP gathers parameters collectively). `pass_positions`: give the forward explicit
    positions (the Transformers backend needs them: without them it assumes a full `seq_len`)."""
    import torch
    from tokenizers import Tokenizer

    from common.torchtitan_fixes import full_logits

    ids = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).encode(REFERENCE_TEXT).ids
    tp = trainer.parallel_dims.tp if trainer.parallel_dims.tp_enabled else 1
    ids = ids[:len(ids) // tp * tp]  # sequence parallel splits the sequence evenly over the tensor-parallel ranks
    tokens = torch.tensor([ids], device=trainer.device)
    positions = torch.arange(len(ids), device=trainer.device)[None]
    model = trainer.model_parts[0]
    model.eval()
    # in the trainer's own forward context (tensor parallel's collectives run inside it); the chunked loss normally
    # applies lm_head itself
    with torch.no_grad(), trainer.train_context(), full_logits(model):
        logits = model(tokens, positions=positions) if pass_positions else model(tokens)
        logits = whole_vocabulary(logits, trainer.parallel_dims)
    model.train()
    return tokens.cpu(), positions.cpu(), logits.detach().float().cpu().contiguous()


def whole_vocabulary(logits, parallel_dims):
    """Logits over the whole vocabulary: under tensor parallel each rank's output projection holds a slice of the
    vocabulary (torchtitan's loss-parallel layout), gathered here in rank order over the tensor-parallel group."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        return logits.full_tensor()
    if not parallel_dims.tp_enabled:
        return logits
    group = parallel_dims.get_mesh("tp").get_group()
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def save_reference_logits(trainer, tokenizer_dir, path, *, is_main: bool, pass_positions: bool = False) -> None:
    """Logits of the trained model on a fixed input, for the export check; rank 0 writes the file."""
    from safetensors.torch import save_file

    tokens, positions, logits = model_logits(trainer, tokenizer_dir, pass_positions=pass_positions)
    if is_main:
        with results.atomic_path(path) as tmp:
            save_file({"input_ids": tokens, "position_ids": positions, "logits": logits}, str(tmp))


def export_and_check(trainer, *, out_dir: Path, steps: int, hf_cfg: dict, tokenizer_dir: Path,
                     tied_expected: bool, tol: float, is_main: bool, pass_positions: bool = False,
                     check_process=None) -> dict:
    """The end of a run with --export. Every rank: logits of a fixed sentence from the trained model
    (`save_reference_logits`), then `trainer.close()`, which writes torchtitan's last save (HF safetensors) to
    OUT_DIR/checkpoint/step-STEPS. Rank 0: config.json, tokenizer and version stamp added and the folder moved to
    OUT_DIR/hf_export atomically (`complete_export`), re-read by transformers in a fresh process, logits compared.
    Returns the results entries (`export_dir`, `export_check`) on rank 0, {} on the others. `check_process`: what
    runs the check's process (verify_export_subprocess's `check`)."""
    reference = Path(out_dir) / "export_reference.safetensors"
    save_reference_logits(trainer, tokenizer_dir, reference, is_main=is_main, pass_positions=pass_positions)
    trainer.close()
    if not is_main:
        return {}
    check = {}

    def verify(staged: Path) -> bool:
        check.update(verify_export_subprocess(staged, reference, check=check_process))
        check["passed"] = export_check_passed(check, tied_expected=tied_expected, tol=tol)
        check["tolerance"] = tol
        return check["passed"]

    export_dir = complete_export(Path(out_dir) / "checkpoint" / f"step-{steps}", Path(out_dir) / "hf_export",
                                 hf_cfg, tokenizer_dir, results.versions(), verify=verify)
    results.atomic_write_text(Path(out_dir) / "export_check.json", json.dumps(check, indent=2) + "\n")
    print(f"[export] {export_dir or 'rejected, hf_export left as it was'}: missing={check['missing_keys']} "
          f"unexpected={check['unexpected_keys']} tied_lm_head={check['tied_lm_head']} "
          f"max_abs_logit_diff={check['max_abs_logit_diff']:.3g} (tolerance {tol:g}) passed={check['passed']}",
          flush=True)
    return {"export_dir": str(export_dir) if export_dir else None, "export_check": check}


def stage_hf_assets(dest: Path, tokenizer_dir: Path, checkpoint_dir: Path | None = None) -> Path:
    """torchtitan reads the tokenizer and (for a load) config.json + index from one folder,
    `hf_assets_path`. Build it from links: tokenizer files, plus the checkpoint's config/index."""
    check_replaceable(dest.parent, (dest.name,))
    if dest.exists():
        results.remove(dest)
    make_owned_dir(dest)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.is_file():
            (dest / name).symlink_to(src.resolve())
    if checkpoint_dir is not None:
        for src in [checkpoint_dir / "config.json", *checkpoint_dir.glob("*.safetensors.index.json")]:
            if src.is_file():
                (dest / src.name).symlink_to(src.resolve())
    return dest


def complete_export(step_dir: Path, export_dir: Path, hf_config: dict, tokenizer_dir: Path,
                    versions: dict, verify=None) -> Path | None:
    """Turn torchtitan's last HF save (safetensors + index only) into a folder that `from_pretrained` opens as is: add
    config.json and the tokenizer files, check it with `verify(folder) -> bool` while it still has a hidden name, then
    move it into place with one rename. A previous export is replaced only by a complete, verified one; an export that
    fails `verify` goes to EXPORT_DIR.rejected and None is returned (a kill at any point leaves the previous export or
    none). EXPORT_DIR, EXPORT_DIR.rejected and the staging folder .EXPORT_DIR.tmp are replaced only when absent or a
    run's own (`owned`); anything else is a UserError naming it, raised before anything moves (check_replaceable
    refuses it before training). A symlink of one of those names is replaced itself, never what it points to
    (results.replace_dir)."""
    if not step_dir.is_dir():
        raise RuntimeError(f"torchtitan wrote no HF export at {step_dir}")
    tmp = export_dir.with_name(f".{export_dir.name}.tmp")
    rejected = export_dir.with_name(f"{export_dir.name}.rejected")
    try:  # absent, a dangling link or a run's own (through a link too); anything else is named before anything moves
        check_replaceable(export_dir.parent, (tmp.name, export_dir.name, rejected.name))
    except UserError as e:
        raise UserError(f"{e} (the new export stays in {step_dir})") from None
    (step_dir / MARKER).touch()  # marked before it moves: the staged folder is the run's own whenever a kill comes
    results.remove(tmp)
    shutil.move(str(step_dir), tmp)
    shutil.rmtree(tmp / "sharded", ignore_errors=True)  # torchtitan's pre-consolidation shards
    cfg = dict(hf_config)
    cfg["qwen3_recipes_versions"] = versions  # the stack the export was made with
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / MARKER).unlink()  # from here on its version stamp marks it: the export holds only the model's files
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    _fsync_tree(tmp)
    try:
        passed = verify is None or verify(tmp)
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop (the harness's CheckInterrupted): no verdict, nothing moved
        staged = f"the new export stays unverified in {tmp}, {export_dir} is as it was"
        raise type(e)(f"{e}; {staged}" if str(e) else staged) from None
    if not passed:
        results.replace_dir(tmp, rejected)  # an earlier rejected export (the run's own) or a link is replaced
        return None
    results.replace_dir(tmp, export_dir)
    return export_dir


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def verify_export_subprocess(export_dir: Path, reference: Path, files: bool = True, check=None) -> dict:
    """Re-read the export with transformers in a process of its own (no state shared with the trainer,
    whose libraries may have patched transformers) and return the check as a dict. A folder the
    verifier cannot read at all fails the check with the verifier's error. `check(request) -> (code, error)` runs
    that process (`one_shot`; the harness's Verifier, which dies with the run)."""
    out_json = Path(reference).with_name(".export_check.json")
    request = {"export_dir": str(Path(export_dir).absolute()), "reference": str(Path(reference).absolute()),
               "out": str(out_json.absolute()), "files": files}
    code, error = (check or one_shot)(request)
    if code != 0:
        return {"missing_keys": [], "unexpected_keys": [], "tied_lm_head": None,
                "max_abs_logit_diff": float("nan"), "error": f"the export cannot be read back: {error}"}
    check = json.loads(out_json.read_text())
    out_json.unlink()
    return check


def one_shot(request: dict) -> tuple[int, str]:
    """One check in a process of its own, `python -m common.export REQUEST` (not a rank of the run): (exit code, its
    error line). The harness's Verifier (common/harness/verifier.py) also dies with the run."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{Path(__file__).resolve().parent.parent}{os.pathsep}{env.get('PYTHONPATH', '')}"
    request = {**request, "parent": os.getpid()}  # the check dies with this process (a stop signal, a kill)
    proc = subprocess.run([sys.executable, "-m", "common.export", json.dumps(request)], env=env, capture_output=True,
                          text=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["?"]
    error = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error:")), lines[-1])
    return proc.returncode, error if proc.returncode else ""


def in_process(request: dict) -> tuple[int, str]:
    """One check in this process, for a trainer that leaves transformers as it is (torchtitan's own models: the
    Transformers backend replaces transformers' init functions, and its checks run in a process of their own):
    (exit code, error line) as `one_shot`'s process would give them."""
    try:
        verify_to(Path(request["export_dir"]), Path(request["reference"]), Path(request["out"]), request["files"])
    except UserError as e:
        return 2, one_line(str(e))
    except Exception as e:  # noqa: BLE001  as the last line of a check process's traceback
        return 1, one_line(f"{type(e).__name__}: {e}")
    return 0, ""


def verify_export(export_dir: Path, reference: Path, files: bool = True, check_reference=None) -> dict:
    """Load the export with AutoModelForCausalLM and compare its logits on the reference input.
    config.json and tokenizer.json must be there, and the weights are validated against config.json
    first (headers, index, keys, shapes, finite values), so a bad tensor is named. `check_reference(reference,
    config)`: a check of a reference a user gave (common/harness/verifier.py), before the weights are read."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if not Path(export_dir).is_dir():
        raise UserError(f"{export_dir} {'is not a folder' if os.path.lexists(export_dir) else 'does not exist'}: "
                        "give the export's folder")
    missing = [n for n in ("config.json", "tokenizer.json")[:2 if files else 1] if not (export_dir / n).is_file()]
    if missing:
        raise UserError(f"{export_dir} lacks {', '.join(missing)}")
    config = read_hf_config(export_dir)
    if check_reference is not None:  # before the weights are read: a wrong --reference fails at once
        check_reference(Path(reference), config)
    stored = checkpoint_tensors(export_dir)
    if files:  # an export: keys, shapes and finite values against its own config.json, tensors named
        validate_hf_checkpoint(export_dir, tuple(config.get("architectures") or ()), hf_config=config, found=stored)
    ref = load_file(str(reference))
    ids, vocab = ref["input_ids"], config.get("vocab_size")
    if isinstance(vocab, int) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise UserError(f"--reference {reference}: input_ids outside the export's vocabulary of {vocab}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a check's one line says what it found; no bar in the run's output
    model, info = AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True)
    model.eval()
    lm_head = model.get_output_embeddings().weight
    tied = lm_head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        logits = model(ref["input_ids"], position_ids=ref["position_ids"]).logits.float()
    return {
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
        "tied_lm_head": bool(tied),
        "lm_head_in_file": "lm_head.weight" in stored,
        "max_abs_logit_diff": float((logits - ref["logits"].float()).abs().max()),
        **version_check(config.get("qwen3_recipes_versions")),
    }


def version_check(export_versions: dict | None) -> dict:
    """The stack an export was made with (stamped in its config.json) against the one reading it:
    {export_versions, reader_versions, version_mismatch: {package: [made with, read with]}}."""
    reader = results.versions()
    made = export_versions or {}
    mismatch = {k: [made.get(k), reader.get(k)] for k in sorted(set(made) | set(reader))
                if made.get(k) != reader.get(k)}
    return {"export_versions": export_versions, "reader_versions": reader,
            "version_mismatch": mismatch if export_versions is not None else None}


def export_check_passed(check: dict, *, tied_expected: bool, tol: float) -> bool:
    check["tied_expected"] = tied_expected
    return (not check.get("error") and not check["missing_keys"] and not check["unexpected_keys"]
            and not check.get("mismatched_keys")
            and check["tied_lm_head"] == tied_expected
            and check["max_abs_logit_diff"] <= tol)


def verify_to(export_dir: Path, reference: Path, out: Path, files: bool, check_reference=None) -> dict:
    """verify_export's check, written to `out` as JSON."""
    check = verify_export(export_dir, reference, files=files, check_reference=check_reference)
    try:
        results.atomic_write_text(out, json.dumps(check, indent=2))
    except OSError as e:
        raise UserError(f"--out {out} cannot be written: {e.strerror or e}") from None
    return check


def _main(argv: list[str] | None = None) -> int:
    """`one_shot`'s process: one check, its request (JSON: export_dir, reference, out, files) the one argument;
    exit 2 and an `error:` line for a folder it refuses. With `parent` (a pid) in the request, it ends as soon as that
    process does (however it ends), instead of running on alone."""
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    if request.get("parent"):
        import signal

        from common.processes import die_with_parent

        die_with_parent(signal.SIGTERM, parent_pid=int(request["parent"]))()
    try:
        verify_to(Path(request["export_dir"]), Path(request["reference"]), Path(request["out"]), request["files"])
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
