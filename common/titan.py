"""torchtitan glue shared by the training examples: device settings on a Trainer.Config, the
attention every non-CUDA device can run, gloo-safe FSDP reductions, and a loss recorder.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
Each workaround is a named function that says why it exists and when it can go.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, VarlenAttention, VarlenMetadata
from torchtitan.trainer import Trainer

from common import checkpoint
from common import config as cli
from common.device import DeviceInfo

ATTN_BACKENDS = ("sdpa", "flex")


class SDPADocumentAttention(VarlenAttention):
    """Causal attention with packed-document masking through `scaled_dot_product_attention`.

    Why: torchtitan 0.3.0 language models accept only FlexAttention (no CPU backward, needs
    Triton/inductor) or varlen attention (a CUDA kernel), and its plain SDPA class cannot mask
    documents. Subclassing the varlen config makes the trainer hand us the per-document
    boundaries it computes from `positions`; the mask is materialised once per forward
    (B x L x L booleans) and reused by every layer.
    Remove when torchtitan ships a document-masked SDPA backend for language models."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    _last_mask: tuple = (None, None)  # (VarlenMetadata, mask) of the latest forward

    def __init__(self, config: Config) -> None:
        super(VarlenAttention, self).__init__()  # skip the CUDA flash-attention set-up

    @staticmethod
    def document_causal_mask(meta: VarlenMetadata, batch: int, seq_len: int, device) -> torch.Tensor:
        total = batch * seq_len
        starts = torch.zeros(total + 1, dtype=torch.int32, device=device)
        starts[meta.cu_seq_q.to(device=device, dtype=torch.long)] = 1
        doc = torch.cumsum(starts[:total], 0).view(batch, seq_len)
        same_doc = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return (same_doc & causal)[:, None]  # (B, 1, L, L), broadcast over heads

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                enable_gqa: bool = False, out_transform=None, **kwargs) -> torch.Tensor:
        if out_transform is not None:
            raise NotImplementedError("SDPADocumentAttention does not support out_transform (attention sinks)")
        B, L = q_BLNH.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if attention_masks is None:  # a bare forward (no positions): plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        else:
            # One VarlenMetadata object is shared by all layers of a forward: build its mask once.
            meta, cache = SDPADocumentAttention._last_mask
            if meta is not attention_masks or cache.shape[0] != B or cache.shape[-1] != L:
                cache = self.document_causal_mask(attention_masks, B, L, q.device)
                SDPADocumentAttention._last_mask = (attention_masks, cache)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache, scale=scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def use_attention_backend(model_config, backend: str) -> list[str]:
    """Point every attention of a torchtitan model config at `backend`; returns the changed FQNs.
    `sdpa` runs everywhere (CPU, Trainium, CUDA); `flex` is torchtitan's default, CUDA only."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    if backend == "flex":
        return []
    changed = []
    for fqn, _cfg, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = SDPADocumentAttention.Config()
        else:
            setattr(parent, attr, SDPADocumentAttention.Config())
        changed.append(fqn)
    return changed


def force_sum_reduction_on_gloo(model_spec) -> None:
    """Workaround: torchtitan disables FSDP's gradient division (factor 1.0), which FSDP turns
    into ReduceOp.PREMUL_SUM; gloo has no PREMUL_SUM. A plain SUM is the same arithmetic when
    the factor is 1. Wraps the spec's parallelize_fn so it applies after FSDP is set up.
    Remove when gloo gains PREMUL_SUM or FSDP maps factor 1.0 to SUM."""
    inner = model_spec.parallelize_fn
    if getattr(inner, "_sum_reduction_wrapped", False):
        return

    def parallelize(model, **kwargs):
        model = inner(model, **kwargs)
        if torch.distributed.get_backend() == "gloo":
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        return model

    parallelize._sum_reduction_wrapped = True
    model_spec.parallelize_fn = parallelize


def apply_device_settings(cfg: Trainer.Config, dev: DeviceInfo, *, attn_backend: str, seed: int) -> list[str]:
    """The settings that depend on the device, set in one place and returned for the log."""
    notes = apply_trainer_settings(cfg, dev, seed=seed)
    changed = use_attention_backend(cfg.model_spec.model, attn_backend)
    if changed:
        notes.append(f"attention -> SDPA with document masking in {len(changed)} layers")
    return notes


def apply_trainer_settings(cfg: Trainer.Config, dev: DeviceInfo, *, seed: int) -> list[str]:
    """The device settings that do not depend on the model family (torchtitan's own models or the
    Transformers backend): CUDA graphs, gloo reductions, seed, determinism, one log line a step."""
    notes = []
    if dev.device_type != "cuda":
        # CUDA graphs are on by default in torchtitan 0.3.0 and exist only on CUDA.
        cfg.training.disable_cuda_graphs = True
        notes.append("cuda graphs off")
    force_sum_reduction_on_gloo(cfg.model_spec)
    cfg.debug.seed = seed
    cfg.debug.deterministic = dev.device_type == "cpu"  # reproducible losses on CPU
    cfg.metrics.log_freq = 1  # one line and one recorded loss per step
    return notes


@dataclass
class LossRecorder:
    """Records what torchtitan's MetricsProcessor logs each step (loss, grad norm, tokens seen,
    wall time), so results.json holds numbers, never scraped log lines."""

    steps: list[int] = field(default_factory=list)  # starts after the resumed step when resuming
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_seen: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    progress: Path | None = None  # rank 0: OUT_DIR/losses.jsonl, one line a step, kept across resumes

    def attach(self, trainer) -> None:
        mp = trainer.metrics_processor
        original = mp.log

        def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            self.steps.append(int(step))
            self.losses.append(float(global_avg_loss))
            self.grad_norms.append(float(grad_norm))
            self.tokens_seen.append(int((extra_metrics or {}).get("n_tokens_seen", 0)))
            self.times.append(time.perf_counter())
            if self.progress is not None:
                self._append_progress(int(step), float(global_avg_loss))
            return original(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

        mp.log = log
        self.times.append(time.perf_counter())  # t0: training starts after attach

    def _append_progress(self, step: int, loss: float) -> None:
        """Append one line; on a run's first step keep only the earlier steps of the run it resumes
        (a fresh run starts the file anew), so the file is the whole loss curve across kills."""
        if len(self.steps) == 1:
            kept = [r for r in read_progress(self.progress) if r["step"] < step]
            cli.atomic_write_text(self.progress, "".join(json.dumps(r) + "\n" for r in kept))
        with open(self.progress, "a") as f:  # a kill can cut the last line; read_progress skips it
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")

    def history(self) -> dict:
        """Steps and losses of the whole run, resumed parts included (rank 0, with `progress`)."""
        rows = read_progress(self.progress) if self.progress is not None else []
        rows = rows or [{"step": s, "loss": l} for s, l in zip(self.steps, self.losses)]
        return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows]}

    def tokens_per_s(self) -> float:
        """Global tokens per second, leaving out step 1 (warm-up, compilation) when there are more."""
        if len(self.losses) >= 2:
            dt = self.times[-1] - self.times[1]
            dn = self.tokens_seen[-1] - self.tokens_seen[0]
        elif self.losses:
            dt, dn = self.times[1] - self.times[0], self.tokens_seen[0]
        else:
            return math.nan
        return dn / dt if dt > 0 else math.nan


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


def apply_checkpoint_settings(cfg: Trainer.Config, *, steps: int, every: int, export: bool,
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


def save_reference_logits(trainer, tokenizer_dir, path, *, is_main: bool) -> None:
    """Logits of the trained torchtitan model on a fixed input, for the export check.
    Every rank runs the forward (FSDP gathers parameters collectively); rank 0 writes the file."""
    import os
    from pathlib import Path

    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).encode(REFERENCE_TEXT).ids
    tokens = torch.tensor([ids], device=trainer.device)
    model = trainer.model_parts[0]
    skip = model._skip_lm_head
    model._skip_lm_head = False  # the chunked loss normally applies lm_head itself
    model.eval()
    with torch.no_grad():
        logits = model(tokens)
    model._skip_lm_head = skip
    model.train()
    if is_main:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({"input_ids": tokens.cpu(), "position_ids": torch.arange(len(ids))[None],
                   "logits": logits.detach().float().cpu().contiguous()}, str(tmp))
        os.replace(tmp, path)


def sdpa_document_attention(cfg: FlexAttention.Config) -> SDPADocumentAttention.Config:
    """Override factory (torchtitan's override registry): FlexAttention -> SDPADocumentAttention.
    Activate with `override.imports = ["common.titan.sdpa_document_attention"]`; the same change as
    `use_attention_backend(model_config, "sdpa")`, logged per layer by torchtitan."""
    del cfg  # FlexAttention's options (block sizes, mask kinds) have no SDPA counterpart
    return SDPADocumentAttention.Config()


override(target=FlexAttention.Config, exact=True,
         description="causal + packed-document attention through SDPA (CPU, Trainium, CUDA)")(sdpa_document_attention)


def export_and_check(trainer, *, out_dir: Path, steps: int, hf_cfg: dict, tokenizer_dir: Path,
                     tied_expected: bool, tol: float, is_main: bool, save_reference=None) -> dict:
    """The end of a run with --export. Every rank: logits of a fixed sentence from the trained model
    (`save_reference`, default `save_reference_logits`), then `trainer.close()`, which writes
    torchtitan's last save (HF safetensors) to OUT_DIR/checkpoint/step-STEPS. Rank 0: config.json,
    tokenizer and version stamp added and the folder moved to OUT_DIR/hf_export atomically
    (`checkpoint.complete_export`), re-read by transformers in a fresh process, logits compared.
    Returns the results entries (`export_dir`, `export_check`) on rank 0, {} on the others."""
    reference = Path(out_dir) / "export_reference.safetensors"
    (save_reference or save_reference_logits)(trainer, tokenizer_dir, reference, is_main=is_main)
    trainer.close()
    if not is_main:
        return {}
    export_dir = checkpoint.complete_export(Path(out_dir) / "checkpoint" / f"step-{steps}", Path(out_dir) / "hf_export",
                                            hf_cfg, tokenizer_dir, cli.versions())
    check = checkpoint.verify_export_subprocess(export_dir, reference, Path(out_dir) / "export_check.json")
    check["passed"] = checkpoint.export_check_passed(check, tied_expected=tied_expected, tol=tol)
    print(f"[export] {export_dir}: missing={check['missing_keys']} unexpected={check['unexpected_keys']} "
          f"tied_lm_head={check['tied_lm_head']} max_abs_logit_diff={check['max_abs_logit_diff']:.3g} "
          f"passed={check['passed']}", flush=True)
    return {"export_dir": str(export_dir), "export_check": check}
