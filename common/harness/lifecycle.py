"""A training recipe's whole run with the guards (common/recipe.py has the core's run without them), in three
phases (`main`):

- `check`: the out_dir held (its lock), the batch split, the outputs, this host, every input, the resume record;
- launch: with --nproc_per_node or --nnodes, the same command again as torchrun's workers (common/harness/launcher.py);
- `train_guarded`, on each rank: stop signals and --time_limit caught, the recipe's trainer built with the guards
  (GuardHooks: common/harness/trainer.py's GuardedTrainer and its components), trained, exported and checked;
  results.json with the pilot report; exit 75 after a stop.

`Guards` holds the flags of all of it once; each example's Config includes it.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import cli, device, export
from common.errors import UserError, one_line
from common.harness import compile_cache, dryrun, interval, launcher, pilot, reshard, resume, stops, verifier
from common.harness.checks import explain_failure, check_outputs, check_settings, compare_losses, \
    format_loss_comparison, load_tolerance, logit_check, read_reference_losses, whole_history
from common.harness.evaluation import EVAL_LOSSES, apply_eval_settings, check_eval_flags, eval_dataset, eval_rows
from common.harness.phases import Phases, format_line as phases_line
from common.harness.preflight import installed_lists, require_stack, wants_neuron
from common.processes import die_with_parent
from common.recipe import Hooks, Inputs, Recipe, check_layout, inputs, set_dotted, train


@dataclass
class Guards:
    """The guards' settings, the same for every training recipe: the `guards` section of its Config (each field a flag
    of the command line, as the recipe's own)."""

    def validate(self) -> None:
        every = self.checkpoint_every
        if every != "auto" and not (every.isdigit() and int(every) <= 10**7):
            raise UserError(f"--checkpoint_every takes a number of steps (0 to 10000000) or auto, got {every!r}")
        # --storage_gb_per_s alone is used too (the stop-notice verdict before a save is measured, the dry run's);
        # the interruption interval sets the auto interval and nothing else: given without it, it would be ignored
        if every != "auto" and self.mean_hours_between_interruptions is not None:
            raise UserError("--mean_hours_between_interruptions sets the --checkpoint_every auto interval and nothing "
                            f"else: add --checkpoint_every auto (it is {every!r}) or leave it out")
    eval_every: int = field(default=0, metadata={
        "help": "held-out loss (torchtitan's validator) at step 1 and every N steps (0: off), on local data training "
                "never reads: the corpus's validation.jsonl, a folder's validation split, else your own data's "
                "held-out share (every 100th document, never trained on); c4_test needs --eval_dataset_path",
        **cli.bounds(0, 10**7)})
    eval_steps: int = field(default=4, metadata={
        "help": "with --eval_every: batches of held-out data per evaluation (--local_batch_size sequences a rank)",
        **cli.bounds(1, 10**5)})
    eval_dataset_path: str | None = field(default=None, metadata={
        "help": "with --eval_every: a local folder of held-out JSON lines (its validation*.jsonl files), read instead "
                "of the training data's own held-out data; needed for c4_test, whose folder has none (nothing is "
                "streamed from the Hub)"})
    disk_check: bool = field(default=True, metadata={
        "help": "before the launch, check that OUT_DIR's filesystem has room for the checkpoints kept and the "
                "export; --no-disk_check for storage whose free space the OS does not report (some network and "
                "object-store mounts)"})
    checkpoint_every: str = field(default="0", metadata={
        "help": "save a resumable checkpoint every N steps in OUT_DIR/checkpoint (0: only when stopped); the same "
                "command resumes from the latest. auto: the interval that loses the least expected work, from the "
                "measured save and step times and --mean_hours_between_interruptions (Young's sqrt(2 x save x MTBI); "
                "before the first save, the checkpoint's size over --storage_gb_per_s, else over OUT_DIR's write "
                "bandwidth measured before step 1), printed when it first is known and when it moves by more than "
                "a fifth, and in results.json",
        "metavar": "N|auto"})
    mean_hours_between_interruptions: float | None = field(default=None, metadata={
        "help": "with --checkpoint_every auto: how often, on average, this kind of box is taken away or fails, in "
                "hours. Default: 3000 h a host, over the run's hosts (about half the 6,300 host-hours between the "
                "unexpected interruptions of Llama 3's pre-training, Dubey et al. 2024, section 3.3.4: hardware "
                "and software failures, not reclaims; AWS publishes no figure for on-demand, only frequency bands "
                "for spot: spot users, give your own)", **cli.bounds(above=0.0, high=1e6)})
    storage_gb_per_s: float | None = field(default=None, metadata={
        "help": "OUT_DIR's write bandwidth, GB/s, all ranks together: the planned save time (checkpoint size over "
                "it) for --checkpoint_every auto before a save is measured (without it: one process's write of "
                "32 MiB to OUT_DIR, measured before step 1), the stop-notice verdict before one, and --dry_run's",
        # 1e-6 GB/s is 1 kB/s, slower than any storage a checkpoint is written to; below it a planned save's
        # seconds only grow toward an overflow (1e-300 was an OverflowError at step 1)
        **cli.bounds(1e-6, 1e5, why="GB/s of real storage: 1e-6 is 1 kB/s")})
    stop_notice_s: float = field(default=120.0, metadata={
        "help": "the warning a stop comes with (EC2 spot: 120 s; SLURM: its --signal's lead): the run says whether a "
                "stop (the rest of a step or held-out batch, then the save) fits it, as soon as a save is measured. "
                "--stop_margin_s is the same room kept before --time_limit", **cli.bounds(above=0.0, high=1e6)})
    async_checkpoint: bool = field(default=False, metadata={
        "help": "write periodic saves in the background (torchtitan's checkpoint.async_mode 'async': a thread of each "
                "rank writes while training goes on; the training waits for the state's copy only, and a save waits "
                "for the write before it). The auto interval uses the wait, the stop-notice verdict the whole write; "
                "a stop's save and the last step's are written whole before the run ends. Costs a copy of the "
                "checkpointed state in host memory while it is written"})
    keep_checkpoints: int = field(default=2, metadata={
        "help": "resumable checkpoints kept in OUT_DIR/checkpoint, the newest (torchtitan's keep_latest_k; 0: all). "
                "Each holds the float32 weights and AdamW state, 12 bytes a parameter (a 4B model: 48 GB): the "
                "free space for this many and the export is checked before the launch",
        **cli.bounds(2, 10**6, also=(0,), why="torchtitan keeps at least 2: the newest may still be being written")})
    time_limit: str = field(default=None, metadata={  # `str`, not optional: "" and "none" are refused, not "no limit"
        "help": "stop before this budget ends, with a checkpoint (exit 75; the same command resumes): minutes (90) "
                "or an end time with its zone (2026-12-02T18:00:00Z: a capacity block's end)"})
    stop_margin_s: float = field(default=120.0, metadata={
        "help": "with --time_limit: seconds kept for the stop save until a save is measured (then the longest "
                "save is kept, plus a step)", **cli.bounds(0.0, 86400.0)})
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
    rendezvous_wait_s: float = field(default=600.0, metadata={
        "help": "with --nnodes, on a node other than 0: how long to wait for node 0's --master_addr:--master_port "
                "to accept connections before the launch (saying so), then one error line",
        **cli.bounds(1.0, 86400.0)})
    check_efa: bool = field(default=False, metadata={
        "help": "with --nnodes: require EFA (`fi_info -p efa` lists an endpoint) and set AWS's EFA variables for the "
                "workers where unset; always done for --device neuron"})
    oversubscribe: bool = field(default=False, metadata={
        "help": "let --nproc_per_node exceed this host's cores or free memory"})
    reshard: bool = field(default=False, metadata={
        "help": "resume a stopped run on another number of ranks (--nproc_per_node, --nnodes or torchrun's), "
                "tensor-parallel degree or activation checkpointing: DCP reshards the weights and optimizer state, "
                "the data keeps its shards and positions, the global batch stays (docs/resuming.md)"})
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
        "help": "peak TFLOPS of one device for MFU (default: trn2's 79 per NeuronCore x --lnc, torchtitan's table on "
                "CUDA, a matmul measured in this process on CPU)",
        # 1e-3 TFLOPS (1 GFLOP/s): about one core of a decades-old CPU, below any device that trains a model; a
        # smaller peak only turns every MFU into an absurd number (1e-300 printed one of 298 digits)
        **cli.bounds(pilot.PEAK_TFLOPS_LOW, 1e5, why="TFLOPS of a real device: 1e-3 is 1 GFLOP/s")})
    price_per_hour: float | None = field(default=None, metadata={
        "help": "what this run's hardware costs per hour (all nodes): results.json gets the run's cost and the cost "
                "per million tokens; with --dry_run and --assumed_mfu, the full run's", **cli.bounds(0.0, 1e6)})
    assumed_mfu: float | None = field(default=None, metadata={
        "help": "with --dry_run: project the full run's time (and cost) at this MFU (a fraction, 0.3) of the peak",
        **cli.bounds(above=0.0, high=1.0)})
    profile: bool = field(default=False, metadata={
        "help": "trace steps with torchtitan's profiler (torch.profiler; the Neuron activity too on trn2) into "
                "OUT_DIR/profile_traces/iteration_N/rankR_trace.json.gz, Chrome trace format; which steps: "
                "--profile_freq. The run's memory is then not compared with the plan (the profiler's buffers)"})
    profile_device: bool = field(default=False, metadata={
        "help": "with --profile on trn2: the Neuron device's instruction-level traces too (Neuron's ProfileMode.DEVICE, "
                ".ntff files; reserves about 5 GB of device memory per core); without it the Neuron runtime's "
                "system trace only. Both go to OUT_DIR/profile_traces/neuron/node<N>"})
    profile_freq: int = field(default=0, metadata={
        "help": "with --profile: trace step N and its multiples, as torchtitan's profiler.profile_freq (the steps "
                "just before each, 1 to 3, are the profiler's warm-up, so at least 2); 0: the last step (--steps)",
        **cli.bounds(0, 10**7)})
    compile_cache: str | None = field(default=None, metadata={
        "help": "a compile cache shared across hosts: a folder on shared storage (FSx, EFS), file:// or an fsspec URL "
                "(s3://bucket/prefix with s3fs installed). Before step 1 one process a node pulls the graphs this "
                "compiler made into the local cache (the NEFF cache on Trainium, inductor's with --compile), under a "
                "key of the compiler's versions; after step 2 and at the end it pushes the new ones "
                "(docs/compile.md); results.json: compile_cache_shared", "metavar": "URL"})
    tensorboard: bool = field(default=False, metadata={
        "help": "torchtitan's TensorBoard logging into OUT_DIR/tb (loss, grad norm, memory, throughput, MFU)"})
    dry_run_ranks: int = field(
        default=64, metadata={"help": "world size the dry run plans for (64: one trn2.48xlarge at LNC=2)",
                              **cli.bounds(1, 100_000)})
    per_core_gib: float = field(
        default=24.0, metadata={"help": "memory of one core for the dry run (24 GiB: an LNC=2 Trainium2 core)",
                                **cli.bounds(above=0.0, high=4096.0)})


