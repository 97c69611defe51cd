"""The guards inside a training run, as torchtitan's own extensions join its trainer (torchft's
FaultTolerantTrainer): static `Trainer` subclasses with their `Config` (`GuardedTrainer` over torchtitan's `Trainer`,
its twin `GuardedHFTrainer` over the Transformers backend's, common/harness/hf_trainer.py, both the loop of
`GuardedLoop`) and components built from their own `Config`, named in the trainer's config by
common/harness/lifecycle.py, which hands them the run's stop control and save watch there:

- `GuardedMetrics` (the metrics processor): each step's loss into losses.jsonl, the device's memory peak of each
  step read before torchtitan resets it, the run's FLOPs per token and peak in torchtitan's MFU, the held-out
  losses into eval_losses.jsonl;
- `GuardedCheckpointer` (the checkpoint manager): the stop save of the step the ranks stopped at, each save timed
  (the stop-safety verdict after it), --checkpoint_every auto's save steps, the last step's save only with
  --export, the state a resume starts from (the reshard debug switch);
- `GuardedValidator` (the validator): no evaluation after a stop, a stop between held-out batches, one pass over the
  held-out data;
- `ShardedDataLoader` (the data loader): the run's data in the shards of its first part, on any number of ranks
  (`--reshard`, common/harness/reshard.py);
- `GuardedProfiler` (the profiler): a resumed run's steps traced as if it never stopped, no trace of a step a
  stop left unrun, and on Trainium the Neuron activity and runtime traces under the run.

`GuardedLoop` reads in the order the loop runs: the load check before step 1, the step (ending in the metrics'
log), the stop agreement at the step's end, then torchtitan's save and evaluation, and whether to go on.

Import only after `common.device.setup()` (torchtitan binds its device at import time).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.validate import Validator
from torchtitan.observability.structured_logger import get_step
from torchtitan.tools import utils as tt_utils
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

from common.device import neuron_peak_memory
from common.torchtitan_fixes import set_mfu_inputs
from common.errors import UserError
from common.harness import reshard
from common.harness.checks import append_row, keep_rows_before
from common.harness.evaluation import HeldOutGate, HeldOutPass, reshard as reshard_fsdp
from common.harness.pilot import NEURON_TRACES
from common.harness.stops import StopNow
from common.trainer import RecordingMetrics


class GuardedMetrics(RecordingMetrics):
    """torchtitan's metrics processor with the guards' records (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RecordingMetrics.Config):
        flops_per_token: int = -1  # from the model's config.json (pilot.flops_per_token); -1: torchtitan's own
        peak_flops: float = -1.0  # one device's (pilot.peak_flops; 0: none known, no MFU); -1: torchtitan's table
        losses_path: str | None = None  # OUT_DIR/losses.jsonl on rank 0
        eval_losses_path: str | None = None  # OUT_DIR/eval_losses.jsonl on rank 0

    def __init__(self, config: Config, *, has_quantization: bool = False, **kwargs):
        super().__init__(config, has_quantization=has_quantization, **kwargs)
        self.quantized = has_quantization  # torchtitan's own reason to leave MFU out (its MFU is against bfloat16's)
        self.peak_bytes = 0  # the heaviest logged step's device memory peak
        self.eval_steps: list[int] = []
        self.eval_losses: list[float] = []
        self.first_step: int | None = None

    def start_at(self, step: int) -> None:
        """This process's first step: losses.jsonl and eval_losses.jsonl keep the steps of the run it resumes
        before it (a fresh run starts them anew)."""
        self.first_step = step
        for path in (self.config.losses_path, self.config.eval_losses_path):
            if path:
                keep_rows_before(Path(path), step)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.peak_bytes = max(self.peak_bytes, step_peak_bytes())  # before torchtitan resets the peak
        # the run's own FLOPs per token and peak in torchtitan's step line and TensorBoard, an impossible MFU left out
        set_mfu_inputs(self, flops_per_token=self.config.flops_per_token, peak_flops=self.config.peak_flops,
                       quantized=self.quantized)
        if self.config.losses_path:
            append_row(Path(self.config.losses_path), int(step), float(global_avg_loss))
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def log_validation(self, loss, step, extra_metrics=None):
        self.eval_steps.append(int(step))
        self.eval_losses.append(float(loss))
        if self.config.eval_losses_path:
            append_row(Path(self.config.eval_losses_path), int(step), float(loss))
        super().log_validation(loss=loss, step=step, extra_metrics=extra_metrics)


