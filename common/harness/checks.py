"""The checks a guarded training run makes beyond the core's export check:

- the load check: an HF checkpoint a run starts from is compared, settings and logits against transformers,
  with what torchtitan built and loaded (check_settings, logit_check), before step 1;
- the loss comparison with reference losses (`--compare_losses`, golden losses) over the whole curve;
- losses.jsonl: the loss curve across stops and resumes (`keep_rows_before`, `whole_history`);
- the run's outputs: each file it will write is absent or a regular file, before any work (`check_outputs`).

An HF checkpoint folder on its own, before a run (headers, index, keys, shapes, finite values, architecture, no
remote code: common.checkpoint.validate_hf_checkpoint), `DIR: ok` or one `error:` line and exit code 2:
    python -m common.harness.checks validate CKPT_DIR [--arch Qwen3ForCausalLM]
"""
from __future__ import annotations

import errno
import json
import math
import operator
import os
import sys
from pathlib import Path

from common import cli
from common.checkpoint import read_hf_config, validate_hf_checkpoint
from common.errors import ArgumentParser, UserError, one_line
from common.export import model_logits
from common.harness.verifier import CheckInterrupted
from common.results import atomic_write_text, not_a_file, refuse_non_file


LOAD_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.5}  # max abs logit difference; bf16 compute rounds
COMPARED_SETTINGS = ("rope_theta", "rms_norm_eps", "head_dim", "tie_word_embeddings")


def _settings(config) -> dict:
    """The compared settings of a config.json dict or a transformers config object."""
    from common.checkpoint import rope_theta

    if not isinstance(config, dict):
        config = {k: getattr(config, k, None) for k in ("rope_parameters", "rope_scaling", "rope_theta",
                                                        *COMPARED_SETTINGS[1:])}
    out = {k: config.get(k) for k in COMPARED_SETTINGS[1:]}
    out["tie_word_embeddings"] = bool(out["tie_word_embeddings"])
    try:
        out["rope_theta"] = rope_theta(config)
    except UserError:
        out["rope_theta"] = None
    return out


def _settings_differences(built_config, ckpt_dir) -> dict:
    ours, theirs = _settings(built_config), _settings(read_hf_config(ckpt_dir))
    return {k: [ours[k], theirs[k]] for k in COMPARED_SETTINGS if ours[k] != theirs[k]}


def check_settings(built_config, ckpt_dir) -> None:
    """The load check's first half, right after the build and before anything loads: the settings of the model
    torchtitan built (`built_config`, a config.json dict or a transformers config) against the folder's config.json
    (a wrong head_dim or theta is named here, not in the loader). The second half, `logit_check`, runs right before
    the first step of a fresh run (a resumed run holds trained weights). Catches weights not loaded and config values
    read wrong or replaced by defaults. A failure is one UserError on every rank."""
    differing = _settings_differences(built_config, ckpt_dir)
    if differing:
        _fail(ckpt_dir, [f"{k}: trained model {a}, config.json {b}" for k, (a, b) in differing.items()])


def _fail(ckpt_dir, named: list[str]):
    raise UserError(f"load check failed: the model built from {ckpt_dir} is not the checkpoint ("
                    + "; ".join(named) + "); pass --no-load_check to train anyway")


def load_tolerance(dtype: str, export_tolerance: float) -> float:
    """The load check's largest logit difference: its own for the compute dtype, or the export check's (the config's
    validate resolves it) where larger: a recipe computing part of the model in another dtype (the MoE script's
    bfloat16 experts in float32) raises its export tolerance, and the same logits meet it before step 1."""
    return max(LOAD_TOLERANCE[dtype], export_tolerance)


def logit_check(trainer, ckpt_dir, tokenizer_dir, tolerance: float, is_main: bool, pass_positions: bool,
                reference=None, stopping=None) -> dict:
    """The built and loaded model's logits against transformers' `from_pretrained` of the folder (float32), before
    step 1, within `tolerance` (load_tolerance): `reference` (rank 0's verifier.ReferenceLogits, computed since the
    run's checks) gives transformers' logits, this forward the trainer's; `stopping() -> bool`: whether the run is
    stopping (a reference process killed meanwhile gives no verdict). The check's result."""
    import torch

    tokens, _positions, logits = model_logits(trainer, tokenizer_dir, pass_positions=pass_positions)
    check = None
    if is_main:
        try:
            ref = reference.wait(stopping)
            n = tokens.shape[1]  # under tensor parallel a prefix of the text (a causal model's logits are a prefix)
            if not torch.equal(ref["input_ids"][:, :n], tokens):
                raise UserError("the reference's tokens are not the trainer's: the tokenizer folder changed")
            diff = float((logits - ref["logits"][:, :n]).abs().max())
            check = {"max_abs_logit_diff": diff, "tolerance": tolerance, "passed": diff <= tolerance}
        except CheckInterrupted as e:  # a stop, not a verdict: every rank ends as interrupted
            check = {"interrupted": str(e)}
        except UserError as e:
            check = {"max_abs_logit_diff": float("nan"), "tolerance": tolerance, "passed": False,
                     "error": f"the checkpoint cannot be read back: {e}"}
    if torch.distributed.is_initialized():
        box = [check]
        torch.distributed.broadcast_object_list(box, src=0)
        check = box[0]
    if "interrupted" in check:
        raise CheckInterrupted(f"{check['interrupted']}; the load check of {ckpt_dir} has none: run the same command "
                               "again (nothing was trained)")
    if not check["passed"]:
        _fail(ckpt_dir, [check.get("error") or f"max abs logit diff {check['max_abs_logit_diff']:.3g} > "
                                               f"{check['tolerance']:g}"])
    if is_main:
        print(f"[load check] max abs logit diff {check['max_abs_logit_diff']:.3g} (tolerance {check['tolerance']:g}), "
              "settings agree: the built model is the checkpoint", flush=True)
    return check