SECTIONS = {"guards": Guards}  # the recipe's Config's `guards` section, its flags the command line's too


def parse(recipe: Recipe, argv: list[str] | None = None):
    """The recipe's Config from a command line, its `guards` section filled in (the flags of both)."""
    return cli.parse_config(recipe.config, recipe.presets, argv, recipe.doc, recipe.default_preset,
                            sections=SECTIONS)


def run(recipe: Recipe, argv: list[str] | None = None, hooks: type | None = None) -> int:
    """The example's one call: parse its flags and the guards', run it with the guards; the exit code. `hooks`: a
    GuardHooks subclass (a test's, with slowed components), GuardHooks itself by default. Under torchrun, an exception
    no check turned into an `error:` line is also written to the rank's error file, which torchrun's failure summary
    shows (torch.distributed.elastic's `record`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(cli.run_cli)(lambda cfg: main(recipe, cfg, hooks or GuardHooks), recipe.config, recipe.presets,
                               recipe.doc, recipe.default_preset, argv, explain=explain_failure, sections=SECTIONS)


def preflight(recipe: Recipe, cfg, host_checked: bool = False) -> Inputs:
    """Check every input before any process is launched or any model exists, so bad input fails fast. With
    `host_checked` (a worker of the scripts' own launch, whose launcher ran these checks on this host just before),
    only what the worker needs: its inputs."""
    if wants_neuron(cfg.device) and not host_checked:  # the installed Neuron stack is the one these calls need
        options = recipe.stack_options(cfg) if recipe.stack_options else {}
        require_stack("trn2", recipe.stack, **options)
    found = inputs(recipe, cfg)
    check_layout(found.shape, tp=cfg.tensor_parallel_degree, seq_len=cfg.seq_len,
                 world_size=launcher.planned_world_size(cfg), global_batch=cfg.global_batch_size,
                 local_batch=cfg.local_batch_size, seq_divisor=recipe.seq_divisor)
    if host_checked:  # the held-out data, the disk and the memory: checked by this host's launcher
        return found
    if cfg.guards.eval_every:  # held-out data that exists (and a Hub that can be reached when it must stream c4)
        eval_dataset(found.dataset, cfg.guards.eval_dataset_path, read=True)
    parameters = dryrun.parameter_estimate(found.shape) if found.shape else published_parameters(recipe, cfg)
    if parameters and cfg.guards.disk_check:  # room for the checkpoints kept and the export, before the launch
        out_dir = Path(cfg.out_dir).resolve()
        dryrun.check_disk(out_dir, dryrun.checkpoint_plan(int(parameters), cfg, shape=found.shape,
                                                          have=len(resume.whole_checkpoints(out_dir))))
    if found.shape:  # a torchtitan flavor has no config.json here: --dry_run sizes it
        dryrun.check_fits(found.shape, local_batch=cfg.local_batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype,
                          world_size=launcher.planned_world_size(cfg),
                          device_type=device.resolve_device_type(cfg.device), per_core_gib=cfg.guards.per_core_gib,
                          tp=cfg.tensor_parallel_degree)
    return found


def published_parameters(recipe: Recipe, cfg) -> float | None:
    """The published parameter count of a preset whose shape has no config.json here (a torchtitan flavor: its
    model card's figure, `describe`), for the disk check; None where there is none."""
    try:
        return recipe.describe(cfg, {})[1] if recipe.describe else None
    except (KeyError, TypeError):
        return None


def _dataset_folder(dataset: str, dataset_path: str | None) -> str | None:
    """The folder `--dataset`/`--dataset_path` name, unchecked (None for 'corpus', which is in the asset cache), as
    common.paths.training_dataset reads it."""
    if dataset == "corpus":
        return None
    return (dataset_path if dataset == "c4_test" else dataset) or "tests/assets/c4_test"


@dataclass
class Checked:
    """What the checks before a launch found: the run's folder, its inputs, its record, where it must end."""
    out_dir: Path
    found: Inputs
    record: dict  # the run record a resume must match (common/harness/resume.py)
    world_size: int
    end: float | None  # --time_limit as a time
    launch: bool  # the scripts' own launch starts torchrun with this command
    phases: Phases | None = None  # the time to step 1, marked as it goes (common/harness/phases.py)
    resumed: int | None = None  # the step this run resumes from (None: it starts at step 1)
    reference: verifier.ReferenceLogits | None = None  # the load check's reference, being computed (rank 0)


def main(recipe: Recipe, cfg, hooks: type | None = None) -> dict:
    """The guarded run: the out_dir held, then a dry run, or check -> launch -> train."""
    phases = Phases()
    phases.mark("imports")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker never outlives torchrun, however torchrun ends
        die_with_parent(parent_pid=os.getppid())()
    # flags alone: refused before the out_dir exists
    pilot.check_profile(cfg.guards.profile, cfg.guards.profile_freq, cfg.steps, cfg.guards.profile_device)
    check_eval_flags(cfg.guards.eval_every, cfg.guards.eval_dataset_path)
    if cfg.guards.compare_losses:
        read_reference_losses(cfg.guards.compare_losses)  # a bad reference (a FIFO too) fails before the out_dir exists
    out_dir = hold(cfg)
    if cfg.guards.dry_run:
        return dry_run(recipe, cfg, out_dir)
    checked = check(recipe, cfg, out_dir)  # every input, before a launch: one error line, not one per rank
    checked.phases = phases
    phases.mark("checks")
    if checked.launch:
        raise SystemExit(launcher.self_launch(cfg, sys.argv, out_dir, checked.end, record=checked.record))
    return train_guarded(recipe, cfg, checked, hooks or GuardHooks)


def hold(cfg) -> Path:
    """The out_dir, checked against the inputs (none inside another) and held for this run (its lock)."""
    out_dir = cli.check_out_dir(cfg.out_dir, inputs={
        "--hf_checkpoint": getattr(cfg, "hf_checkpoint", None), "--hf_assets": getattr(cfg, "hf_assets", None),
        "--compare_losses": cfg.guards.compare_losses, "--dataset": _dataset_folder(cfg.dataset, cfg.dataset_path),
        "--eval_dataset_path": cfg.guards.eval_dataset_path},
    ).resolve()
    launcher.hold_out_dir(out_dir, cfg.guards.node_rank)
    return out_dir


def check(recipe: Recipe, cfg, out_dir: Path) -> Checked:
    """The checks before a launch: batch split, the outputs, this host, the inputs, the resume
    record. Each failure is one UserError."""
    world_size = launcher.planned_world_size(cfg)  # the layout is checked with the model's shape (preflight)
    export.check_replaceable(out_dir)
    check_outputs(out_dir, folders=("tb",) if cfg.guards.tensorboard else ())  # each file the run writes is absent or a
    # regular file, each folder absent or a folder: refused now, not after training
    reshard.check_debug_folder()
    reshard.check_segments(out_dir)
    launch = launcher.launches(cfg)
    launcher.check_nproc(cfg)
    if launch and cfg.guards.nnodes > 1:  # EFA and node 0's endpoint, from this host, before torchrun waits on them
        launcher.check_nodes(cfg)  # before the inputs' sizing, which shares this host's memory among the processes
    end = stops.deadline(cfg.guards.time_limit)
    launched = launcher.launched_record()  # a worker of the scripts' own launch: its launcher checked this host
    found = preflight(recipe, cfg, host_checked=launched is not None)
    if cfg.guards.compile_cache:  # a store this host cannot reach: one line now, not a worker's at the build
        compile_cache.SharedCache(cfg.guards.compile_cache, compile_cache.cache_key(device.resolve_device_type(
            cfg.device)), out_dir / "neff_cache").reachable()
    if launch and cfg.torchtitan:  # a bad dotted setting: one line here, not one a worker in torchrun's table
        check_dotted(recipe, cfg, out_dir, found)
    record = launched or resume.run_record(recipe.name, cfg, world_size=world_size, dataset=found.dataset)
    resumed = resume.check_resume(out_dir, record, cfg.steps, reshard=cfg.guards.reshard)  # the same run, steps left
    if launcher.is_rank_zero() and cfg.guards.node_rank == 0:
        say_replaced(out_dir, resumed)
    reference = None
    if not launch and launcher.is_rank_zero() and found.initial_hf and cfg.load_check and resumed is None:
        # the load check's reference (transformers' logits of the HF folder): for the Transformers backend, before it
        # patches transformers: now, or for a large model in a process of its own beside the imports and the build
        reference = verifier.ReferenceLogits(
            found.initial_hf, found.tokenizer_dir, now=recipe.patches_transformers,
            own_process=recipe.patches_transformers and verifier.ReferenceLogits.large(found.initial_hf))
    if (cfg.guards.checkpoint_every == "auto" and not cfg.guards.storage_gb_per_s and not launch
            and launcher.is_rank_zero()):
        # the first auto interval plans its save over OUT_DIR's bandwidth: measured here, before anything is built,
        # by the process that trains as rank 0 (the ranks agree on the longest planned save: the others need none)
        cfg.guards.storage_gb_per_s = max(interval.write_probe(out_dir), 1e-6)
        print(f"[checkpoint] OUT_DIR's write bandwidth: {cfg.guards.storage_gb_per_s:.3g} GB/s measured ("
              f"{interval.PROBE_BYTES >> 20} MiB written and fsync'd by one process), the save the first auto "
              "interval plans with; --storage_gb_per_s B for your storage's own, all ranks together", flush=True)
    return Checked(out_dir=out_dir, found=found, record=record, world_size=world_size, end=end, launch=launch,
                   resumed=resumed, reference=reference)


def check_dotted(recipe: Recipe, cfg, out_dir: Path, found: Inputs) -> None:
    """The dotted torchtitan settings set on the recipe's Trainer.Config as a worker will set them (one UserError for
    a bad one), in the launching process, which trains nothing (planned_config)."""
    planned_config(recipe, cfg, out_dir, found, launcher.planned_world_size(cfg))


def planned_config(recipe: Recipe, cfg, out_dir: Path, found: Inputs, world_size: int):
    """The recipe's Trainer.Config with the command line's dotted settings, for `world_size` ranks on the meta
    device, in a process that trains nothing (the dry run, a launcher): its torchtitan is bound to the CPU."""
    import torch

    device.route_torchtitan_device("cpu")  # the model lives on the meta device; nothing runs
    from common import torchtitan_fixes  # after the routing: torchtitan binds its device at import

    torchtitan_fixes.quiet_known_noise()  # the plan (a training run's child too) prints what training would not
    target = device.DeviceInfo(torch.device("meta"), cfg.device, "fake", 0, 0, world_size)
    tc, _notes = recipe.trainer_config(cfg, target, out_dir, found)
    set_dotted(tc, cfg.torchtitan)  # the command line's other torchtitan settings: the plan is the run's
    return tc


def previous_results(out_dir: Path) -> dict:
    """The results.json OUT_DIR holds from an earlier run or part of this one, before this run replaces it; {} where
    there is none or it is not a JSON object."""
    import json

    try:
        old = json.loads((out_dir / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def stopped_part(out_dir: Path) -> dict:
    """The results.json a stopped part of this run left (a resumed run reads it before replacing it), else {}."""
    old = previous_results(out_dir)
    return old if old.get("stopped") else {}


def say_replaced(out_dir: Path, resumed: int | None = None) -> None:
    """A run in a folder that holds a finished run's results says, in one line before anything trains, where it
    starts and what it replaces (a rerun of the same command, or one with more --steps, would otherwise do it
    without a word). A finished run keeps no whole checkpoint of its last step (its last save is the export,
    model-only), so a rerun starts anew from step 1 (`resumed` None) or resumes from the newest whole checkpoint
    before the last step and trains the steps after it again."""
    old, path = previous_results(out_dir), out_dir / "results.json"
    if not old or old.get("stopped") or os.environ.get(stops.SELF_LAUNCHED):
        return  # nothing finished here, or a stopped part this run resumes
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    steps = old.get("steps")
    last = steps[-1] if isinstance(steps, list) and steps and type(steps[-1]) is int else None
    done = f"to step {last}, " if last is not None else ""
    export = " and its hf_export" if (out_dir / "hf_export").is_dir() else ""
    if resumed is None:
        weights = out_dir / "hf_export"
        start = ("this run starts anew from step 1 (no whole checkpoint to resume: a finished run's last save is "
                 f"its export, model-only) and replaces them{export}" +
                 (f"; to train on from its last weights instead (optimizer and schedule anew), --hf_checkpoint "
                  f"{weights} with another --out_dir" if (weights / "config.json").is_file() else ""))
    else:
        # the finished run's own checkpoint (written before its results), or a later run's, killed since
        meta = out_dir / "checkpoint" / f"step-{resumed}" / ".metadata"
        own = last is not None and last > resumed and meta.stat().st_mtime_ns <= path.stat().st_mtime_ns
        again = ("" if not own else f", trains step {last} again" if last == resumed + 1 else
                 f", trains steps {resumed + 1} to {last} again")
        start = (f"this run resumes from step {resumed}, the newest whole checkpoint (a finished run's last save is "
                 f"its export, model-only){again} and replaces them{export}")
    print(f"[rerun] {out_dir} holds a finished run's results ({done}results.json of {when}): {start}; choose "
          "another --out_dir to keep both", flush=True)


def train_guarded(recipe: Recipe, cfg, checked: Checked, hooks: type) -> dict:
    """One rank's training with the guards: stop signals caught, the plan's memory, the trainer built and trained,
    exported; exit 75 after a stop."""
    stop = stops.StopControl(end=checked.end, margin_s=cfg.guards.stop_margin_s, is_main=launcher.is_rank_zero(),
                             steps=cfg.steps)
    stop.install()  # from here a stop signal ends the run at a step boundary, with a checkpoint
    plan = None
    if launcher.is_rank_zero():  # the dry run's memory for this very configuration, planned while this one trains
        plan = pilot.PlanInAChild(
            lambda: dry_run(recipe, cfg, checked.out_dir, ranks=checked.world_size)["total_bytes"],
            device.resolve_device_type(cfg.device), key=checked.record)
    reference = checked.reference  # None on a resume: it has no load check
    phases = checked.phases or Phases()
    phases.mark("plan")
    dev = device.setup(cfg.device, lnc=cfg.lnc, timeout_s=cfg.comm_timeout_s,
                       neff_cache_dir=device.neff_cache_dir(cfg.neff_cache_dir, checked.out_dir))
    phases.mark("device")
    try:
        launcher.check_same_stack(checked.record)  # several hosts: the same settings and packages on each
        results = train(recipe, cfg, dev, checked.out_dir, checked.found,
                        hooks(recipe, cfg, checked, stop, plan=plan, reference=reference))
    except UserError as e:  # a check after training under the scripts' own launch: its launcher says it, exit 2
        stops.exit_if_failed_after_training(e, stop)
        raise
    finally:
        if reference is not None:
            reference.close()
        device.teardown()
    if results.get("stopped") and dev.is_main:
        print(stops.resume_line(results["stopped"]), flush=True)
    stops.exit_if_stopped(results)
    return results


class GuardHooks(Hooks):
    """The guards inside a run: the settings and components they put in the recipe's Trainer.Config (the resume
    record, checkpoint interval, data shards, metrics, validator, profiler), the trainer they build
    (common/harness/trainer.py's GuardedTrainer, which calls `check_settings`, `check_logits` and the stop control
    at their points in the loop), and the pilot report and loss comparison in results.json."""

    def __init__(self, recipe: Recipe, cfg, checked: Checked, stop: stops.StopControl,
                 plan: pilot.PlanInAChild | None, reference: verifier.ReferenceLogits | None = None):
        self.recipe, self.cfg, self.found, self.record, self.stop = recipe, cfg, checked.found, checked.record, stop
        self.phases = checked.phases or Phases()
        self.plan = plan  # the dry run's memory for this configuration (rank 0), read with the results
        self.reference = reference  # the load check's reference logits, being computed (rank 0)
        self.load_check, self.profile, self.compile_cache, self.started = None, None, None, time.time()
        self.shared_cache: compile_cache.SharedCache | None = None  # --compile_cache
        self.push_error: str | None = None  # the last push's failure, where one failed
        self.losses_path = self.eval_path = None

    def configure(self, tc, dev, out_dir: Path, found: Inputs) -> list[str]:
        cfg = self.cfg
        every = cfg.guards.checkpoint_every
        every = int(every) if every != "auto" else 0  # auto: GuardedCheckpointer's
        tc.checkpoint.interval = every or cfg.steps + 1
        tc.checkpoint.keep_latest_k = cfg.guards.keep_checkpoints
        tc.checkpoint.async_mode = "async" if cfg.guards.async_checkpoint else "disabled"
        # the data in its shards (common/harness/trainer.py's ShardedDataLoader); segments.json
        self.reshard, notes = reshard.configure(tc, cfg, dev, out_dir, self.components()["dataloader"])
        pilot.apply_metrics_settings(tc, cfg.guards.tensorboard)
        if cfg.guards.profile:  # torchtitan's profiler, traces in OUT_DIR/profile_traces
            self.profile = pilot.apply_profile_settings(tc, steps=cfg.steps, profile_freq=cfg.guards.profile_freq,
                                                        device_type=dev.device_type)
            notes.append(self.profile["note"])
        self.compile_cache = compile_cache.CompileCacheWatch(
            compile_cache.compile_cache_folder(dev.device_type, compiled=tc.compile.enable), dev.device_type,
            backend=tc.compile.backend if tc.compile.enable else None)
        # the graphs this compiler made on other hosts, pulled by one process a node (train()'s barrier)
        self.shared_cache = compile_cache.for_run(cfg.guards.compile_cache, dev.device_type, tc.compile.enable)
        if self.shared_cache is not None:
            if dev.local_rank == 0:
                notes.append(f"compile cache: {self.shared_cache.pull()} entries pulled from "
                             f"{compile_cache.shown_url(cfg.guards.compile_cache)}")
        elif cfg.guards.compile_cache:
            notes.append(f"--compile_cache unused: nothing compiles in eager mode on {dev.device_type} (add --compile)")
        if dev.is_main:
            resume.write_record(out_dir, self.record)
            self.losses_path, self.eval_path = out_dir / "losses.jsonl", out_dir / EVAL_LOSSES
        self.dev = dev
        note = apply_eval_settings(tc, cfg.guards.eval_every, cfg.guards.eval_steps, found.dataset,
                                   cfg.guards.eval_dataset_path)
        return notes + ([note] if note else [])

    def components(self) -> dict:
        """The guards' component classes (common/harness/trainer.py): a test's hooks may slow them down."""
        from common.harness import trainer

        return {"metrics": trainer.GuardedMetrics, "checkpoint": trainer.GuardedCheckpointer,
                "validator": trainer.GuardedValidator, "profiler": trainer.GuardedProfiler,
                "dataloader": trainer.ShardedDataLoader}

    def trainer_class(self, tc) -> type:
        """The guarded twin of the trainer the recipe's Trainer.Config builds: GuardedTrainer for torchtitan's own,
        GuardedHFTrainer for the Transformers backend's (common/harness/hf_trainer.py, imported only for it: it
        imports transformers)."""
        from torchtitan.trainer import Trainer

        from common.harness.trainer import GuardedTrainer

        if type(tc) is Trainer.Config:
            return GuardedTrainer
        from common.harness.hf_trainer import GuardedHFTrainer, TransformersBackendConfig

        if isinstance(tc, TransformersBackendConfig):
            return GuardedHFTrainer
        raise TypeError(f"no guarded trainer for {type(tc).__qualname__}: a recipe's config is torchtitan's "
                        "Trainer.Config or the Transformers backend's")

    def build(self, tc, shape: dict):
        """The recipe's trainer with the guards (GuardedTrainer, or its Transformers-backend twin), its components
        the guards' subclasses of the recipe's (the same settings), handed this run's stop control and save watch."""
        from common.trainer import same_fields

        made, cfg, dev = self.components(), self.cfg, self.dev
        self.saves = interval.SaveWatch(
            self.stop, every=cfg.guards.checkpoint_every, mtbi_h=cfg.guards.mean_hours_between_interruptions,
            planned_save_s=planned_save_s(shape, cfg), notice_s=cfg.guards.stop_notice_s,
            comm_timeout_s=cfg.comm_timeout_s,
            price_per_hour=cfg.guards.price_per_hour, evaluates=bool(cfg.guards.eval_every), is_main=dev.is_main,
            async_saves=cfg.guards.async_checkpoint)
        self.peak = pilot.peak_flops(dev.device_type, cfg.dtype, cfg.guards.peak_tflops, lnc=cfg.lnc)
        peak = self.peak["value"]
        config = same_fields(self.trainer_class(tc).Config, tc, metrics=same_fields(
            made["metrics"].Config, tc.metrics, flops_per_token=pilot.flops_per_token(shape, cfg.seq_len),
            peak_flops=peak if isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0 else 0.0,
            losses_path=str(self.losses_path) if self.losses_path else None,
            eval_losses_path=str(self.eval_path) if self.eval_path else None))
        config.checkpoint = same_fields(made["checkpoint"].Config, tc.checkpoint, last_save=cfg.export,
                                        is_main=dev.is_main, _stop=self.stop, _watch=self.saves)
        if config.validator.enable:
            config.validator = same_fields(made["validator"].Config, tc.validator, _stop=self.stop)
        if self.profile:
            config.profiler = same_fields(made["profiler"].Config, tc.profiler, device_mode=cfg.guards.profile_device)
        built = config.build(guards=self)
        self.phases.mark("build")
        return built

    # ---- called by GuardedTrainer, at their points in the loop ---------------------------------------------------
    def check_settings(self, trainer) -> None:
        """Right after the build: the built model's settings against the HF folder the run starts from."""
        cfg, found = self.cfg, self.found
        if found.initial_hf and cfg.load_check:
            check_settings(self.recipe.built_config(cfg, trainer, found), found.initial_hf)

    def check_logits(self, trainer) -> None:
        """Before step 1 of a fresh run: the loaded weights' logits against transformers' load of the HF folder."""
        cfg, found = self.cfg, self.found
        if found.initial_hf and cfg.load_check:
            self.load_check = logit_check(trainer, found.initial_hf, found.tokenizer_dir,
                                          tolerance=load_tolerance(cfg.dtype, cfg.export_tolerance),
                                          is_main=self.dev.is_main, pass_positions=self.recipe.pass_positions,
                                          reference=self.reference, stopping=lambda: self.stop.reason is not None)

    def check_process(self, recipe: Recipe):
        """Where the trainer patches transformers, each check in a process of its own that dies with the run (one the
        run's stop cut short has no verdict); else in this process (a stop signal only marks the stop)."""
        if not recipe.patches_transformers:
            return export.in_process
        return verifier.Verifier(stopping=lambda: self.stop.reason is not None)

    def push_compiled(self) -> None:
        """After the first steps (the graphs the steps, the optimizer's first update and the load check compiled) and
        at the end: the entries this host's cache has and the shared one lacks, pushed by one process a node."""
        if self.shared_cache is not None and self.dev.local_rank == 0:
            try:
                self.shared_cache.push()
            except UserError as e:  # the cache is a saving, not the run's work: it trains and exports on
                self.push_error = one_line(str(e))
                print(f"[compile cache] warning: the push failed, the run goes on: {self.push_error}",
                      file=sys.stderr, flush=True)

    # ---- after training ----------------------------------------------------------------------------------------
    def history(self, trainer) -> dict:
        rec = trainer.metrics_processor.record
        return whole_history(self.losses_path, rec) if self.losses_path is not None else rec.history()

    def results(self, trainer, dev, shape: dict, out_dir: Path) -> dict:
        cfg, mp = self.cfg, trainer.metrics_processor
        rec = mp.record
        memory = pilot.peak_memory(dev.device_type, dev.device, mp.peak_bytes)  # a collective
        profile = pilot.profile_traces(out_dir, every=self.profile["every"], steps=rec.steps, since=self.started,
                                       activities=self.profile["activities"],
                                       earlier=stopped_part(out_dir).get("profile")) if self.profile else None
        report = pilot.report(rec, shape=shape, seq_len=cfg.seq_len, world_size=dev.world_size, peak=self.peak,
                              memory=memory, planned_gib=self.plan.result() if self.plan else None,
                              price_per_hour=cfg.guards.price_per_hour, compile_cache=self.compile_cache.result(),
                              profile=profile, device_type=dev.device_type, steps_s=self.stop.steps_s)
        report["fallback_ops"] = pilot.fallback_ops(dev.device_type)  # Neuron: ops run on the host CPU
        if dev.device_type == "neuron":  # attach results.json to a problem report: the packages it ran on
            report["installed"] = installed_lists()
        out = {"load_check": self.load_check or None, "eval_losses": eval_rows(mp, self.eval_path),
               "stopped": self.stop.stopped(out_dir), "rank_logs": launcher.launch_logs(out_dir), **report}
        out.update(self.reshard.results(rec, out["stopped"]))  # segments.json's parts of the run
        out.update(self.saves.results())  # the auto interval and the stop-notice verdict
        out["time_to_first_step"] = self.phases.result()  # a collective
        self.push_compiled()  # what the later steps compiled (a recompile after a save or evaluation)
        out["compile_cache_shared"] = {**self.shared_cache.summary(), "push_error": self.push_error} \
            if self.shared_cache else None
        if trainer.config.compile.enable:  # what compiled when, and the recompiles after the warm-up
            out["compile"] = {"backend": trainer.config.compile.backend, **trainer.compiles.summary()}
        if cfg.guards.compare_losses:  # over the whole curve, steps before a resume included
            history = self.history(trainer)
            out["loss_comparison"] = compare_losses(history["losses"], cfg.guards.compare_losses,
                                                    cfg.guards.loss_tolerance,
                                                    steps=history["steps"])
        if dev.is_main:
            if warning := pilot.mfu_warning(report):
                print(warning, file=sys.stderr, flush=True)
            print(pilot.format_line(report), flush=True)
            print(phases_line(out["time_to_first_step"], first_step=rec.steps[0] if rec.steps else 1), flush=True)
            if "compile" in out:
                print(compile_line(out["compile"]), file=sys.stderr if out["compile"]["recompiles_after_warmup"]
                      else sys.stdout, flush=True)
            if cfg.guards.compare_losses:
                print(format_loss_comparison(out["loss_comparison"]), flush=True)
        return out


def compile_line(audit: dict) -> str:
    """The compile audit in one line; a recompile after the warm-up is a warning naming its step and reason."""
    late = audit["recompiles_after_warmup"]
    line = (f"[compile] {audit['backend']}: {audit['graphs']} graphs, {audit['recompiles']} recompiles "
            f"({len(late)} after the {audit['warmup_steps']}-step warm-up), {audit['graph_breaks']} graph breaks, "
            f"{audit['compile_s']:.1f} s compiling")
    if late:
        first = late[0]
        when = f"step {first['step']}" if first["where"] == "step" else f"after step {first['step']} (its save or " \
            "evaluation)"
        line += (f"; warning: {when} compiled again ({one_line(str(first['reason']))[:200]}): each recompile costs a "
                 "compile again (minutes on Trainium)")
    return line


def planned_save_s(shape: dict, cfg) -> float | None:
    """A checkpoint's size over --storage_gb_per_s (None without it, or for a config.json without the numbers)."""
    if not cfg.guards.storage_gb_per_s:
        return None
    try:
        size = dryrun.checkpoint_plan(dryrun.parameter_estimate(shape), cfg, shape=shape)["checkpoint_bytes"]
    except (KeyError, TypeError):
        return None
    return size / (cfg.guards.storage_gb_per_s * 1e9)


def dry_run(recipe: Recipe, cfg, out_dir: Path, ranks: int | None = None) -> dict:
    """Size the preset at --dry_run_ranks ranks on this machine (common/harness/dryrun.py); no training. With
    `ranks`: the plan alone for that many (a training run's planned memory), nothing written."""
    found = recipe.dry_run_inputs(cfg, out_dir) if recipe.dry_run_inputs else Inputs()
    tc = planned_config(recipe, cfg, out_dir, found, ranks or cfg.guards.dry_run_ranks)
    shape = recipe.model_shape(cfg, tc, found)
    check_layout(shape, tp=tc.parallelism.tensor_parallel_degree, seq_len=tc.training.seq_len,
                 world_size=ranks or cfg.guards.dry_run_ranks, global_batch=tc.training.global_batch_size,
                 local_batch=tc.training.local_batch_size, seq_divisor=recipe.seq_divisor)
    label, published = recipe.describe(cfg, shape) if recipe.describe else (cfg.preset, None)
    planned_for = device.resolve_device_type(cfg.device) if ranks else cfg.device if cfg.device != "auto" else "neuron"
    r = dryrun.dry_run(tc, shape=shape, world_size=ranks or cfg.guards.dry_run_ranks,
                       per_core_gib=cfg.guards.per_core_gib,
                       published_params=published, label=label, device_type=planned_for)
    if ranks:
        return r
    disk = dryrun.checkpoint_plan(r["parameters"], cfg, shape=shape)
    print(dryrun.format_disk(disk, out_dir), flush=True)
    projection = dryrun.project(cfg, tc, shape, cfg.guards.dry_run_ranks)
    notice = None
    if projection and cfg.guards.storage_gb_per_s:  # a step at the assumed MFU, the save over the stated bandwidth
        notice = interval.stop_verdict(
            step_s=projection["seconds"] / projection["steps"], batch_s=0.0, evaluates=False,
            save_s=disk["checkpoint_bytes"] / (cfg.guards.storage_gb_per_s * 1e9), notice_s=cfg.guards.stop_notice_s,
            comm_timeout_s=cfg.comm_timeout_s, save_source=f"planned at {cfg.guards.storage_gb_per_s:g} GB/s")
        print(interval.format_verdict(notice).replace("[stop notice]", "[dry run] stop notice:"), flush=True)
    return dryrun.finish(r, out_dir=out_dir, per_core_gib=cfg.guards.per_core_gib, results={
        "script": recipe.name, "config": cli.flags(cfg), "model_shape": shape, "disk": disk, "projection": projection,
        "stop_safety": notice})