def step_peak_bytes() -> int:
    """The device's peak memory since torchtitan last reset it (after the previous logged step), read from the
    device module torchtitan itself reads (torch.cuda, torch.neuron, the CPU's common.device shim). On Neuron the
    device's queued work is finished first: its allocator runs asynchronously, and AWS's memory guide reads its
    statistics after a synchronize; the peak is read with torch.accelerator where the installed TorchNeuron documents
    it (common.device.neuron_peak_memory)."""
    if tt_utils.device_type == "neuron":
        tt_utils.device_module.synchronize()
        read, _ = neuron_peak_memory()
        return int(read())
    return int(tt_utils.device_module.max_memory_allocated())


class GuardedCheckpointer(CheckpointManager):
    """torchtitan's checkpoint manager, saving the step a stop ends at (common/harness/stops.py) through its own
    save, timing each save for --time_limit, and writing the last step's HF save only with --export. With
    torchtitan's asynchronous saves (--async_checkpoint: `async_mode` "async", the write in a thread of each rank
    while training goes on), a save's wait and its whole write are timed apart (the write's end is read at the next
    step's save call, or at the end of training), and a stop's save is waited for: written whole before the run
    ends."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        last_save: bool = True  # the last step's save (the HF export's weights); False with --no-export
        is_main: bool = False
        # This run's stop control (a stop agreed at a step makes that step a save step) and save watch
        # (common/harness/interval.py: the auto interval, the stop-safety verdict after each measured save), handed
        # over where the config is written. Objects of the run, not settings: a leading underscore keeps them out
        # of torchtitan's `to_dict` (the config it logs and gives TensorBoard).
        _stop: Any = None
        _watch: Any = None

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.guard_config = config
        self.stop, self.watch = config._stop, config._watch
        self.saved_at: int | None = None  # the step of this process's last resumable save
        self.writing: tuple[float, list] | None = None  # an asynchronous save in flight: its start, [its end]

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if last_step:
            return self.guard_config.last_save and super()._should_save(curr_step, last_step)
        if self.saved_at == curr_step:
            return False  # its --checkpoint_every save was the stop's too
        if self.stop is not None and self.stop.stopped_at == curr_step:
            return True
        if self.watch is not None and self.watch.auto:  # --checkpoint_every auto: the interval from measured costs
            return self.enable and self.watch.due(curr_step, self.saved_at)
        return super()._should_save(curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        self.note_written()
        t0 = time.monotonic()
        saved = super()._save(curr_step, last_step)  # waits for the asynchronous save before it, if any
        if saved and not last_step:
            self.saved_at = curr_step
            self.note_written()
            if self.save_future is not None and self.stop is not None and self.stop.stopped_at == curr_step:
                self.maybe_wait_for_saving()  # a stop's save: written whole before the run ends
            blocking = written = time.monotonic() - t0  # written by now, unless still being written:
            if self.save_future is not None:
                ended: list[float] = []
                self.save_future.add_done_callback(lambda _future: ended.append(time.monotonic()))  # a time only
                self.writing, written = (t0, ended), None
            if self.stop is not None:
                self.stop.saved(curr_step, blocking, written)
            if self.watch is not None:
                self.watch.saved()
        return saved

    def note_written(self) -> None:
        """An asynchronous save that has ended since: its whole write's time, and the verdict on it (this rank's)."""
        if self.writing is not None and self.writing[1]:
            (t0, (end,)), self.writing = self.writing, None
            if self.stop is not None:
                self.stop.written(end - t0)
            if self.watch is not None:
                self.watch.written()

    def finish_writing(self) -> None:
        """At the end of training: the asynchronous save still in flight written whole (before the process group
        goes), and its time noted."""
        self.maybe_wait_for_saving()
        self.note_written()

    def _load(self, step: int = -1) -> bool:
        loaded = super()._load(step)
        folder = os.environ.get(reshard.DEBUG_ENV)
        resumed = self.states["train_state"].step if "train_state" in self.states else 0
        if folder and loaded and resumed:  # the state as loaded: before anything of the first step runs
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            reshard.dump_state(self.states, Path(folder) / f"resumed-step{resumed}-w{world}.pt",
                               self.guard_config.is_main)
        return loaded


class GuardedValidator(Validator):
    """torchtitan's validator: one pass over the held-out data at most, a gate before each batch where the ranks
    agree whether every rank has one and whether to stop (common/harness/evaluation.py), no evaluation at a step a
    stop was agreed at, and the model re-sharded after each evaluation."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        _stop: Any = None  # this run's stop control (see GuardedCheckpointer.Config)

    gate_class = HeldOutGate

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.gate = self.gate_class(asked=config.steps, stop=config._stop)
        self.dl_config = HeldOutPass(self.dl_config, self.gate)

    def should_validate(self, step: int) -> bool:
        stop = self.gate.stop
        return not (stop is not None and stop.stopped_at == step) and super().should_validate(step)

    def validate(self, model_parts, step: int) -> None:
        stop, interrupted = self.gate.stop, False
        self.gate.start()
        try:
            super().validate(model_parts, step)
        except StopNow:
            interrupted = True
            for model in model_parts:  # what torchtitan's validate does at its end
                model.train()
        finally:
            reshard_fsdp(model_parts)
        if stop is not None:
            stop.eval_ended(step, interrupted=interrupted, batches=self.gate.batches)