def read_reference_losses(path: str | os.PathLike) -> list[float]:
    """Losses from a reference file, in its order (read_reference_curve numbers them)."""
    return list(read_reference_curve(path).values())


def _numbered(data: dict) -> tuple:
    """A reference's steps and losses: a results.json's `history` (the whole run, across stops and resumes), else
    its `steps` and `losses` (this process's part: a resumed run's start after step 1), else a golden file's
    `losses`, from step 1 (its `steps` is a count)."""
    history = data.get("history")
    if isinstance(history, dict) and "steps" in history and "losses" in history:
        return history["steps"], history["losses"]
    if isinstance(data.get("steps"), list):
        return data["steps"], data["losses"]
    return range(1, len(data["losses"]) + 1), data["losses"]


def read_reference_curve(path: str | os.PathLike) -> dict[int, float]:
    """Losses by step from a reference file: a results.json or a golden file (both hold `losses`), a regular file
    (or a link to one): a FIFO of that name would block the read forever."""
    kind = not_a_file(path)
    if kind is not None:
        raise UserError(f"--compare_losses: {path} is {kind}, not a regular file: only a regular file (or a link to "
                        "one) is read")
    try:
        data = json.loads(Path(path).read_text())
        steps, losses = _numbered(data)
        steps, losses = [operator.index(s) for s in steps], [float(x) for x in losses]
    except FileNotFoundError:
        raise UserError(f"--compare_losses: no file {path}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--compare_losses: {path} is not a JSON file with a 'losses' list ({e})") from None
    if len(steps) != len(losses):
        raise UserError(f"--compare_losses: {path} numbers {len(losses)} losses with {len(steps)} steps")
    if not losses:
        raise UserError(f"--compare_losses: {path} holds no losses")
    if not all(math.isfinite(x) for x in losses):
        raise UserError(f"--compare_losses: {path} holds NaN or infinite losses: it cannot be a reference")
    return dict(zip(steps, losses))


def compare_losses(losses: list[float], path: str | os.PathLike, tolerance: float,
                   steps: list[int] | None = None) -> dict:
    """Per-step differences between a run's losses and a reference file's at the same steps, so a user on trn2 or
    CUDA sees at step N whether the hardware reproduces the reference. `steps` numbers the run's losses (from 1; a
    resumed run starts later), the reference's are numbered by its own steps (read_reference_curve); a step the
    reference has no loss for is not compared."""
    reference = read_reference_curve(path)
    numbered = zip(steps or range(1, len(losses) + 1), losses)
    per_step = [{"step": s, "loss": loss, "reference": reference[s], "abs_diff": abs(loss - reference[s])}
                for s, loss in numbered if s in reference]
    n = len(per_step)
    worst = max((r["abs_diff"] for r in per_step), default=float("nan"))
    first = next((r["step"] for r in per_step if not r["abs_diff"] <= tolerance), None)  # NaN differs
    return {"reference": str(path), "steps_compared": n, "max_abs_diff": worst, "tolerance": tolerance,
            "first_differing_step": first, "passed": n > 0 and first is None, "per_step": per_step}


def format_loss_comparison(c: dict) -> str:
    rows = [f"[compare] {c['steps_compared']} steps against {c['reference']} (tolerance {c['tolerance']:g})"]
    rows += [f"    step {s['step']:3d}  loss {s['loss']:.6f}  reference {s['reference']:.6f}  diff {s['abs_diff']:.2e}"
             for s in c["per_step"]]
    rows.append(f"[compare] max abs diff {c['max_abs_diff']:.2e}: "
                + ("reproduces the reference" if c["passed"] else
                   f"DIFFERS from the reference from step {c['first_differing_step']}"))
    return "\n".join(rows)


