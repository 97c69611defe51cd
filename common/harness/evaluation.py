"""Held-out loss during training (`--eval_every N --eval_steps K`), computed by torchtitan's own Validator.

torchtitan 0.3.0's `Trainer.Config.validator` is a `Validator.Config`: `enable`, `freq` (it validates at step 1
and at every step divisible by `freq`), `steps` (batches per validation; -1: the whole set) and `dataloader` (a
`HuggingFaceTextDataLoader.Config`: `dataset`, one of torchtitan's registered datasets, and `dataset_path`).
Each validation builds that dataloader anew, so every validation reads the same first K batches, with the
training run's `seq_len` and `local_batch_size` on each data-parallel rank, and hands the token-weighted mean
loss to `MetricsProcessor.log_validation` (recorded by common/harness/trainer.py's GuardedMetrics).

The held-out data is text the training stream never holds, and always local (nothing is streamed from a hub):
- the offline corpus (`--dataset corpus`) and any folder of JSON lines with a validation split (a file named
  validation*.jsonl, valid*, val*, dev*: `datasets` names splits after file names): that split. Training reads
  the folder as torchtitan's c4_test does, `load_dataset(folder, split="train")`, i.e. the train files alone;
  the corpus's validation.jsonl holds the last documents of each half of it, left out of its train.jsonl.
  (Once a folder has a validation file, `datasets` reads only files named train* as the train split.)
- your own data without a validation split (`--dataset FOLDER` or `--dataset FILE.jsonl`): its held-out share,
  every 100th document (paths.HELD_OUT_EVERY: documents 100, 200, ... in the order `datasets` reads the files),
  which training never reads, with or without --eval_every (common/paths.py training_dataset). Fewer than 100
  documents hold no share: the run is refused before the launch, naming the two ways to give held-out data.
- `--eval_dataset_path FOLDER`: that folder's validation split (a local copy of c4's validation files, say), in
  place of the above;
- torchtitan's c4_test folder (`--dataset c4_test --dataset_path D`, data.json only: read whole, as torchtitan
  reads it) without --eval_dataset_path: refused before the launch. Its held-out data would be torchtitan's own
  `c4_validation`, allenai/c4 streamed from the Hugging Face Hub by every rank, which is never a silent default.

An evaluation reads the held-out data at most once: torchtitan's validator loops it without end when `steps` is set
(re-shuffled each time), so `--eval_steps` past the data's size would read the same text again for hours. Here its
dataloader reads one pass, and before each batch the ranks agree (one all-reduce) whether every rank still has one
and whether to stop (a stop signal, or --time_limit: common/harness/stops.py); the first evaluation that runs out
says how many batches the data holds. The held-out losses go to results.json's `eval_losses` and, on rank 0, to
OUT_DIR/eval_losses.jsonl, kept across stops and resumes as losses.jsonl is.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from common import paths
from common.errors import AgreedError, UserError

# torchtitan's datasets are looked up by name in its DATASETS registry; this one reads a local folder's
# validation split, as its c4_test reads the train split.
LOCAL_VALIDATION = "local_validation"
HELD_OUT_SHARE = "held_out_share"  # the held-out share of own data without a validation split (paths.own_rows)
EVAL_LOSSES = "eval_losses.jsonl"  # in OUT_DIR: a line an evaluation, kept across stops and resumes


def check_eval_flags(every: int, held_out: str | None) -> None:
    """--eval_dataset_path without --eval_every would be ignored: refused before anything runs."""
    if held_out and not every:
        raise UserError(f"--eval_dataset_path {held_out} is read only with --eval_every N: add it (N: evaluate at "
                        "step 1 and every N steps)")


def eval_dataset(training: tuple[str, str], held_out: str | None = None,
                 read: bool = False) -> tuple[str, str | None, str]:
    """(torchtitan dataset name, dataset_path, a description) of the held-out data for a run whose training
    dataset is `training` (paths.training_dataset's (name, folder)); `held_out`: --eval_dataset_path. `read`: a
    local validation split is also read until a held-out text turns up (the checks before a launch), as the
    training data is: its failure would otherwise come from torchtitan's validator after step 1, with nothing saved."""
    if held_out:
        if not Path(held_out).is_dir():
            raise UserError(f"--eval_dataset_path {held_out} is not a folder: give a folder of JSON lines with a "
                            "validation split (validation*.jsonl)")
        if read:
            paths.refuse_special_files(held_out, f"--eval_dataset_path {held_out}")
        if not paths.has_validation_split(held_out):
            raise UserError(f"--eval_dataset_path {held_out} has no validation split: name its held-out files "
                            "validation*.jsonl (or .json), with a 'text' field")
        if read:
            paths.read_until_text(held_out, "validation", f"the validation split of --eval_dataset_path {held_out}",
                                  "there is nothing to evaluate on")
        return LOCAL_VALIDATION, str(Path(held_out).resolve()), f"the validation split of {held_out}"
    name, folder = training
    if name == paths.OWN_DATA:  # own data without a validation split: its held-out share
        if read:
            _read_held_out_share(folder)
        return HELD_OUT_SHARE, folder, (f"the held-out share of {folder}: every {paths.HELD_OUT_EVERY}th document, "
                                        "which training never reads")
    if read:
        paths.refuse_special_files(folder, f"--eval_every: dataset folder {folder}")
    if paths.has_validation_split(folder):
        if read:
            paths.read_until_text(folder, "validation", f"--eval_every: the validation split of {folder}",
                                  "there is nothing to evaluate on (--eval_dataset_path gives another folder)")
        return LOCAL_VALIDATION, folder, f"the validation split of {folder}"
    corpus = paths.CACHE_DIR / paths.FOLDERS["corpus"]
    if Path(folder).resolve() == corpus.resolve():
        raise UserError(f"--eval_every: the corpus in {folder} has no held-out validation.jsonl (built by an older "
                        f"recipe): rebuild it with {paths.prepare_hint('corpus')}")
    # c4_test, read whole as torchtitan reads it: its own held-out data is allenai/c4 on the Hub, never streamed
    # without being asked for
    raise UserError(f"--eval_every: the c4_test folder {folder} has no validation split, and c4_test's own held-out "
                    "data is allenai/c4's, streamed from the Hugging Face Hub: give --eval_dataset_path FOLDER (local "
                    "held-out JSON lines named validation*.jsonl, such as a copy of c4's validation files)")


def _read_held_out_share(path: str) -> None:
    """Read own data's held-out share (every HELD_OUT_EVERY-th document) until a non-empty text turns up, before a
    launch: none is one UserError (the validator would otherwise fail after step 1). The training documents were
    read by paths.training_dataset, so the data reads as JSON lines with a `text` field."""
    every, seen, found = paths.HELD_OUT_EVERY, 0, False
    for i, row in enumerate(paths.load_rows(path, streaming=True)):
        seen = i + 1
        if i % every == every - 1 and isinstance(row.get("text"), str) and row["text"].strip():
            found = True
            break
    if seen < every:
        raise UserError(f"--eval_every: {path} holds fewer than {every} documents, so its held-out share is empty: "
                        "add a validation*.jsonl beside the training files, or give --eval_dataset_path FOLDER")
    if not found:
        raise UserError(f"--eval_every: the held-out share of {path} (every {every}th document) holds no non-empty "
                        "'text': add a validation*.jsonl beside the training files, or give --eval_dataset_path")


def register_held_out_share() -> None:
    """Add HELD_OUT_SHARE to torchtitan's DATASETS: paths.own_rows' held-out documents, the `text` field. Every
    process that builds a trainer calls it (through apply_eval_settings)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    if HELD_OUT_SHARE not in text_datasets.DATASETS:
        text_datasets.DATASETS[HELD_OUT_SHARE] = DatasetConfig(
            path="", loader=_load_held_out_share,
            sample_processor=text_datasets._process_c4_text)


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

    return splittable(load_dataset(path, split="validation"))


def _load_held_out_share(path: str):
    return splittable(paths.own_rows(path, held_out=True))


def splittable(rows):
    """Held-out rows torchtitan can split over the ranks: it gives each rank a contiguous slice of a map-style
    dataset (datasets' split_dataset_by_node), which fails with an IndexError on a rank past the last row when there
    are fewer rows than ranks; as an iterable dataset such a rank gets none, and the validator's gate then says in
    one line that the held-out data holds no batch for every rank."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    return rows.to_iterable_dataset() if len(rows) < ranks else rows


def apply_eval_settings(tc, every: int, steps: int, dataset: tuple[str, str] | None,
                        held_out: str | None = None) -> str | None:
    """Configure torchtitan's validator in a Trainer.Config: on at step 1 and every `every` steps (0: off), `steps`
    batches each, on the held-out data of the training `dataset` (None: a dry run, which reads no data) or of
    `held_out` (--eval_dataset_path). Returns a line for the run's notes (None: nothing to say). Every guarded run
    calls it after device setup: it also registers the training data's name where it is the user's own data
    (paths.OWN_DATA), which torchtitan's dataloader looks up with or without evaluation, and says that its held-out
    share is not trained on."""
    own = dataset is not None and dataset[0] == paths.OWN_DATA
    if own:
        paths.register_own_data()
    tc.validator.enable = bool(every) and dataset is not None
    if not tc.validator.enable:
        return (f"data: every {paths.HELD_OUT_EVERY}th document of {dataset[1]} is its held-out share, not trained "
                "on (--eval_every evaluates on it)") if own else None
    name, path, what = eval_dataset(dataset, held_out)
    if name == LOCAL_VALIDATION:
        register_local_validation()
    elif name == HELD_OUT_SHARE:
        register_held_out_share()
    tc.validator.freq = every
    tc.validator.steps = steps
    tc.validator.dataloader.dataset = name
    tc.validator.dataloader.dataset_path = path
    return f"held-out loss at step 1 and every {every} steps, {steps} batches of {what}"


class HeldOutGate:
    """The gate before each held-out batch of an evaluation (GuardedValidator, common/harness/trainer.py): whether
    every rank has one (False ends the evaluation there, as the end of torchtitan's data does) and, with the run's
    stop control (`stop`), whether to stop (StopNow on every rank). The first evaluation that runs out says how many
    batches the held-out data holds; later ones read that many.

    The validator also re-shards the model after each evaluation. FSDP2 re-shards parameters in the backward pass;
    the validator's forward runs without one, so the model would leave it with its parameters unsharded: one
    all-gathered copy per FSDP group. Tied embeddings (one sharded parameter held by the embedding's and the
    lm_head's groups) are then two equal tensors, and hf_backend/fixes.py's tie check after the last step fails
    (measured with the Transformers backend on CPU: `is` false after each validation, true again after the next
    training step). Re-sharding returns the model to the state a training step leaves it in."""

    def __init__(self, asked: int, stop=None):
        self.asked = asked  # --eval_steps
        self.stop = stop  # the run's StopControl (None: no stop is agreed, only whether every rank has a batch)
        self.pass_batches: int | None = None  # batches a rank of one pass over the held-out data, once known
        self.batches = 0  # read in the current evaluation

    def start(self) -> None:
        self.batches = 0
        if self.stop is not None:
            self.stop.eval_started()

    def __call__(self, done: int, have: bool) -> bool:
        asked = self.asked
        planned = asked if asked > 0 else self.pass_batches or done + 1  # the batches this evaluation will read
        planned = min(planned, self.pass_batches or planned)
        every = self.stop.eval_batch(done, planned, have) if self.stop is not None else _every_rank_has(have)
        if every:
            self.batches = done + 1
            return True
        if done == 0:
            raise AgreedError("--eval_every: the held-out data holds no batch of --local_batch_size sequences of "
                              "--seq_len tokens for every rank: use more held-out data, or fewer ranks")
        if self.pass_batches is None:
            self.pass_batches = done
            if done < asked and int(os.environ.get("RANK", "0")) == 0:
                print(f"[eval] the held-out data gives every rank {done} batches: each evaluation reads them once "
                      f"({done} batches, not --eval_steps {asked})", flush=True)
        return False


def eval_rows(metrics, path: Path | None) -> list[dict]:
    """results.json's `eval_losses`: [{"step": s, "loss": x}, ...], empty when no validation ran; on rank 0 (`path`:
    OUT_DIR/eval_losses.jsonl) those of the whole run, resumed parts included; elsewhere this process's
    (`metrics`: the run's GuardedMetrics)."""
    if path is not None and metrics.first_step is not None:
        return _read_rows(path)
    return [{"step": s, "loss": x} for s, x in zip(metrics.eval_steps, metrics.eval_losses)]


class HeldOutPass:
    """Stands in for the Validator's dataloader config (`validator.dl_config`, whose `build` it calls once per
    evaluation): the same dataloader, reading the held-out data once instead of looping it, its batches passed
    through `gate(done, have) -> bool` (False: the evaluation ends before that batch)."""

    def __init__(self, config, gate):
        self.config = dataclasses.replace(config, infinite=False) if hasattr(config, "infinite") else config
        self.gate = gate

    def build(self, **kwargs):
        return _GatedBatches(self.config.build(**kwargs), self.gate)


class _GatedBatches:
    def __init__(self, loader, gate):
        self.loader, self.gate = loader, gate

    def __iter__(self):
        batches, done = iter(self.loader), 0
        while True:
            try:
                batch, have = next(batches), True
            except StopIteration:
                batch, have = None, False
            if not self.gate(done, have):
                return
            done += 1
            yield batch


def _every_rank_has(have: bool) -> bool:
    from common.device import agree_max

    return not agree_max([0.0 if have else 1.0])[0]


def _read_rows(path: Path) -> list[dict]:
    """The rows of an eval_losses.jsonl ({"step", "loss"} a line); a last line cut by a kill is skipped."""
    from common.harness.checks import read_progress

    return read_progress(path)


def reshard(model_parts) -> None:
    """Re-shard every FSDP2 module of the model parts (nothing where FSDP is not applied)."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
