"""A training recipe and the core's run of it.

An example script is a recipe: its presets, its model choice and its torchtitan `Trainer.Config`
(`trainer_config`), declared as a `Recipe`. This module runs it: the inputs checked, the trainer built
and trained, the HF export written and re-read by transformers, results.json and loss.png. The guards a
paid run wants around that (preflight, the out_dir lock, resume and stop signals, the self-launcher, the
dry run, the pilot report, held-out eval: common/harness/) plug in through `Hooks`; without them, as in a
copy of an example with the core alone, `run_core` trains and exports. An example's entry line names one of the two:
the harness's `run`, or `run_core` in a copy without common/harness/ (its header says which line to change).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from common import checkpoint, cli, device, export, paths
from common.errors import UserError
from common.losses import finish_run, not_finite
from common.results import versions


@dataclass
class TrainConfig:
    """The flags every training recipe has; a recipe's Config adds its model's (and the harness its guards')."""
    preset: str = "tiny"
    steps: int = field(default=10, metadata={"help": "training steps", **cli.bounds(1, 10**7)})
    out_dir: str = field(default="runs/train", metadata={"help": "results.json, loss.png, hf_export/ go here"})
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(
        default="auto", metadata={"help": "auto: neuron, then cuda, then cpu"})
    seed: int = field(default=0, metadata={"help": "seed for init and data order", **cli.bounds(0, 2**32 - 1)})
    lr: float = field(default=3e-3, metadata={"help": "peak AdamW learning rate", **cli.bounds(0.0, 10.0)})
    warmup_steps: int = field(default=2, metadata={"help": "linear warm-up steps", **cli.bounds(0, 10**7)})
    local_batch_size: int = field(default=2, metadata={"help": "sequences per rank per micro-step",
                                                       **cli.bounds(1, 2**20)})
    global_batch_size: int = field(
        default=-1, metadata={"help": "sequences per step over all ranks (-1: local x data-parallel ranks)",
                              **cli.bounds(1, 2**24, also=(-1,))})
    seq_len: int = field(default=128, metadata={
        "help": "tokens per sequence (at most the model's positions)",
        **cli.bounds(8, 2**18, multiple_of=8, why="torchtitan's chunked loss splits each sequence into 8")})
    tensor_parallel_degree: int = field(default=1, metadata={
        "help": "ranks each layer's weights are split over (torchtitan's tensor parallel, sequence parallel on); the "
                "rest of the ranks are data parallel (FSDP): 64 ranks at 4 train 16 data-parallel replicas",
        **cli.bounds(1, 4096)})
    activation_checkpoint: Literal["recipe", "none", "selective", "full"] = field(default="recipe", metadata={
        "help": "activations recomputed in the backward, torchtitan's own: none, selective (per op) or full (per "
                "layer); recipe: what the recipe's torchtitan builder sets"})
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata={"help": "parameter dtype in compute (FSDP mixed precision)"})
    dataset: str = field(default="corpus", metadata={
        "help": "'corpus' (offline English from set-up), 'c4_test' (with --dataset_path), or your own JSON lines with "
                "a 'text' field: a folder or one .jsonl file (without a validation*.jsonl, every 100th document is "
                "held out, not trained on)"})
    dataset_path: str | None = field(
        default=None, metadata={"help": "for --dataset c4_test only: its folder (a torchtitan checkout's "
                                        "tests/assets/c4_test); refused with any other --dataset"})
    document_mask: Literal["auto", "on", "off"] = field(default="auto", metadata={
        "help": "SDPA attention masks the packed documents of a sequence apart. auto: off on Neuron (TorchNeuron's "
                "fused flash-attention kernel takes no mask; with one it falls back to float32 heads x seq x seq "
                "scores, +6.5 GiB a core at qwen3_4b: docs/memory-model.md), on elsewhere; off: a token also attends "
                "to the earlier documents packed into its sequence, as AWS's recipes train"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each transformer block and the loss, as torchtitan compiles them (per block, "
                "fullgraph); the backend: --compile_backend"})
    compile_backend: str | None = field(default=None, metadata={
        "help": "with --compile: torch.compile's backend (default: neuron on Trainium, TorchTitan Neuron's "
                "`--compile.backend neuron`; inductor on CPU and CUDA; aot_eager traces without generating code)"})
    load_check: bool = field(default=True, metadata={
        "help": "starting from HF weights: compare the built model with transformers' load of them before step 1 "
                "(a guard of common/harness/: a copy of the core alone skips it)"})
    export: bool = field(default=True, metadata={
        "help": "write HF safetensors + config + tokenizer to OUT_DIR/hf_export and verify them"})
    export_tolerance: float | None = field(default=None, metadata={
        "help": "max abs logits difference the export check accepts, and the load check if larger (none: the recipe's)",
        **cli.bounds(above=0.0, high=1000.0)})
    lnc: int = field(default=2, metadata={"help": "Trainium logical NeuronCore size (NEURON_LOGICAL_NC_CONFIG)",
                                          **cli.bounds(1, 2)})
    comm_timeout_s: int = field(default=600, metadata={
        "help": "seconds a rank waits in a collective before the run is aborted: the process group's timeout before "
                "step 1 and torchtitan's comm.train_timeout_seconds after it (its own default, 100 s, aborts a "
                "checkpoint or stop save in which a rank waits longer for the slowest shard write); raise it for "
                "large checkpoints on slow storage", **cli.bounds(10, 7 * 24 * 3600)})
    neff_cache_dir: str | None = field(default=None, metadata={
        "help": "Trainium: the folder TorchNeuron keeps its compiled graphs (NEFFs) in, TORCH_NEURONX_NEFF_CACHE_DIR "
                "(default: that variable where set, else OUT_DIR/neff_cache, beside the run: a resume on a new host, "
                "whose /tmp is empty, compiles nothing again; give every run one folder to share their compiles)"})
    torchtitan: tuple = field(default=(), metadata={"dotted": True, "help": (
        "Any other torchtitan setting by its own dotted name, --SECTION.FIELD VALUE, set on the recipe's "
        "Trainer.Config after the flags above (--lr_scheduler.decay_ratio 0.5, --lr_scheduler.min_lr_factor 0.1, "
        "--training.max_norm 0.5, --parallelism.data_parallel_shard_degree 8, --compile.components model); "
        "a field a flag above sets is refused with that flag's name, and so are the sections the scripts hold "
        "(checkpoint, dataloader, validator, profiler, metrics, the model spec); lists are comma-separated, none "
        "is None")})
    guards: Any = field(default=None, metadata={  # a typed section, as torchft's `fault_tolerance` in its Config
        "section": "the guards' settings where common/harness/ runs the recipe (its Guards; their fields are flags "
                   "too); None for the core alone"})

    EXPORT_TOLERANCE: ClassVar[dict] = {"float32": 1e-5, "bfloat16": 5e-2}  # exported weights, re-read

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if self.export_tolerance is None:
            self.export_tolerance = self.EXPORT_TOLERANCE[self.dtype]


@dataclass
class Inputs:
    """What a run's inputs are, found by the checks before anything is built (`check_inputs`)."""
    tokenizer_dir: Path | None = None  # the folder holding tokenizer.json
    hf_folder: Path | None = None  # an HF folder whose config.json torchtitan reads
    initial_hf: Path | None = None  # an HF folder whose weights the run starts from
    shape: dict | None = None  # the model's config.json, where known before the build
    dataset: tuple[str, str | None] | None = None  # torchtitan's dataset name and path (None: a dry run reads none)


# The model configs a recipe of torchtitan's own Qwen3 needs (its model spec's config.json); a recipe of another model
# (the Transformers backend's) names its own.
def qwen3_shape(cfg, tc, found: Inputs) -> dict:
    """The config.json of the model `tc` configures: what it sizes and counts (FLOPs, memory)."""
    return checkpoint.hf_config_from_qwen3(tc.model_spec.model)


def qwen3_export_config(cfg, tc, found: Inputs, dtype: str) -> dict:
    """The config.json the HF export carries, its weights in `dtype`."""
    return checkpoint.hf_config_from_qwen3(tc.model_spec.model, dtype=dtype)


def qwen3_built_config(cfg, trainer, found: Inputs) -> Any:
    """The config of the model as built: the load check compares it with the HF folder's."""
    return checkpoint.hf_config_from_qwen3(trainer.config.model_spec.model)


def nothing_more(*args) -> dict:
    return {}


@dataclass(frozen=True)
class Recipe:
    """An example's recipe, declared once as torchtitan declares a model (its `ModelSpec` names the functions that
    build it): the script's flags and presets, and the functions that make its torchtitan Trainer.Config and check
    what a config cannot say. `run_core` (or common/harness/lifecycle.py's `run`, with the guards) runs it."""

    name: str  # the script's file name
    doc: str  # the script's docstring: its --help
    config: type  # its flags: a TrainConfig subclass
    presets: dict  # preset name -> a function returning a `config` (--preset); the first is the default
    check_inputs: Callable  # (cfg) -> Inputs: the recipe's own inputs, checked before anything is built
    trainer_config: Callable  # (cfg, dev, out_dir, found) -> (Trainer.Config, notes for the log): the recipe
    model_shape: Callable = qwen3_shape  # (cfg, tc, found) -> the trained model's config.json
    export_config: Callable = qwen3_export_config  # (cfg, tc, found, dtype) -> the export's config.json
    built_config: Callable = qwen3_built_config  # (cfg, trainer, found) -> the built model's config
    after_build: Callable = nothing_more  # (cfg, trainer, tc, found, log) -> results entries, before step 1
    after_train: Callable = nothing_more  # (cfg, trainer, found) -> results entries, after the last step
    describe: Callable | None = None  # (cfg, shape) -> (the dry run's label, the published parameter count)
    dry_run_inputs: Callable | None = None  # (cfg, out_dir) -> Inputs for a dry run (default: none)
    stack: str = "native"  # the preflight's set of torchtitan symbols (common/harness/preflight.py)
    stack_options: Callable | None = None  # (cfg) -> the preflight's options for that set
    pass_positions: bool = False  # the model's forward takes position_ids (the Transformers backend)
    seq_divisor: int = 1  # under tensor parallel, --seq_len is a multiple of the degree times this
    # The trainer patches transformers (the Transformers backend replaces its init functions): the export check then
    # reads the HF folder in a process of its own, the load check's reference is made before the build.
    patches_transformers: bool = False

    @property
    def default_preset(self) -> str:
        return next(iter(self.presets))


def inputs(recipe: Recipe, cfg) -> Inputs:
    """The checks every run makes before it builds anything: the recipe's own, the attention backend, the
    data and the sequence length against the model's positions."""
    found = recipe.check_inputs(cfg)
    device_type = device.resolve_device_type(cfg.device)
    if getattr(cfg, "attn_backend", "sdpa") == "flex" and device_type != "cuda":
        raise UserError(f"--attn_backend flex needs CUDA (FlexAttention has no {device_type} backward); use sdpa")
    if getattr(cfg, "attn_backend", "sdpa") == "flex" and cfg.document_mask != "auto":
        raise UserError("--document_mask applies to --attn_backend sdpa (FlexAttention always masks documents)")
    found.dataset = paths.training_dataset(cfg.dataset, cfg.dataset_path)
    if found.shape:
        positions = checkpoint.config_value(found.shape, "max_position_embeddings", int,
                                           found.hf_folder or "the model's config.json")
        if cfg.seq_len > positions:
            raise UserError(f"--seq_len {cfg.seq_len} is more than the model's {positions} positions")
        if found.tokenizer_dir and "vocab_size" in found.shape:
            checkpoint.check_vocab_fits(found.tokenizer_dir, checkpoint.config_value(
                found.shape, "vocab_size", int, found.hf_folder or "the model's config.json"),
                str(found.hf_folder or "its config.json"))
    return found


def check_layout(shape: dict | None, *, tp: int, seq_len: int, world_size: int, global_batch: int,
                 local_batch: int, seq_divisor: int = 1) -> int:
    """The one check that a layout divides, before anything is built or launched (the training path's, the dry run's,
    the core's): the ranks split into `tp`-rank tensor-parallel groups, the rest data parallel; the global batch (-1:
    local x data-parallel ranks) splits into local batches on every data-parallel rank (torchtitan adds gradient
    accumulation for the rest); tensor parallel splits each layer's heads (query and key/value), MLP width and the
    vocabulary over `tp` ranks and, with sequence parallel, each sequence (a multiple of tp x `seq_divisor`: the
    Transformers backend's 2 x its context-parallel degree). `shape`: the model's config.json (None: unknown yet).
    Returns the data-parallel degree."""
    if world_size % tp:
        raise UserError(f"--tensor_parallel_degree {tp} does not divide the {world_size} rank"
                        f"{'s' * (world_size != 1)}")
    dp = world_size // tp
    if global_batch > 0 and global_batch % (local_batch * dp):
        split = f"{dp} data-parallel ranks ({world_size} ranks / tensor parallel {tp})" if tp > 1 else \
            f"{world_size} ranks"
        raise UserError(f"global batch {global_batch} is not a multiple of local batch {local_batch} x {split}")
    if tp == 1:
        return dp
    if seq_len % (tp * seq_divisor):
        times = f" x {seq_divisor}" if seq_divisor > 1 else ""
        raise UserError(f"--seq_len {seq_len} does not split over --tensor_parallel_degree {tp}{times} (sequence "
                        "parallel splits every sequence over the tensor-parallel ranks)")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "vocab_size"):
        n = (shape or {}).get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n % tp:
            raise UserError(f"--tensor_parallel_degree {tp} does not divide the model's {key} {n}: each rank "
                            f"holds an equal slice (whole heads); choose a degree that divides {n}")
    return dp