class GuardedProfiler(Profiler):
    """torchtitan's profiler (its schedule, trace folder, names and activities), with three changes:

    - A resumed run traces its steps as one that never stopped: torchtitan 0.3.0 sets the torch profiler's step
      after entering it, so the resumed part's first step runs under the schedule's step 0 action, not its own: a
      stop just before the traced step left that step untraced (and, one step earlier, without its warm-up). Here
      the step and its action are set before entering.
    - A stop writes no trace of a step that never ran: leaving the profiler while the next step is the one to
      record made torch.profiler write an empty trace, named after the last step that did run.
    - On Neuron, torch.profiler is asked for the Neuron activity too, its runtime traces under the run: torchtitan
      0.3.0 asks for CPU's, and CUDA's or XPU's where one is available, never the Neuron device's. AWS's guide to
      PyTorch profiles (Neuron Explorer: aws-neuron/aws-neuron-sdk@a3247f5
      tools/neuron-explorer/how-to-profile-workload.rst:122-222, and its successor how-to-profile-pytorch) passes
      ProfilerActivity.CPU and ProfilerActivity.PrivateUse1 to torch.profiler.profile with a
      `torch_neuronx.profiling.NeuronConfig` as `experimental_config`: its `modes` (ProfileMode.RUNTIME: the
      runtime's system trace, trace_info.pb and ntrace.pb; ProfileMode.DEVICE: .neff and .ntff, about 5 GB of HBM
      reserved on trn2, so only with --profile_device) and `profile_output_dir`, under which each process writes a
      folder `<instance id>_pid_<pid>/`. Here that folder is OUT_DIR/profile_traces/neuron/node<N>
      (neuron_trace_dir), not the shell's working folder. Unrun here (no Trainium).
    Remove each when torchtitan does it itself."""

    @dataclass(kw_only=True, slots=True)
    class Config(Profiler.Config):
        device_mode: bool = False
        """On Neuron, ProfileMode.DEVICE too (instruction-level traces; reserves about 5 GB of HBM per trn2 core)."""

    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        self.closing = True  # the trace torch.profiler would write now is of a step that never ran
        return super().__exit__(exc_type, exc_val, exc_tb)

    def build_torch_profiler(self, *, global_step: int, base_folder: str, leaf_folder: str):
        """torchtitan's build_torch_profiler (torchtitan.tools.profiler, 0.3.0), with the changes above; its two
        log lines and its `assert wait >= 0` are left out (the flags are checked before the run, pilot.check_profile;
        the traces are listed in results.json)."""
        from torchtitan.tools.profiler import PROFILE_FILE, PROFILE_ITER_DIR

        cfg = self._config
        if not cfg.enable_profiling:
            return None
        self.closing = False
        trace_dir, rank = os.path.join(base_folder, cfg.save_traces_folder), torch.distributed.get_rank()
        post_processor = cfg.trace_post_processor.build() if cfg.trace_post_processor else None

        def trace_handler(prof):
            if self.closing:
                return
            folder = os.path.join(trace_dir, PROFILE_ITER_DIR.format(step=prof.step_num), leaf_folder)
            os.makedirs(folder, exist_ok=True)
            trace = os.path.join(folder, PROFILE_FILE.format(rank=rank))
            prof.export_chrome_trace(trace)
            if post_processor is not None:
                post_processor(trace)

        os.makedirs(trace_dir, exist_ok=True)
        activities, neuron = [torch.profiler.ProfilerActivity.CPU], None
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        elif torch.xpu.is_available():
            activities.append(torch.profiler.ProfilerActivity.XPU)
        elif self.on_neuron():
            activities.append(torch.profiler.ProfilerActivity.PrivateUse1)
            runtime_dir = neuron_trace_dir(base_folder, cfg.save_traces_folder)
            os.makedirs(runtime_dir, exist_ok=True)
            neuron = self.neuron_config(runtime_dir, device_mode=cfg.device_mode)
        extra = {key: val for key, val in (("repeat", cfg.profiler_repeat), ("skip_first", cfg.profiler_skip_first),
                                           ("skip_first_wait", cfg.profiler_skip_first_wait)) if val is not None}
        wait = cfg.profile_freq - (cfg.profiler_active + cfg.profiler_warmup)
        profiler = torch.profiler.profile(
            activities=activities, on_trace_ready=trace_handler, record_shapes=True,
            **({"experimental_config": neuron} if neuron is not None else {}),
            schedule=torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active,
                                             **extra))
        profiler.step_num = global_step  # before entering: the next step runs under its own action
        profiler.current_action = profiler.schedule(global_step)
        profiler.__enter__()
        return profiler

    def on_neuron(self) -> bool:
        """Whether this process trains on a NeuronCore (torchtitan routed to it, torch-neuronx usable)."""
        from common.device import neuron_available

        return tt_utils.device_type == "neuron" and neuron_available()

    def neuron_config(self, folder: str, *, device_mode: bool):
        """AWS's NeuronConfig: the runtime's system trace, the device's traces with `device_mode`, into `folder`."""
        from torch_neuronx.profiling import NeuronConfig, ProfileMode  # AWS's documented import

        return NeuronConfig(modes=[ProfileMode.RUNTIME, *([ProfileMode.DEVICE] if device_mode else [])],
                            **neuron_config_paths(folder))


