# Copy with this file the core (it trains and exports):
#   common/__init__.py common/errors.py common/cli.py common/device.py common/paths.py common/results.py
#   common/checkpoint.py common/losses.py common/export.py common/torchtitan_fixes.py common/recipe.py
#   common/trainer.py common/processes.py
# and the harness, for the guards (preflight, out_dir lock, resume, stop signals, self-launch, dry run, pilot
# report, held-out eval, the export verifier):
#   common/harness/ (the whole folder)
# With the core alone, the entry is the core's: change the `run` import below to
#   from common.recipe import run_core as run
"""Train torchtitan's own Qwen3, chosen through `config.model_spec`, and export HF safetensors.

The second path of the AWS guide: start from torchtitan's `qwen3_32b` builder (torchtitan
0.3.0 has no general 4B builder), switch `model_spec` to the 4B flavor, set the global batch to
64, train 10 steps on c4_test, export HF safetensors, and re-read the export with transformers.
The builder's name does not mean a 32B model is trained: the spec decides the model.

CPU (the default preset, `tiny`: a 2-layer Qwen3 with the real 151,936-token vocabulary, the
real Qwen3 tokenizer and offline English text, all prepared by `make setup`):
    python examples/train_native_qwen3.py --steps 10 --out_dir runs/native
    torchrun --nproc_per_node 2 examples/train_native_qwen3.py --out_dir runs/native2   # FSDP over gloo
    python examples/train_native_qwen3.py --nproc_per_node 2 --out_dir runs/native2    # same, self-launched

One trn2.48xlarge (64 logical NeuronCores at LNC=2, one process each):
    python examples/train_native_qwen3.py --preset qwen3_4b --nproc_per_node 64 \
        --dataset_path /path/to/torchtitan/tests/assets/c4_test
Several nodes: the same command on each, with --nnodes N --node_rank R --master_addr NODE0 (or torchrun's own)
Qwen3-8B in AWS's layout (tensor parallel 4 x FSDP 16, selective activation checkpointing); what fits, on any CPU:
    python examples/train_native_qwen3.py --preset qwen3_8b --dry_run

Start from an HF checkpoint (any dense Qwen3; the model shape comes from its config.json):
    python examples/train_native_qwen3.py --hf_checkpoint runs/native/hf_export --out_dir runs/ft

Expected (tiny, 10 steps, 2-core CPU): loss falls from about 11.95 to about 11.2, a second or two a step;
results.json has `losses`, `tokens_per_s`, `export_dir` and `export_check` with no missing or
unexpected keys and max_abs_logit_diff below 1e-5; loss.png plots the losses.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/

from common import checkpoint, paths  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.harness.lifecycle import run  # noqa: E402  the guarded run (the core alone: see the header)
from common.recipe import Inputs, Recipe, TrainConfig, apply_settings  # noqa: E402


@dataclass
class Config(TrainConfig):
    flavor: str = field(default="tiny", metadata={"help": "torchtitan Qwen3 flavor (0.6B, 4B, 32B, ...) or 'tiny'"})
    out_dir: str = field(default="runs/native_qwen3", metadata={"help": "results.json, loss.png, hf_export/ go here"})
    attn_backend: Literal["sdpa", "flex"] = field(default="sdpa", metadata={
        "help": "sdpa: document-masked SDPA (CPU, Trainium, CUDA); flex: torchtitan's default, CUDA only"})
    hf_assets: str | None = field(
        default=None, metadata={"help": "HF folder with the tokenizer (default: the Qwen3 tokenizer from set-up)"})
    hf_checkpoint: str | None = field(default=None, metadata={
        "help": "initial weights: an HF Qwen3 folder (config.json + safetensors); sets the model shape"})


def tiny() -> Config:
    """CPU default: 2-layer Qwen3, real vocabulary, offline English, float32."""
    return Config()


def qwen3_4b() -> Config:
    """trn2.48xlarge as in the AWS guide: Qwen3-4B spec on the qwen3_32b builder, 64 ranks, global batch 64, c4_test."""
    return replace(Config(), flavor="4B", device="neuron", dtype="bfloat16", local_batch_size=1,
                   global_batch_size=64, seq_len=4096, lr=8e-4, warmup_steps=2,
                   dataset="c4_test", hf_assets="assets/hf/Qwen3-4B-Instruct-2507")


def qwen3_8b() -> Config:
    """trn2.48xlarge in AWS's Qwen3-8B layout (TorchTitan Neuron's basic training tutorial, its config
    `qwen3_8b_tp4_fsdp16_sac`): tensor parallel 4 x FSDP 16 over 64 ranks, selective activation checkpointing.
    Sequence length 4,096, local batch 1, global batch 16 (one sequence a data-parallel rank, no accumulation),
    lr 3e-4 and 2 warm-up steps: AWS's own TorchTitan recipe of that layout in a public copy of TorchNeuron's
    pre-release repository (github.com/parmoham-aws/test-repo-parmoham@98154b8,
    docs/torchtitan/qwen3/qwen3_8b_tp4_fsdp.toml, lines 23, 27, 30-31, 34-35, 38, 40, 52).

    Not drcanchi-aws/torchtitan's qwen3_8b_actual_tp4_fsdp16.toml (global batch 64): a fork of upstream torchtitan
    with full activation checkpointing, where this is AWS's own recipe of the layout with the tutorial's selective.
    """
    return replace(qwen3_4b(), flavor="8B", tensor_parallel_degree=4, activation_checkpoint="selective",
                   seq_len=4096, local_batch_size=1, global_batch_size=16, lr=3e-4, warmup_steps=2,
                   hf_assets="assets/hf/Qwen3-8B")


PRESETS = {"tiny": tiny, "qwen3_4b": qwen3_4b, "qwen3_8b": qwen3_8b}
HF_MODEL_ID = {"qwen3_4b": "Qwen/Qwen3-4B-Instruct-2507", "qwen3_8b": "Qwen/Qwen3-8B"}  # into hf_assets on trn2
PUBLISHED_PARAMS = {"4B": 4.0e9, "8B": 8.2e9}  # Qwen3-4B and Qwen3-8B model cards: 4.0 B and 8.2 B parameters


def check_inputs(cfg: Config) -> Inputs:
    """The tokenizer, the HF checkpoint to start from, and the model's shape where a config.json gives it."""
    hint = f" (download {HF_MODEL_ID[cfg.preset]} there first)" if cfg.preset in HF_MODEL_ID else ""
    found = Inputs(tokenizer_dir=checkpoint.check_tokenizer(cfg.hf_assets or paths.asset_dir("tokenizer"), hint))
    if cfg.hf_checkpoint:
        found.shape = checkpoint.validate_hf_checkpoint(cfg.hf_checkpoint, checkpoint.QWEN3_DENSE)
        found.hf_folder = found.initial_hf = Path(cfg.hf_checkpoint).resolve()
    elif cfg.flavor == "tiny":  # a torchtitan flavor has no config.json here: --dry_run sizes it
        found.shape = checkpoint.read_hf_config(paths.asset_dir("tiny_qwen3"))
    return found