def apply_settings(tc, cfg, dev, out_dir: Path, found: Inputs) -> list[str]:
    """What every recipe sets in its torchtitan Trainer.Config from the flags: where files go (the tokenizer and
    config.json are staged into OUT_DIR/hf_assets before the build), the data, batch, sequence length and dtype,
    AdamW and its warm-up, the checkpointer (the initial HF weights in, resumable saves, the last save as HF
    safetensors) and the workarounds off CUDA (common/torchtitan_fixes.py). Returns notes for the log."""
    from torchtitan.components.optimizer import default_adamw

    from common import torchtitan_fixes  # after device.setup(): torchtitan binds its device at import

    tc.hf_assets_path = str(out_dir / "hf_assets")
    tc.dump_folder = str(out_dir)
    if found.dataset is not None:  # a dry run reads no data
        if found.dataset[0] == paths.OWN_DATA:  # a name of this project's, given to torchtitan after device setup
            paths.register_own_data()
        tc.dataloader.dataset, tc.dataloader.dataset_path = found.dataset
    tc.training.steps = cfg.steps
    tc.training.local_batch_size = cfg.local_batch_size
    tc.training.global_batch_size = cfg.global_batch_size
    tc.training.seq_len = cfg.seq_len
    tc.training.mixed_precision_param = cfg.dtype
    tc.optimizer = default_adamw(lr=cfg.lr)
    tc.lr_scheduler.warmup_steps = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    tc.comm.init_timeout_seconds = tc.comm.train_timeout_seconds = cfg.comm_timeout_s  # the group: device.setup
    tc.parallelism.tensor_parallel_degree = cfg.tensor_parallel_degree  # the rest of the ranks: FSDP (degree -1)
    if cfg.compile:  # torchtitan's own compile: each block with fullgraph=True, and the loss
        tc.compile.enable, tc.compile.components = True, ["model", "loss"]
        tc.compile.backend = cfg.compile_backend or compile_backend(dev.device_type)
    if cfg.activation_checkpoint != "recipe":
        tc.activation_checkpoint = activation_checkpoint_config(cfg.activation_checkpoint)
    export.apply_checkpoint_settings(tc, steps=cfg.steps, initial_hf=found.initial_hf, dtype=cfg.dtype)
    return torchtitan_fixes.apply_trainer_settings(tc, dev, seed=cfg.seed)  # CUDA graphs, gloo, seed, logging


