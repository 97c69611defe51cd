"""Held-out loss during training (`--eval_every N --eval_steps K`), computed by torchtitan's own Validator.

torchtitan 0.3.0's `Trainer.Config.validator` is a `Validator.Config`: `enable`, `freq` (it validates at step 1
and at every step divisible by `freq`), `steps` (batches per validation; -1: the whole set) and `dataloader` (a
`HuggingFaceTextDataLoader.Config`: `dataset`, one of torchtitan's registered datasets, and `dataset_path`).
Each validation builds that dataloader anew, so every validation reads the same first K batches, with the
training run's `seq_len` and `local_batch_size` on each data-parallel rank, and hands the token-weighted mean
loss to `MetricsProcessor.log_validation` (recorded by `EvalRecorder` below).

The held-out data is text the training stream never holds:
- the offline corpus (`--dataset corpus`) and any folder of JSON lines with a validation split (a file named
  validation*.jsonl, valid*, val*, dev*: `datasets` names splits after file names): that split. Training reads
  the folder as torchtitan's c4_test does, `load_dataset(folder, split="train")`, i.e. the train files alone;
  the corpus's validation.jsonl holds the last documents of each half of it, left out of its train.jsonl.
  (Once a folder has a validation file, `datasets` reads only files named train* as the train split.)
- a folder without one, such as a torchtitan checkout's tests/assets/c4_test (data.json only): torchtitan's own
  `c4_validation`, the validation split of allenai/c4 streamed from the Hugging Face Hub (it needs the network).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common import paths
from common.errors import UserError

# torchtitan's datasets are looked up by name in its DATASETS registry; this one reads a local folder's
# validation split, as its c4_test reads the train split.
LOCAL_VALIDATION = "local_validation"
HUB_VALIDATION = "c4_validation"  # torchtitan's own: allenai/c4, name "en", split "validation", streamed


def has_validation_split(folder: str | os.PathLike) -> bool:
    """Whether `datasets` finds a validation split among the folder's files (by their names)."""
    from datasets.data_files import get_data_patterns

    try:
        return "validation" in get_data_patterns(str(Path(folder).resolve()))
    except Exception:  # datasets raises EmptyDatasetError and others for a folder with no data files
        return False


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def eval_dataset(training: tuple[str, str]) -> tuple[str, str | None, str]:
    """(torchtitan dataset name, dataset_path, a description) of the held-out data for a run whose training
    dataset is `training` (paths.training_dataset's (name, folder))."""
    folder = training[1]
    if has_validation_split(folder):
        return LOCAL_VALIDATION, folder, f"the validation split of {folder}"
    corpus = paths.CACHE_DIR / paths.FOLDERS["corpus"]
    if Path(folder).resolve() == corpus.resolve():
        raise UserError(f"--eval_every: the corpus in {folder} has no held-out validation.jsonl (built by an older "
                        f"recipe): rebuild it with {paths.prepare_hint('corpus')}")
    if _offline():
        raise UserError(f"--eval_every: {folder} has no validation split (a validation*.jsonl file beside the "
                        f"training files) and the Hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), so "
                        f"torchtitan's {HUB_VALIDATION} (allenai/c4) cannot be streamed")
    return HUB_VALIDATION, None, f"torchtitan's {HUB_VALIDATION} (allenai/c4 validation split, streamed from the Hub)"


def register_local_validation() -> None:
    """Add LOCAL_VALIDATION to torchtitan's DATASETS: `load_dataset(folder, split="validation")`, the `text`
    field (c4_test's sample processor). Every process that builds a trainer calls it (through
    apply_eval_settings)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    if LOCAL_VALIDATION not in text_datasets.DATASETS:
        text_datasets.DATASETS[LOCAL_VALIDATION] = DatasetConfig(
            path="", loader=_load_validation_split, sample_processor=text_datasets._process_c4_text)


def _load_validation_split(path: str):
    from datasets import load_dataset

    return load_dataset(path, split="validation")


def apply_eval_settings(tc, every: int, steps: int, dataset: tuple[str, str] | None) -> str | None:
    """Configure torchtitan's validator in a Trainer.Config: on at step 1 and every `every` steps (0: off), `steps`
    batches each, on the held-out data of the training `dataset` (None: a dry run, which reads no data).
    Returns a line for the run's notes, or None when off."""
    tc.validator.enable = bool(every) and dataset is not None
    if not tc.validator.enable:
        return None
    name, path, what = eval_dataset(dataset)
    if name == LOCAL_VALIDATION:
        register_local_validation()
    tc.validator.freq = every
    tc.validator.steps = steps
    tc.validator.dataloader.dataset = name
    tc.validator.dataloader.dataset_path = path
    return f"held-out loss at step 1 and every {every} steps, {steps} batches of {what}"


@dataclass
class EvalRecorder:
    """Records the held-out loss torchtitan's Validator hands its MetricsProcessor (`log_validation`, after each
    validated step), as common.losses.LossRecorder does for training: the validator's own token-weighted mean
    over its batches, reduced over the ranks, never recomputed here.

    It also re-shards the model after each validation. FSDP2 re-shards parameters in the backward pass; the
    validator's forward runs without one, so the model would leave it with its parameters unsharded: one
    all-gathered copy per FSDP group. Tied embeddings (one sharded parameter held by the embedding's and the
    lm_head's groups) are then two equal tensors, and hf_backend/fixes.py's tie check after the last step fails
    (measured with the Transformers backend on CPU: `is` false after each validation, true again after the next
    training step). Re-sharding returns the model to the state a training step leaves it in."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def attach(self, trainer) -> "EvalRecorder":
        mp = trainer.metrics_processor
        original = mp.log_validation

        def log_validation(loss, step, extra_metrics=None):
            self.steps.append(int(step))
            self.losses.append(float(loss))
            return original(loss=loss, step=step, extra_metrics=extra_metrics)

        mp.log_validation = log_validation
        validator = getattr(trainer, "validator", None)  # set only when the config enables it
        if validator is not None:
            validate = validator.validate

            def validate_and_reshard(model_parts, step):
                validate(model_parts, step)
                reshard(model_parts)

            validator.validate = validate_and_reshard
        return self

    def rows(self) -> list[dict]:
        """results.json's `eval_losses`: [{"step": s, "loss": x}, ...], empty when no validation ran."""
        return [{"step": s, "loss": x} for s, x in zip(self.steps, self.losses)]


def reshard(model_parts) -> None:
    """Re-shard every FSDP2 module of the model parts (nothing where FSDP is not applied)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
