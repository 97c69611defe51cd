"""HF export at the end of a training run: torchtitan's checkpointer settings, the reference
logits of the trained model, completing torchtitan's HF save (it writes only safetensors + index)
into a folder transformers opens as is, and a verification that re-reads it with transformers in
a separate process.

The verifier on its own:
    python -m common.export verify EXPORT_DIR --reference REF.safetensors --out check.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import results
from common.checkpoint import TOKENIZER_FILES, checkpoint_tensors
from common.errors import UserError


def apply_checkpoint_settings(cfg, *, steps: int, every: int, export: bool,
                              initial_hf: Path | None = None, dtype: str = "float32") -> None:
    """torchtitan's checkpointer as the three training scripts use it. Mid-run saves (every
    `every` steps, 0: none) are distributed checkpoints of the whole training state (weights,
    optimizer, LR schedule, data loader position) in OUT_DIR/checkpoint/step-N; torchtitan resumes
    from the latest one when the same command runs again. The last save is model-only in HF
    safetensors: the export. `initial_hf` is an HF folder to start from when there is nothing to
    resume."""
    cfg.checkpoint.enable = bool(export or initial_hf or every)
    cfg.checkpoint.interval = every or steps + 1
    cfg.checkpoint.initial_load_path = str(initial_hf) if initial_hf else None
    cfg.checkpoint.initial_load_in_hf = initial_hf is not None
    cfg.checkpoint.last_save_model_only = True
    cfg.checkpoint.last_save_in_hf = True
    cfg.checkpoint.export_dtype = "float32" if dtype == "float32" else "bfloat16"
    cfg.checkpoint.load_only = not (export or every)


def clear_stale_checkpoints(out_dir: Path, every: int, is_main: bool) -> None:
    """Without --checkpoint_every every run starts fresh: a save left in OUT_DIR/checkpoint (the
    previous run's final one) would otherwise be resumed from. Call on every rank before a barrier."""
    step_dir = Path(out_dir) / "checkpoint"
    if is_main and not every and step_dir.exists():
        shutil.rmtree(step_dir)


REFERENCE_TEXT = ("The export check feeds this sentence to the trained model and to the exported "
                  "checkpoint re-read by transformers, and compares the logits.")


def save_reference_logits(trainer, tokenizer_dir, path, *, is_main: bool, pass_positions: bool = False) -> None:
    """Logits of the trained torchtitan model on a fixed input, for the export check.
    Every rank runs the forward (FSDP gathers parameters collectively); rank 0 writes the file.
    `pass_positions`: give the forward explicit positions (the Transformers backend needs them:
    without them its forward assumes a full `seq_len` sequence)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).encode(REFERENCE_TEXT).ids
    tokens = torch.tensor([ids], device=trainer.device)
    positions = torch.arange(len(ids), device=trainer.device)[None]
    model = trainer.model_parts[0]
    skip = model._skip_lm_head
    model._skip_lm_head = False  # the chunked loss normally applies lm_head itself
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions=positions) if pass_positions else model(tokens)
    model._skip_lm_head = skip
    model.train()
    if is_main:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({"input_ids": tokens.cpu(), "position_ids": positions.cpu(),
                   "logits": logits.detach().float().cpu().contiguous()}, str(tmp))
        os.replace(tmp, path)


def export_and_check(trainer, *, out_dir: Path, steps: int, hf_cfg: dict, tokenizer_dir: Path,
                     tied_expected: bool, tol: float, is_main: bool, pass_positions: bool = False) -> dict:
    """The end of a run with --export. Every rank: logits of a fixed sentence from the trained model
    (`save_reference_logits`), then `trainer.close()`, which writes
    torchtitan's last save (HF safetensors) to OUT_DIR/checkpoint/step-STEPS. Rank 0: config.json,
    tokenizer and version stamp added and the folder moved to OUT_DIR/hf_export atomically
    (`complete_export`), re-read by transformers in a fresh process, logits compared.
    Returns the results entries (`export_dir`, `export_check`) on rank 0, {} on the others."""
    reference = Path(out_dir) / "export_reference.safetensors"
    save_reference_logits(trainer, tokenizer_dir, reference, is_main=is_main, pass_positions=pass_positions)
    trainer.close()
    if not is_main:
        return {}
    export_dir = complete_export(Path(out_dir) / "checkpoint" / f"step-{steps}", Path(out_dir) / "hf_export",
                             hf_cfg, tokenizer_dir, results.versions())
    check = verify_export_subprocess(export_dir, reference, Path(out_dir) / "export_check.json")
    check["passed"] = export_check_passed(check, tied_expected=tied_expected, tol=tol)
    print(f"[export] {export_dir}: missing={check['missing_keys']} unexpected={check['unexpected_keys']} "
          f"tied_lm_head={check['tied_lm_head']} max_abs_logit_diff={check['max_abs_logit_diff']:.3g} "
          f"passed={check['passed']}", flush=True)
    return {"export_dir": str(export_dir), "export_check": check}


def stage_hf_assets(dest: Path, tokenizer_dir: Path, checkpoint_dir: Path | None = None) -> Path:
    """torchtitan reads the tokenizer and (for a load) config.json + index from one folder,
    `hf_assets_path`. Build it from links: tokenizer files, plus the checkpoint's config/index."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
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
                    versions: dict) -> Path:
    """Turn torchtitan's last HF save (safetensors + index only) into a folder that
    `from_pretrained` opens as is: add config.json and the tokenizer files, then move it into
    place with one rename. A previous export is replaced only once the new one is complete."""
    if not step_dir.is_dir():
        raise RuntimeError(f"torchtitan wrote no HF export at {step_dir}")
    tmp = export_dir.with_name(f".{export_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.move(str(step_dir), tmp)
    shutil.rmtree(tmp / "sharded", ignore_errors=True)  # torchtitan's pre-consolidation shards
    cfg = dict(hf_config)
    cfg["qwen3_recipes_versions"] = versions  # the stack the export was made with
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    _fsync_tree(tmp)
    old = export_dir.with_name(f".{export_dir.name}.old")
    if export_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(export_dir, old)
    os.replace(tmp, export_dir)
    shutil.rmtree(old, ignore_errors=True)
    return export_dir


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


def verify_export_subprocess(export_dir: Path, reference: Path, out_json: Path) -> dict:
    """Re-read the export with transformers in a fresh process (no state shared with the trainer,
    whose libraries may have patched transformers) and return the check as a dict."""
    repo_root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{repo_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "common.export", "verify", str(export_dir),
           "--reference", str(reference), "--out", str(out_json)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"export verification failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out_json.read_text())


def verify_export(export_dir: Path, reference: Path) -> dict:
    """Load the export with AutoModelForCausalLM and compare its logits on the reference input."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = load_file(str(reference))
    model, info = AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True)
    model.eval()
    stored = set(checkpoint_tensors(export_dir))
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
        **version_check(json.loads((export_dir / "config.json").read_text()).get("qwen3_recipes_versions")),
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
    return (not check["missing_keys"] and not check["unexpected_keys"]
            and not check.get("mismatched_keys")
            and check["tied_lm_head"] == tied_expected
            and check["max_abs_logit_diff"] <= tol)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Re-read an HF export and compare its logits with a reference.")
    p.add_argument("cmd", choices=["verify"])
    p.add_argument("export_dir", type=Path)
    p.add_argument("--reference", type=Path, required=True,
                   help="safetensors file with input_ids, position_ids and the trained model's logits")
    p.add_argument("--out", type=Path, required=True, help="where to write the check as JSON")
    args = p.parse_args(argv)
    try:
        check = verify_export(args.export_dir, args.reference)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results.atomic_write_text(args.out, json.dumps(check, indent=2))
    print(json.dumps(check))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