def neuron_config_paths(folder: str) -> dict:
    """NeuronConfig's folders: the traces into `folder`, and the run's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR, which
    common.device.setup sets), whose NEFFs the profiler then copies into the traces when it stops instead of making
    more copies at each load (aws-neuron/aws-neuron-sdk@81ce03a tools/neuron-explorer/how-to-profile-workload.rst:
    170-172, the NeuronConfig parameters; 305-311)."""
    from common.device import NEFF_CACHE_VAR

    cache = os.environ.get(NEFF_CACHE_VAR)
    return {"profile_output_dir": folder, **({"neff_cache_dir": cache} if cache else {})}


def neuron_trace_dir(base_folder: str, traces_folder: str) -> str:
    """Where this node's Neuron runtime traces go: OUT_DIR/<traces>/neuron/node<N> (N: torchrun's GROUP_RANK, the
    node's rank), each process in a folder of its own below it."""
    return os.path.join(base_folder, traces_folder, NEURON_TRACES, f"node{os.environ.get('GROUP_RANK', '0')}")


class ShardedDataLoader(BaseDataLoader):
    """The run's data in its N shards on M data-parallel ranks (the rule: common/harness/reshard.py's docstring): one
    torchtitan loader per shard this rank takes batches from, each built from the recipe's own loader config with
    dp_rank = the shard and dp_world_size = N, its state saved under torchtitan's key for that shard. The debug
    trace's step is the one torchtitan's loop is in (its structured logging's, set before each step)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        shards: Any = None  # the recipe's loader config (torchtitan's HuggingFaceTextDataLoader.Config)
        data_shards: int = 0  # N; 0: one per data-parallel rank (a fresh run)
        global_batch_size: int = -1  # G; -1: local batch x data-parallel ranks

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int, **kwargs):
        ranks, shards = dp_world_size, config.data_shards or dp_world_size
        batch = config.global_batch_size if config.global_batch_size > 0 else local_batch_size * ranks
        if batch % (local_batch_size * shards) or batch % (local_batch_size * ranks):
            raise UserError(f"the global batch {batch} does not split into batches of {local_batch_size} over "
                            f"{shards} data shards and {ranks} ranks")
        self.ranks, self.rank, self.n_shards = ranks, dp_rank, shards
        self.micro_steps = batch // (local_batch_size * ranks)  # of this rank, in a step
        self.per_shard = batch // (local_batch_size * shards)  # batches a step takes from each shard
        self.mine = reshard.deal(shards, ranks, dp_rank, self.micro_steps)
        self.hosted = sorted({v for v, _ in self.mine})  # the shards this rank reads
        self.loaders = {v: config.shards.build(dp_world_size=shards, dp_rank=v, local_batch_size=local_batch_size,
                                               **kwargs) for v in self.hosted}
        debug = os.environ.get(reshard.DEBUG_ENV)
        self.process, self.from_step = int(os.environ.get("RANK", "0")), None
        self.trace = Path(debug) / f"data-w{ranks}-r{dp_rank}-p{self.process}.jsonl" if debug else None

    def __iter__(self):
        iters = {v: iter(loader) for v, loader in self.loaders.items()}
        while True:
            mine = [None] * self.micro_steps
            for v in self.hosted:  # each shard this rank takes from, read to the end of the step
                for b in range(self.per_shard):
                    try:
                        batch = next(iters[v])
                    except StopIteration:  # a finite dataset ran out: torchtitan cancels the step
                        return
                    m = self.mine.get((v, b))  # None: another rank's batch, read past
                    if m is not None:
                        mine[m] = batch
                        self._traced(v, b, m, batch)
            yield from mine

    def _traced(self, shard: int, batch_index: int, micro: int, batch) -> None:
        if self.trace is None:
            return
        dataset = self.loaders[shard].dataset
        rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch[0]["input"]]
        step = get_step()  # the step torchtitan's train loop is in (its structured logging's, set before the step)
        self.from_step = step if self.from_step is None else self.from_step  # this launch's first traced step
        line = {"step": step, "world_size": self.ranks, "rank": self.rank, "process": self.process,
                "from_step": self.from_step, "micro_step": micro, "shard": shard, "batch": batch_index,
                "shards": self.n_shards,
                "epoch": getattr(dataset, "_epoch", None), "documents_read": getattr(dataset, "_sample_idx", None),
                "rows": rows}
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        with open(self.trace, "a") as f:
            f.write(json.dumps(line) + "\n")

    def state_dict(self) -> dict:
        out = {"world_size": self.n_shards}
        for loader in self.loaders.values():  # {"dp_rank_v": its state, "world_size": N}
            out.update(loader.state_dict())
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        for v, loader in self.loaders.items():
            key = f"dp_rank_{v}"
            loader.load_state_dict({key: state_dict[key], "world_size": state_dict["world_size"]})


class GuardedLoop:
    """The guards in torchtitan's training loop, for a trainer class (torchtitan's `Trainer`, or the Transformers
    backend's `HFTransformerTrainer`): GuardedTrainer and GuardedHFTrainer put it before their base. Built with
    `config.build(guards=...)` (torchtitan's build keywords: objects of this run): the run's
    common.harness.lifecycle.GuardHooks, its stop control, save watch, load check and compile-cache watch."""

    def __init__(self, config, *, guards):
        self.guards = guards
        self.first_step: int | None = None
        self.compiles = CompileAudit()
        super().__init__(config)
        guards.check_settings(self)  # the built model's settings against the HF folder's, before it loads

    def train(self):
        self.guards.compile_cache.start()  # the compile cache's entries before step 1
        trained = super().train()
        self.compiles.collect(self.step, "after")  # the last step's save and evaluation
        self.checkpointer.finish_writing()  # an asynchronous save still being written: whole before the end
        return trained

    def train_step(self, data_iterator):
        guards, first = self.guards, self.first_step is None
        self.compiles.collect(self.step - 1, "after")  # the last step's save and evaluation, or the load check
        if first:  # this process's first step: step 1, or the one after the resumed step
            self.first_step = self.step
            guards.saves.started_after = self.step - 1
            self.metrics_processor.start_at(self.step)
            guards.phases.mark("load")  # torchtitan's train() loaded the weights or the checkpoint
            if self.step == 1:
                guards.check_logits(self)  # the loaded weights against transformers' load of them
                guards.phases.mark("load check")
            self.metrics_processor.record.start()  # the first step's time is its own: not the load, nor its check
        super().train_step(data_iterator)  # ends in the metrics' log: loss, memory peak, MFU
        self.compiles.collect(self.step, "step")  # the graphs compiled during it (--compile)
        if first:
            guards.compile_cache.first_step()
            guards.phases.mark("first step")
        elif self.step == self.first_step + 1:  # the first steps' graphs, for the next host: pushed now
            guards.push_compiled()
        # The step's end: the ranks agree whether to stop; a stop makes this step a save step (torchtitan's save
        # comes next) and skips its evaluation.
        guards.stop.step_ended(self.step, eval_due=bool(
            self.config.validator.enable and self.validator.should_validate(self.step)))

    def should_continue_training(self) -> bool:
        stop = self.guards.stop
        if stop.stopped_at is not None:
            if self.checkpointer.saved_at != stop.stopped_at:  # a stop during the evaluation after the save
                self.checkpointer.save(stop.stopped_at)
            return False
        return super().should_continue_training()


class CompileAudit:
    """What torch.compile compiled and when (--compile): each frame compile torch records
    (torch._dynamo.utils.get_compilation_metrics: its compile id "frame/attempt", attempt > 0 a recompile, with
    Dynamo's reason and graph breaks; a graph's backward is recorded under the same id), read before and after every
    training step, so each compile is placed in a step or between two (a save, an evaluation, the load check). The
    warm-up is a process's first two steps; a recompile after it (a save, an evaluation or a resume that changed
    what a guard checks) costs a compile again: minutes on Trainium."""

    WARMUP_STEPS = 2

    def __init__(self):
        self.events: list[dict] = []
        self.first_step: int | None = None
        self.since_us = self._latest_us(self._metrics())

    @staticmethod
    def _metrics() -> list:
        from torch._dynamo.utils import get_compilation_metrics

        return get_compilation_metrics()

    @staticmethod
    def _latest_us(metrics: list) -> int:
        return max((m.start_time_us or 0 for m in metrics), default=0)

    def collect(self, step: int, where: str) -> None:
        """The compiles since the last look: in step `step` (`where` "step"), or after it ("after": its save, its
        evaluation; before step 1: the load check)."""
        if self.first_step is None and where == "step":
            self.first_step = step
        metrics = self._metrics()
        for m in metrics:
            if (m.start_time_us or 0) <= self.since_us:
                continue
            same = next((e for e in self.events if e["compile_id"] == str(m.compile_id) and e["step"] == step
                         and e["where"] == where), None)
            if same is not None:  # the graph's backward, compiled under its forward's id
                same["seconds"] += m.entire_frame_compile_time_s or 0.0
                continue
            attempt = str(m.compile_id).split("/")[-1]
            self.events.append({"step": step, "where": where, "compile_id": str(m.compile_id),
                                "recompile": attempt.isdigit() and int(attempt) > 0, "reason": m.recompile_reason,
                                "graph_breaks": m.num_graph_breaks or 0,
                                "seconds": m.entire_frame_compile_time_s or 0.0})
        self.since_us = max(self.since_us, self._latest_us(metrics))

    def after_warmup(self) -> list[dict]:
        """The recompiles after this process's warm-up steps (their saves and evaluations included)."""
        last_warm = (self.first_step or 1) + self.WARMUP_STEPS - 1
        return [e for e in self.events if e["recompile"] and e["step"] > last_warm]

    def summary(self) -> dict:
        return {"graphs": sum(not e["recompile"] for e in self.events),
                "recompiles": sum(e["recompile"] for e in self.events),
                "graph_breaks": sum(e["graph_breaks"] for e in self.events),
                "compile_s": round(sum(e["seconds"] for e in self.events), 3),
                "warmup_steps": self.WARMUP_STEPS, "recompiles_after_warmup": self.after_warmup(),
                "events": self.events}


class GuardedTrainer(GuardedLoop, Trainer):
    """torchtitan's Trainer with the guards (GuardedLoop)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass
