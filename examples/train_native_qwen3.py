# Copy with this file (all it imports from the repository):
#   common/__init__.py common/errors.py common/cli.py common/results.py common/device.py common/paths.py
#   common/losses.py common/launcher.py common/resume.py common/checkpoint.py common/export.py
#   common/torchtitan_fixes.py common/dryrun.py common/preflight.py
#   common/evaluation.py common/pilot.py
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
    torchrun --nproc_per_node 64 examples/train_native_qwen3.py --preset qwen3_4b \
        --dataset_path /path/to/torchtitan/tests/assets/c4_test
Several nodes: the same command on each, with --nnodes N --node_rank R --master_addr NODE0 (or torchrun's own)

Start from an HF checkpoint (any dense Qwen3; the model shape comes from its config.json):
    python examples/train_native_qwen3.py --hf_checkpoint runs/native/hf_export --out_dir runs/ft

Expected (tiny, 10 steps, 2-core CPU): loss falls from about 11.95 to about 11.2, a second or two a step;
results.json has `losses`, `tokens_per_s`, `export_dir` and `export_check` with no missing or
unexpected keys and max_abs_logit_diff below 1e-5; loss.png plots the losses.
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
from common.results import check_outputs, versions  # noqa: E402


@dataclass
class Config:
    preset: str = "tiny"
    flavor: str = field(default="tiny", metadata={"help": "torchtitan Qwen3 flavor (0.6B, 4B, 32B, ...) or 'tiny'"})
    steps: int = field(default=10, metadata={"help": "training steps", **cli.bounds(1, 10**7)})
    out_dir: str = field(default="runs/native_qwen3", metadata={"help": "results.json, loss.png, hf_export/ go here"})
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
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata={"help": "parameter dtype in compute (FSDP mixed precision)"})
    attn_backend: Literal["sdpa", "flex"] = field(default="sdpa", metadata={
        "help": "sdpa: document-masked SDPA (CPU, Trainium, CUDA); flex: torchtitan's default, CUDA only"})
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
    hf_assets: str | None = field(
        default=None, metadata={"help": "HF folder with the tokenizer (default: the Qwen3 tokenizer from set-up)"})
    hf_checkpoint: str | None = field(default=None, metadata={
        "help": "initial weights: an HF Qwen3 folder (config.json + safetensors); sets the model shape"})
    load_check: bool = field(default=True, metadata={
        "help": "with --hf_checkpoint: compare the built model with transformers' load of it before step 1"})
    checkpoint_every: int = field(default=0, metadata={
        "help": "save a resumable checkpoint every N steps in OUT_DIR/checkpoint (0: only when stopped); the same "
                "command resumes from the latest", **cli.bounds(0, 10**7)})
    time_limit: str | None = field(default=None, metadata={
        "help": "stop before this budget ends, with a checkpoint (exit 75; the same command resumes): minutes (90) "
                "or an end time with its zone (2026-12-02T18:00:00Z: a capacity block's end)"})
    stop_margin_s: float = field(default=120.0, metadata={
        "help": "with --time_limit: seconds kept for the stop save until a save is measured (then the longest "
                "save is kept, plus a step)", **cli.bounds(0.0, 86400.0)})
    export: bool = field(default=True, metadata={
        "help": "write HF safetensors + config + tokenizer to OUT_DIR/hf_export and verify them"})
    export_tolerance: float | None = field(default=None, metadata={
        "help": "max abs logits difference the export check accepts (none: 1e-5 for float32, 5e-2 for bfloat16)",
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
    compare_losses: str | None = field(default=None, metadata={
        "help": "reference losses (a results.json or tests/assets/golden_losses/*.json): per-step differences go "
                "to results.json; a difference over --loss_tolerance is a non-zero exit"})
    loss_tolerance: float = field(default=1e-3, metadata={
        "help": "largest per-step loss difference --compare_losses calls a match",
        **cli.bounds(above=0.0, high=1000.0)})
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

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if self.export_tolerance is None:
            self.export_tolerance = EXPORT_TOLERANCE[self.dtype]


EXPORT_TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2}  # exported float32 / bfloat16 weights, re-read


def tiny() -> Config:
    """CPU default: 2-layer Qwen3, real vocabulary, offline English, float32."""
    return Config()


def qwen3_4b() -> Config:
    """trn2.48xlarge as in the AWS guide: Qwen3-4B spec on the qwen3_32b builder, 64 ranks, global batch 64, c4_test."""
    return replace(Config(), flavor="4B", device="neuron", dtype="bfloat16", local_batch_size=1,
                   global_batch_size=64, seq_len=4096, lr=8e-4, warmup_steps=2,
                   dataset="c4_test", hf_assets="assets/hf/Qwen3-4B-Instruct-2507")


PRESETS = {"tiny": tiny, "qwen3_4b": qwen3_4b}
HF_MODEL_ID = {"qwen3_4b": "Qwen/Qwen3-4B-Instruct-2507"}  # what to download into hf_assets on trn2
PUBLISHED_PARAMS = {"4B": 4.0e9}  # Qwen3-4B model card: 4.0 B parameters


def preflight(cfg: Config) -> dict:
    """Check every input before any process is launched or any model exists, so bad input fails fast."""
    if wants_neuron(cfg.device):  # the installed Neuron stack is the one these calls need: seconds, not an hour
        require_stack("trn2", "native")
    device_type = device.resolve_device_type(cfg.device)
    if cfg.attn_backend == "flex" and device_type != "cuda":
        raise UserError(f"--attn_backend flex needs CUDA (FlexAttention has no {device_type} backward); use sdpa")
    found = {"dataset": paths.training_dataset(cfg.dataset, cfg.dataset_path)}
    if cfg.eval_every:  # held-out data that exists (and a Hub that can be reached when it must stream c4)
        eval_dataset(found["dataset"])
    if cfg.compare_losses:
        read_reference_losses(cfg.compare_losses)  # a bad reference fails before training
    hint = f" (download {HF_MODEL_ID[cfg.preset]} there first)" if cfg.preset in HF_MODEL_ID else ""
    found["tokenizer_dir"] = checkpoint.check_tokenizer(cfg.hf_assets or paths.asset_dir("tokenizer"), hint)
    if cfg.hf_checkpoint:
        found["hf_config"] = checkpoint.validate_hf_checkpoint(cfg.hf_checkpoint, checkpoint.QWEN3_DENSE)
    tiny = cfg.flavor == "tiny" and not cfg.hf_checkpoint
    shape = found.get("hf_config") or (checkpoint.read_hf_config(paths.asset_dir("tiny_qwen3")) if tiny else {})
    if cfg.seq_len > shape.get("max_position_embeddings", cfg.seq_len):
        raise UserError(f"--seq_len {cfg.seq_len} is more than the model's "
                        f"{shape['max_position_embeddings']} positions")
    if shape:  # a torchtitan flavor has no config.json here: --dry_run sizes it
        dryrun.check_fits(shape, local_batch=cfg.local_batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype,
                          world_size=launcher.planned_world_size(cfg), device_type=device_type,
                          per_core_gib=cfg.per_core_gib)
    return found


def build_trainer_config(cfg: Config, dev: device.DeviceInfo, out_dir: Path, found: dict):
    """The AWS guide's recipe: torchtitan's qwen3_32b builder, then the model spec swapped."""
    # torchtitan imports stay inside functions: device.setup() must run before torchtitan loads.
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_32b
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from common import torchtitan_fixes

    tc = qwen3_32b()
    if cfg.hf_checkpoint:  # the shape comes from the checkpoint's config.json
        tc.model_spec = checkpoint.qwen3_spec_from_hf(found["hf_config"], where=cfg.hf_checkpoint)
    elif cfg.flavor == "tiny":
        # the shape of the tiny Qwen3 prepared at set-up (its weights are not loaded: torchtitan's init)
        tiny_dir = paths.asset_dir("tiny_qwen3")
        tc.model_spec = checkpoint.qwen3_spec_from_hf(checkpoint.read_hf_config(tiny_dir), where=tiny_dir)
    else:
        try:
            tc.model_spec = model_registry(cfg.flavor)
        except KeyError:
            raise UserError(f"unknown Qwen3 flavor {cfg.flavor!r}") from None
    tc.loss.loss_fn.global_vocab_size = decoder_vocab_size(tc.model_spec)

    ckpt = Path(cfg.hf_checkpoint).resolve() if cfg.hf_checkpoint else None
    tc.hf_assets_path = str(out_dir / "hf_assets")  # staged by train(): tokenizer (+ checkpoint config)
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

    # Mid-run saves: torchtitan's distributed checkpoints (resumed by the same command); the last
    # save is the HF export.
    export.apply_checkpoint_settings(tc, steps=cfg.steps, every=cfg.checkpoint_every, export=cfg.export,
                                    initial_hf=ckpt, dtype=cfg.dtype)

    notes = torchtitan_fixes.apply_trainer_settings(tc, dev, seed=cfg.seed)  # CUDA graphs, gloo, seed, logging
    if note := apply_eval_settings(tc, cfg.eval_every, cfg.eval_steps, found.get("dataset")):  # the validator
        notes.append(note)
    changed = torchtitan_fixes.use_attention_backend(tc.model_spec.model, cfg.attn_backend)
    if changed:
        notes.append(f"attention -> SDPA with document masking in {len(changed)} layers")
    return tc, notes


def dry_run(cfg: Config, out_dir: Path, ranks: int | None = None) -> dict:
    """Size the preset at --dry_run_ranks ranks on this machine (common/dryrun.py); no training. With `ranks`:
    the plan alone for that many (a training run's planned memory), nothing written."""
    import torch

    device.route_torchtitan_device("cpu")  # the model lives on the meta device; nothing runs
    found = {"hf_config": checkpoint.validate_hf_checkpoint(cfg.hf_checkpoint, checkpoint.QWEN3_DENSE)} \
        if cfg.hf_checkpoint else {}
    target = device.DeviceInfo(torch.device("meta"), cfg.device, "fake", 0, 0, ranks or cfg.dry_run_ranks)
    tc, _notes = build_trainer_config(cfg, target, out_dir, found)
    shape = checkpoint.hf_config_from_qwen3(tc.model_spec.model)
    r = dryrun.dry_run(tc, shape=shape, world_size=ranks or cfg.dry_run_ranks, per_core_gib=cfg.per_core_gib,
                       published_params=None if cfg.hf_checkpoint else PUBLISHED_PARAMS.get(cfg.flavor),
                       label=f"{cfg.preset} (Qwen3 {cfg.flavor})")
    if ranks:
        return r
    return dryrun.finish(r, out_dir=out_dir, per_core_gib=cfg.per_core_gib, results={
        "script": "train_native_qwen3.py", "config": cfg,
        "projection": dryrun.project(cfg, tc, shape, cfg.dry_run_ranks)})


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir, inputs={
        "--hf_checkpoint": cfg.hf_checkpoint, "--hf_assets": cfg.hf_assets, "--compare_losses": cfg.compare_losses,
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
    found["record"] = resume.run_record("train_native_qwen3.py", cfg, world_size=world_size, dataset=found["dataset"])
    resume.check_resume(out_dir, found["record"], cfg.steps)  # the same run, with steps left, or refused
    if launch:
        raise SystemExit(launcher.self_launch(cfg, sys.argv, out_dir, end))
    stop = resume.StopControl(end=end, margin_s=cfg.stop_margin_s, is_main=launcher.is_rank_zero())
    stop.install()  # from here a stop signal ends the run at a step boundary, with a checkpoint
    if launcher.is_rank_zero():  # the checks' verifier; the dry run's memory for this very configuration
        dev_type = device.resolve_device_type(cfg.device)
        export.start_verifier(dev_type, wanted=cfg.export or bool(cfg.hf_checkpoint and cfg.load_check))
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

    init_logger()  # torchtitan's step lines (loss, tokens/s, memory) on rank 0

    log = print if dev.is_main else (lambda *a, **k: None)
    log(f"[config] {cli.format_config(cfg)}")
    export.clear_stale_checkpoints(out_dir, dev.is_main)
    tc, notes = build_trainer_config(cfg, dev, out_dir, found)
    tokenizer_dir = found["tokenizer_dir"]
    if dev.is_main:  # one writer; out_dir is shared by all ranks (as torchtitan's dump folder is)
        resume.write_record(out_dir, found["record"])
        export.stage_hf_assets(Path(tc.hf_assets_path), tokenizer_dir,
                                   Path(cfg.hf_checkpoint).resolve() if cfg.hf_checkpoint else None)
    torch.distributed.barrier()
    log(f"[device] {dev.device_type} x{dev.world_size} ({dev.backend}); " + "; ".join(notes))

    gc.freeze()  # what the imports made stays for good: torchtitan's first collection looks only at the run's objects
    trainer = tc.build()
    load_check = None  # trainer.train() loads --hf_checkpoint (or resumes); checked before step 1
    if cfg.hf_checkpoint and cfg.load_check:
        built = checkpoint.hf_config_from_qwen3(tc.model_spec.model)  # the settings torchtitan's model uses
        load_check = export.attach_load_check(trainer, cfg.hf_checkpoint, tokenizer_dir, dtype=cfg.dtype,
                                              is_main=dev.is_main, built_config=built)
    rec = LossRecorder(progress=out_dir / "losses.jsonl" if dev.is_main else None)
    rec.attach(trainer)
    evals = EvalRecorder().attach(trainer)  # the validator's held-out losses (--eval_every)
    stop.attach(trainer, dev.device, export=cfg.export)
    shape = checkpoint.hf_config_from_qwen3(tc.model_spec.model)
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

    results = {
        "script": "train_native_qwen3.py", "config": cfg, "versions": versions(),
        "device": dev.device_type, "world_size": dev.world_size,
        "steps": rec.steps, "resumed_from_step": (rec.steps[0] - 1) if rec.steps else None,
        "losses": rec.losses, "grad_norms": rec.grad_norms, "tokens_per_s": rec.tokens_per_s(),
        "history": history, "eval_losses": evals.rows(), "load_check": load_check or None,
        "train_seconds": train_s, "export_dir": None, "export_check": None, "stopped": stopped, **report,
    }
    if cfg.export and not stopped:
        hf_cfg = checkpoint.hf_config_from_qwen3(tc.model_spec.model, dtype=tc.checkpoint.export_dtype)
        results.update(export.export_and_check(trainer, out_dir=out_dir, steps=cfg.steps, hf_cfg=hf_cfg,
                                              tokenizer_dir=tokenizer_dir, tied_expected=hf_cfg["tie_word_embeddings"],
                                              tol=cfg.export_tolerance, is_main=dev.is_main))
    else:
        trainer.close()
    path = finish_run(results, history, compare_with=cfg.compare_losses, tolerance=cfg.loss_tolerance,
                          out_dir=out_dir, title=f"train_native_qwen3 ({cfg.preset})", is_main=dev.is_main)
    if dev.is_main and stopped:
        log(resume.resume_line(stopped))
    elif dev.is_main:
        log(f"[done] losses {rec.losses[0]:.3f} -> {rec.losses[-1]:.3f}; "
            f"{results['tokens_per_s']:.0f} tokens/s; {path}")
    return results


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="tiny"))