# The Trainer.Config fields a short flag sets (apply_settings, and the guards' configure): a dotted setting of one is
# refused with the flag's name, so that each field has one name on the command line.
SHORT_FLAGS = {
    "training.steps": "steps", "training.local_batch_size": "local_batch_size", "training.seq_len": "seq_len",
    "training.global_batch_size": "global_batch_size", "training.mixed_precision_param": "dtype",
    "optimizer.lr": "lr", "lr_scheduler.warmup_steps": "warmup_steps", "debug.seed": "seed",
    "comm.init_timeout_seconds": "comm_timeout_s", "comm.train_timeout_seconds": "comm_timeout_s",
    "parallelism.tensor_parallel_degree": "tensor_parallel_degree", "compile.enable": "compile",
    "compile.backend": "compile_backend", "activation_checkpoint": "activation_checkpoint",
    "dataloader.dataset": "dataset", "dataloader.dataset_path": "dataset_path", "dump_folder": "out_dir",
    "hf_assets_path": "hf_assets", "checkpoint.interval": "checkpoint_every",
    "checkpoint.keep_latest_k": "keep_checkpoints", "checkpoint.async_mode": "async_checkpoint",
    "checkpoint.initial_load_path": "hf_checkpoint", "metrics.enable_tensorboard": "tensorboard",
    "validator.enable": "eval_every", "validator.freq": "eval_every", "validator.steps": "eval_steps",
    "profiler.enable_profiling": "profile", "profiler.profile_freq": "profile_freq",
}