def trainer_config(cfg: Config, dev, out_dir: Path, found: Inputs):
    """The AWS guide's recipe: torchtitan's qwen3_32b builder, then the model spec swapped."""
    # torchtitan imports stay inside functions: device.setup() must run before torchtitan loads.
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_32b
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from common import torchtitan_fixes

    tc = qwen3_32b()
    if cfg.hf_checkpoint or cfg.flavor == "tiny":  # the shape comes from a config.json (tiny: the set-up's
        where = cfg.hf_checkpoint or paths.asset_dir("tiny_qwen3")  # tiny Qwen3, whose weights are not loaded)
        tc.model_spec = checkpoint.qwen3_spec_from_hf(found.shape or checkpoint.read_hf_config(where), where=where)
    else:
        try:
            tc.model_spec = model_registry(cfg.flavor)
        except KeyError:
            raise UserError(f"unknown Qwen3 flavor {cfg.flavor!r}") from None
    tc.loss.loss_fn.global_vocab_size = decoder_vocab_size(tc.model_spec)
    notes = apply_settings(tc, cfg, dev, out_dir, found)  # files, data, batch, AdamW, checkpointer, fixes
    if changed := torchtitan_fixes.use_attention_backend(tc.model_spec.model, cfg.attn_backend, cfg.document_mask):
        path = torchtitan_fixes.attention_path(tc.model_spec.model, dev.device_type)
        notes.append(f"attention -> {torchtitan_fixes.ATTENTION_PATHS[path]} in {len(changed)} layers")
    return tc, notes


def describe(cfg: Config, shape: dict) -> tuple[str, float | None]:
    """--dry_run's label, and the published size it must match."""
    return f"{cfg.preset} (Qwen3 {cfg.flavor})", None if cfg.hf_checkpoint else PUBLISHED_PARAMS.get(cfg.flavor)


def dry_run_inputs(cfg: Config, out_dir: Path) -> Inputs:
    return Inputs(shape=checkpoint.validate_hf_checkpoint(cfg.hf_checkpoint, checkpoint.QWEN3_DENSE)
                  if cfg.hf_checkpoint else None)


RECIPE = Recipe("train_native_qwen3.py", __doc__, Config, PRESETS, check_inputs, trainer_config,
                describe=describe, dry_run_inputs=dry_run_inputs, stack="native")

if __name__ == "__main__":
    sys.exit(run(RECIPE))