def keep_rows_before(path: Path, step: int) -> None:
    """A losses.jsonl (or eval_losses.jsonl) at a run's first step: only the earlier steps of the run it resumes are
    kept (a fresh run starts the file anew)."""
    kept = [r for r in read_progress(path) if r["step"] < step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def append_row(path: Path, step: int, loss: float) -> None:
    """One {"step", "loss"} line of a losses.jsonl (or eval_losses.jsonl). The one writer that appends instead of
    writing atomically: a step's line must not cost a rewrite (a kill can cut the last line; read_progress skips it)."""
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": loss}) + "\n")


def whole_history(path: Path, rec) -> dict:
    """Steps and losses of the whole run from its losses.jsonl, resumed parts included (`rec`'s, a LossRecorder,
    where the file has none)."""
    rows = read_progress(path) or [{"step": s, "loss": v} for s, v in zip(rec.steps, rec.losses)]
    return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows]}


def read_progress(path: Path) -> list[dict]:
    """The rows of a losses.jsonl; a last line cut by a kill is skipped."""
    rows = []
    if path is not None and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("loss"), float):
                rows.append(row)
    return rows


# What a training run writes in OUT_DIR, each replaced atomically (results.json, the loss curve, the export check).
RUN_OUTPUTS = ("results.json", "losses.jsonl", "loss.png", "export_check.json", "export_reference.safetensors",
               ".export_check.json", "eval_losses.jsonl", "segments.json")


def check_outputs(out_dir: str | os.PathLike, names: tuple[str, ...] = RUN_OUTPUTS,
                  folders: tuple[str, ...] = ()) -> None:
    """Before any work: each file a run will write in OUT_DIR is absent or a regular file (or a link to one), and
    each folder it writes into (`folders`: `tb` with --tensorboard) absent or a folder (or a link to one). A folder,
    FIFO, socket or device of a file's name, or a file or dangling link of a folder's, is a UserError naming it, not
    a hang (a FIFO opened for reading) or a crash after the model is built."""
    for name in names:
        refuse_non_file(Path(out_dir) / name)
    for name in folders:
        path = Path(out_dir) / name
        if os.path.lexists(path) and not path.is_dir():
            kind = "a dangling link" if path.is_symlink() and not path.exists() else not_a_file(path) or "a file"
            raise UserError(f"{path} is {kind}, not a folder for --{'tensorboard' if name == 'tb' else name}: it is "
                            "left alone; move it or choose another --out_dir")


# A full disk during a save: the one line that names what is lost and what the same command resumes from.
FULL_BELOW = 16 << 20  # bytes free: a file system a write failed on with less than this left is full


def out_of_space(e: BaseException, out_dir: str | None) -> str | None:
    """The one line for a write that failed on a full disk (None: `e` is something else): an OSError ENOSPC or
    EDQUOT behind `e`; or a write torch's zip writer (torch.save, which torch.distributed.checkpoint writes each
    shard with) reports without an errno (`[enforce fail at inline_container.cc] ... unexpected pos`), wrapped in
    a CheckpointException, while OUT_DIR's file system is full. The line names the path, the space left and the last
    whole checkpoint in OUT_DIR, which the same command resumes from."""
    failed = cli._behind(e, lambda x: isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT))
    if failed is not None:
        where = str(failed.filename or out_dir or "a file")
    elif out_dir and cli._behind(e, _torch_write_failure) is not None and _free_bytes(out_dir) < FULL_BELOW:
        where = str(out_dir)
    else:
        return None
    free = _free_bytes(out_dir or where)
    space = f"{free / 2**20:.1f} MiB free on its file system" if free != float("inf") else "its file system is full"
    if out_dir is None:
        return f"out of disk space writing {one_line(where)} ({space}): free space or choose another --out_dir"
    steps = sorted(int(d.name[5:]) for d in (Path(out_dir) / "checkpoint").glob("step-*")
                   if d.name[5:].isdigit() and (d / ".metadata").is_file())
    last = (f"the last whole checkpoint is {Path(out_dir) / 'checkpoint' / f'step-{steps[-1]}'} (the steps after it "
            "are lost); free space there and run the same command to resume from it (a save cut short is removed)" if steps
            else "no whole checkpoint was written; free space or choose another --out_dir")
    return f"out of disk space writing {one_line(where)} ({space}): {last}"


def _torch_write_failure(x: BaseException) -> bool:
    """torch's zip writer (PyTorchStreamWriter) failing a write: it checks the file position, not the errno."""
    return isinstance(x, RuntimeError) and any(t in str(x) for t in ("inline_container.cc", "PytorchStreamWriter",
                                                                     "iostream error"))


def _free_bytes(path: str | os.PathLike) -> float:
    """Bytes this process may still write on `path`'s file system (root: the reserved blocks too); inf if unknown."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return float("inf")
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def explain_failure(e: BaseException, cfg) -> str | None:
    """cli.run_cli's `explain` for a training run: a full disk during a save (`out_of_space`), else None."""
    return out_of_space(e, getattr(cfg, "out_dir", None))


def _main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Check an HF checkpoint folder before loading it.")
    p.add_argument("cmd", choices=["validate"])
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("--arch", default="Qwen3ForCausalLM")
    args = p.parse_args(argv)
    try:
        validate_hf_checkpoint(args.ckpt_dir, (args.arch,))
    except UserError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(f"{args.ckpt_dir}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