# The Trainer.Config sections and fields the scripts own as a whole: what they promise (a resume, an export re-read,
# results.json's records) depends on them. A dotted setting of one is refused with the flags that set them.
HELD = {
    "checkpoint": "the resume and the export depend on it: --checkpoint_every, --keep_checkpoints, "
                  "--async_checkpoint, --hf_checkpoint, --export",
    "dataloader": "the resume keeps its shards and positions: --dataset, --dataset_path",
    "validator": "--eval_every, --eval_steps, --eval_dataset_path",
    "profiler": "--profile, --profile_freq, --profile_device",
    "metrics": "results.json records each step: --tensorboard",
    "debug.deterministic": "the CPU runs' reproducible losses depend on it",
    "model_spec": "the recipe's model: --preset, --hf_checkpoint and the example's model flags",
}


def set_dotted(tc, settings) -> list[str]:
    """The command line's dotted settings (`--SECTION.FIELD VALUE`: cli.split_dotted) set on the Trainer.Config `tc`,
    each converted to its field's type; one UserError for a name it has not, a field a short flag sets or the scripts
    hold (HELD), or a value its type refuses. Returns notes for the log."""
    notes = []
    for name, text in settings:
        if (short := SHORT_FLAGS.get(name)) or (short := SHORT_FLAGS.get(name.split(".")[0])):
            raise UserError(f"--{name}: set it with --{short}, the flag for this setting")
        if held := next((why for part, why in HELD.items() if name == part or name.startswith(part + ".")), None):
            raise UserError(f"--{name}: set by the scripts, not on the command line ({held})")
        *parents, last = name.split(".")
        obj, walked = tc, []
        for part in parents:
            walked.append(part)
            obj = getattr(obj, part, None) if dataclasses.is_dataclass(obj) and part in _field_names(obj) else None
            if obj is None or not dataclasses.is_dataclass(obj):
                raise UserError(f"--{name}: torchtitan's {type(tc).__qualname__} has no section "
                                f"{'.'.join(walked)}")
        if not dataclasses.is_dataclass(obj) or last not in _field_names(obj):
            known = ", ".join(sorted(_field_names(obj)))
            raise UserError(f"--{name}: torchtitan's {type(obj).__qualname__} has no field {last!r} (its fields: "
                            f"{known})")
        value = _typed(name, text, _field_type(obj, last), getattr(obj, last))
        setattr(obj, last, value)
        notes.append(f"{name}={value!r}")
    return notes


def _field_names(obj) -> set[str]:
    return {f.name for f in dataclasses.fields(obj) if f.init}


def _field_type(obj, name: str):
    """The annotation of field `name` of dataclass `obj` (Annotated unwrapped); None where it cannot be resolved."""
    try:
        tp = typing.get_type_hints(type(obj))[name]
    except Exception:  # noqa: BLE001  a forward reference torchtitan's module cannot resolve: use the value's type
        return None
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _typed(name: str, text: str, tp, current):
    """`text` as a value of type `tp` (None: the current value's type): bool, int, float, str, a Literal's choice, an
    optional one (none), or a list of them (comma-separated)."""
    import types

    if tp is None:
        tp = type(current) if current is not None else str
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _typed(name, text, inner[0], current)
        tp = type(current) if current is not None else str
    if typing.get_origin(tp) is typing.Literal:
        if text not in [str(a) for a in args]:
            raise UserError(f"--{name} takes one of {', '.join(map(str, args))}; got {text!r}")
        return next(a for a in args if str(a) == text)
    if typing.get_origin(tp) in (list, tuple) and args:
        items = [_typed(name, t.strip(), args[0], None) for t in text.split(",") if t.strip()]
        return items if typing.get_origin(tp) is list else tuple(items)
    if tp is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise UserError(f"--{name} takes true or false; got {text!r}")
        return text.lower() in ("true", "1")
    if tp in (int, float, str):
        try:
            value = tp(text)
        except ValueError:
            raise UserError(f"--{name} takes {'an integer' if tp is int else 'a number'}; got {text!r}") from None
        if tp is float and not math.isfinite(value):
            raise UserError(f"--{name} takes a finite number; got {text!r}")
        return value
    raise UserError(f"--{name} is a {getattr(tp, '__qualname__', tp)} setting, which the command line cannot "
                    "write: set it in the recipe's config function")


def compile_backend(device_type: str) -> str:
    """torch.compile's backend for a device: TorchTitan Neuron's `neuron` (its release notes: "eager and
    `--compile.backend neuron`", awsdocs-neuron.readthedocs-hosted.com release-notes/components/torchtitan-neuron),
    torch's inductor elsewhere."""
    return "neuron" if device_type == "neuron" else "inductor"


def activation_checkpoint_config(mode: str):
    """torchtitan's activation checkpointing Config for a mode: None, SelectiveAC's or FullAC's."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "none":
        return None
    return {"selective": SelectiveAC.Config, "full": FullAC.Config}[mode]()


def layout(trainer) -> dict:
    """How the run's ranks split the work (results.json's `layout`): data-parallel (FSDP) shards, replicas and
    tensor-parallel degree, as torchtitan built them, and the activation checkpointing it applied."""
    dims = trainer.parallel_dims
    return {"data_parallel_shard": dims.dp_shard, "data_parallel_replicate": dims.dp_replicate,
            "tensor_parallel": dims.tp, "activation_checkpoint": activation_checkpoint_mode(trainer.config)}


def activation_checkpoint_mode(tc) -> str:
    """The mode a Trainer.Config trains with: none, selective, full (or another policy's class name)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = tc.activation_checkpoint
    if ac is None:
        return "none"
    return {SelectiveAC.Config: "selective", FullAC.Config: "full"}.get(type(ac), type(ac).__qualname__)


class Hooks:
    """Where the harness joins a run (common/harness/lifecycle.py); this base adds nothing: the recipe's trainer
    with its losses recorded (common/trainer.py)."""

    def configure(self, tc, dev, out_dir: Path, found: Inputs) -> list[str]:
        """After the recipe's Trainer.Config, before the build: settings, files; notes for the log."""
        return []

    def build(self, tc, shape: dict):
        """The trainer: the recipe's own trainer class (the one `tc.build()` makes), its metrics recorded."""
        from common.trainer import recorded

        recorded(tc)
        return tc.build()

    def check_process(self, recipe: Recipe):
        """What runs a load or export check (common.export.verify_export_subprocess's `check`): this process, unless
        the trainer patches transformers (then None: a process of its own, `one_shot`)."""
        return None if recipe.patches_transformers else export.in_process

    def history(self, trainer) -> dict:
        """The loss curve results.json and loss.png show: this process's steps."""
        return trainer.metrics_processor.record.history()

    def results(self, trainer, dev, shape: dict, out_dir: Path) -> dict:
        """After training: results entries; a `stopped` entry that is not None means the run stopped early."""
        return {}


def train(recipe: Recipe, cfg, dev: device.DeviceInfo, out_dir: Path, found: Inputs, guards: Hooks) -> dict:
    """Build the recipe's trainer, train, export and check: results.json's entries (rank 0 writes it)."""
    from torchtitan.tools.logging import init_logger

    from common import torchtitan_fixes  # after device.setup(): torchtitan binds its device at import

    init_logger()  # torchtitan's step lines (loss, tokens/s, memory) on rank 0
    torchtitan_fixes.quiet_known_noise()
    log = print if dev.is_main else (lambda *a, **k: None)
    log(f"[config] {cli.format_config(cfg)}")
    export.clear_stale_checkpoints(out_dir, dev.is_main)
    tc, notes = recipe.trainer_config(cfg, dev, out_dir, found)
    notes += guards.configure(tc, dev, out_dir, found)
    notes += set_dotted(tc, cfg.torchtitan)  # the command line's other torchtitan settings, by their own names
    if dev.is_main:  # one writer; out_dir is shared by all ranks (as torchtitan's dump folder is)
        export.stage_hf_assets(Path(tc.hf_assets_path), found.tokenizer_dir, found.hf_folder)
    import torch

    torch.distributed.barrier()
    log(f"[device] {dev.device_type} x{dev.world_size} ({dev.backend}); " + "; ".join(notes))

    shape = recipe.model_shape(cfg, tc, found)
    trainer = guards.build(tc, shape)
    extra = recipe.after_build(cfg, trainer, tc, found, log)
    rec = trainer.metrics_processor.record
    t0 = time.perf_counter()
    rec.start()
    try:
        trainer.train()  # loads the initial HF weights (or resumes), then trains
    except RuntimeError as e:
        if (line := not_finite(e)) is None:
            raise
        raise line from None
    train_s = time.perf_counter() - t0
    history = guards.history(trainer)
    guarded = guards.results(trainer, dev, shape, out_dir)
    extra.update(recipe.after_train(cfg, trainer, found))
    results = {
        "script": recipe.name, "config": cli.flags(cfg), "versions": versions(), "device": dev.device_type,
        "attention": torchtitan_fixes.attention_path(trainer.config.model_spec.model, dev.device_type),
        "world_size": dev.world_size, "layout": layout(trainer), "steps": rec.steps,
        "resumed_from_step": (rec.steps[0] - 1) if rec.steps else None,
        "losses": rec.losses, "first_step_loss": rec.losses[0] if rec.losses else None, "grad_norms": rec.grad_norms,
        "tokens_per_s": rec.tokens_per_s(), "history": history, "train_seconds": train_s, **extra,
        "export_dir": None, "export_check": None, **guarded,
    }
    stopped = guarded.get("stopped")
    if cfg.export and not stopped:
        hf_cfg = recipe.export_config(cfg, tc, found, dtype=tc.checkpoint.export_dtype)
        results.update(export.export_and_check(
            trainer, out_dir=out_dir, steps=cfg.steps, hf_cfg=hf_cfg, tokenizer_dir=found.tokenizer_dir,
            tied_expected=bool(hf_cfg.get("tie_word_embeddings", False)), tol=cfg.export_tolerance,
            is_main=dev.is_main, pass_positions=recipe.pass_positions, check_process=guards.check_process(recipe)))
    else:
        trainer.close()
    path = finish_run(results, history, out_dir=out_dir, title=f"{Path(recipe.name).stem} ({cfg.preset})",
                      is_main=dev.is_main)
    if dev.is_main and not stopped:
        log(f"[done] losses {rec.losses[0]:.3f} -> {rec.losses[-1]:.3f}; {results['tokens_per_s']:.0f} tokens/s; "
            f"{path}")
    return results


CORE_ONLY = ("[guards] off: common/harness/ was not copied with common/, so this run has no preflight, load check, "
             "resume (it never resumes: a folder holding a checkpoint is refused; so is one another run is "
             "writing), stop signals, "
             "self-launch, dry run, pilot report or held-out eval, and their flags are not taken: it trains, exports "
             "and checks the export")
GUARDED_RECORD = "run.json"  # in OUT_DIR/checkpoint: a guarded run's record (common/harness/resume.py)


def run_core(recipe: Recipe, argv: list[str] | None = None) -> int:
    """Train and export with the core alone: the inputs checked, one process per rank (python or torchrun). It
    never resumes (no run record says whether a checkpoint is this run's): a folder holding one is refused."""

    def main(cfg) -> dict:
        out_dir = cli.check_out_dir(cfg.out_dir).resolve()
        if os.environ.get("RANK", "0") == "0":
            print(CORE_ONLY, flush=True)
        never_resume(out_dir)
        export.check_replaceable(out_dir)
        found = inputs(recipe, cfg)
        dev = device.setup(cfg.device, lnc=cfg.lnc, neff_cache_dir=device.neff_cache_dir(cfg.neff_cache_dir, out_dir),
                           timeout_s=cfg.comm_timeout_s)
        try:
            check_layout(found.shape, tp=cfg.tensor_parallel_degree, seq_len=cfg.seq_len, world_size=dev.world_size,
                         global_batch=cfg.global_batch_size, local_batch=cfg.local_batch_size,
                         seq_divisor=recipe.seq_divisor)
            hold_core_lock(out_dir, dev)
            return train(recipe, cfg, dev, out_dir, found, Hooks())
        finally:
            device.teardown()

    return cli.run_cli(main, recipe.config, recipe.presets, f"{CORE_ONLY}\n\n{recipe.doc}", recipe.default_preset,
                       argv, unknown_hint="this copy has the core alone: the guards' flags need common/harness/")


def hold_core_lock(out_dir: Path, dev: device.DeviceInfo) -> None:
    """Two runs into one out_dir would write one checkpoint folder and one export at once (a torchtitan traceback, or
    a mix of both runs): rank 0 takes the out_dir's lock (common.results.hold_lock, the one a guarded run takes
    too) for the run, every rank learns whether it got it (one all-reduce), and a second run is one UserError naming
    the first on every rank."""
    from common.results import hold_lock

    problem = ""
    if dev.rank == 0:
        try:
            hold_lock(out_dir)
        except UserError as e:
            problem = str(e)
    if device.agree_max([1 if problem else 0], dev.device)[0]:
        raise UserError(problem or f"--out_dir {out_dir}: refused on rank 0 (its lock): wait for the other run to end, "
                        "or choose another --out_dir")


def never_resume(out_dir: Path) -> None:
    """The core alone starts every run at step 1: an out_dir holding a checkpoint (which torchtitan would load,
    whatever run wrote it) or a guarded run's lock is one UserError."""
    if (out_dir / "checkpoint" / GUARDED_RECORD).exists() or (out_dir / "checkpoint" / GUARDED_RECORD).is_symlink():
        raise UserError(f"--out_dir {out_dir} is a guarded run's folder (it holds checkpoint/{GUARDED_RECORD}, its "
                        "run record): choose another --out_dir for a run of the core alone")
    checkpoints = out_dir / "checkpoint"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise UserError(f"--out_dir {out_dir} holds checkpoints ({checkpoints}): the core alone never resumes, having "
                        "no run record to tell whether they are this run's; choose another --out_dir, or copy "
                        "common/harness/ too to resume")
