"""Resuming a stopped run on another number of ranks (`--reshard`).

A checkpoint holds three kinds of state, and each comes back on another world size its own way:

- weights and optimizer state: FSDP's sharded tensors, saved by torch.distributed.checkpoint (DCP). DCP reads each
  tensor's saved pieces into whatever sharding the resumed run has; nothing here touches them.
- the step counter and the LR schedule: the same on every rank, loaded as saved.
- the data position. torchtitan's loader splits the documents into one shard per data-parallel rank and keeps one
  state per shard (`dataloader.dp_rank_{i}`: where the shard's reading is, and the tokens read but not yet
  trained), each usable only by a loader of that shard. So the data stays split as the run's first segment split
  it, into its N shards, whatever the number of ranks later (`ShardedDataLoader`, common/harness/trainer.py): every step takes G / (N x L)
  batches of L sequences from every shard (G the global batch, L the local one), as on N ranks. On M ranks the
  step's G / L batches are dealt in one fixed order: the slot s = m x M + r (micro-step m of rank r) gets batch
  s // N of the step from shard s % N; on M = N that is each rank its own shard, torchtitan's own order. A step's
  global batch is thus the same sequences on any number of ranks; only the rank that computes each one changes,
  and with it the order of the floating-point sums. A rank reads every shard it takes a batch from: on M ranks with
  M dividing N, each shard once (N / M shards a rank); on more ranks than shards, each shard on M / N ranks, each
  keeping its own batches.

`segments.json` (rank 0, beside losses.jsonl) records each part of the run, kept across resumes: its steps, its
world size, its data shards and why it stopped. With QWEN3_RECIPES_RESHARD_DEBUG set to a folder, each process writes
there which batches it trained at each step (`data-w{M}-r{rank}-p{process}.jsonl`, M data-parallel ranks, the
data-parallel rank and the process's global rank, so that the tensor-parallel peers of a rank, which train the same
batches, each write their own file: shard, batch, the shard's documents read, a hash of each sequence), and a resumed
run writes the whole state it starts from (`resumed-step{S}-w{M}.pt`, rank 0): a way to check, on the hardware a run
will use, that a change of world size or layout loses nothing.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError, one_line
from common.results import atomic_write_text

DEBUG_ENV = "QWEN3_RECIPES_RESHARD_DEBUG"
SEGMENTS = "segments.json"
SHARD_KEY = "dataloader.dp_rank_"  # torchtitan's per-shard loader state in a DCP checkpoint (ParallelAwareDataloader)
NO_RESULT = "no result (the process ended without results.json: killed or failed)"


def check_debug_folder() -> None:
    """QWEN3_RECIPES_RESHARD_DEBUG names a folder the ranks write their traces into: anything else already there
    (a file, a FIFO) is one UserError before anything is built."""
    debug = os.environ.get(DEBUG_ENV)
    if debug and Path(debug).exists() and not Path(debug).is_dir():
        raise UserError(f"{DEBUG_ENV}={debug} is not a folder: name a folder (made if absent) for the ranks' data traces")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


# ------------------------------------------------------------------------------------------ the data plan
def data_shards(keys) -> int | None:
    """The number of data shards whose loader states a checkpoint holds (its keys `dataloader.dp_rank_0` to
    `dataloader.dp_rank_{N-1}`, each once); None when there are none, or not each of 0 to N-1."""
    found = {k[len(SHARD_KEY):] for k in keys if k.startswith(SHARD_KEY)}
    ranks = {int(x) for x in found if x.isdigit()}
    if not ranks or len(ranks) != len(found) or ranks != set(range(len(ranks))):
        return None
    return len(ranks)


def checkpoint_metadata(step_dir: Path) -> dict:
    """{key: its metadata} of a DCP checkpoint, from its .metadata (DCP's own reader; no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return dict(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    except Exception as e:  # a damaged .metadata: DCP raises what its unpickling raises
        raise UserError(f"{step_dir}/.metadata cannot be read ({type(e).__name__}: {one_line(str(e))[:200]}): the "
                        "checkpoint is damaged; move that step folder away to resume from the one before") from None


def saved_ranks(metadata: dict) -> int | None:
    """How many ranks wrote a checkpoint: the most pieces any tensor is saved in (FSDP shards every parameter and its
    optimizer state over the data-parallel ranks; a single rank saves whole tensors)."""
    return max((len(m.chunks) for m in metadata.values() if hasattr(m, "chunks")), default=None)


@dataclass
class Plan:
    """What a run's data loader continues from. `shards`: the checkpoint's data shards (None: one per data-parallel
    rank, as a fresh run has); `exact`: False when the checkpoint's data position cannot be carried over, `why`."""
    step: int = 0  # the checkpoint's step (0: a fresh run)
    shards: int | None = None
    exact: bool = True
    why: str = ""
    saved_world_size: int | None = None


def plan(out_dir: Path) -> Plan:
    """The data plan for a run in OUT_DIR: from the newest whole checkpoint, which torchtitan resumes from."""
    from common.harness.resume import whole_checkpoints

    have = whole_checkpoints(out_dir)
    if not have:
        return Plan()
    metadata = checkpoint_metadata(Path(out_dir) / "checkpoint" / f"step-{have[-1]}")
    shards, saved = data_shards(metadata), saved_ranks(metadata)
    if shards is None:
        return Plan(step=have[-1], exact=False, saved_world_size=saved,
                    why="its checkpoint holds no loader state per data shard")
    return Plan(step=have[-1], shards=shards, saved_world_size=saved)


# ------------------------------------------------------------------------------------------ the data loader
def deal(shards: int, ranks: int, rank: int, micro_steps: int) -> dict[tuple[int, int], int]:
    """Which batches of a step rank `rank` of `ranks` trains, from `shards` data shards, in `micro_steps` micro-steps:
    {(shard, batch of the step in that shard): micro-step}. The slot s = m x ranks + rank (micro-step m) gets batch
    s // shards of shard s % shards; with as many ranks as shards, a rank's own shard, in order."""
    return {((m * ranks + rank) % shards, (m * ranks + rank) // shards): m for m in range(micro_steps)}


@dataclass
class Reshard:
    """The reshard guard of one run: its data plan, the loader swapped into the Trainer.Config, its segment."""
    plan: Plan
    world_size: int
    out_dir: Path
    is_main: bool
    first_step: int = 1
    entries: list = field(default_factory=list)
    tensor_parallel: int = 1  # the ranks of a tensor-parallel group read the same data: world_size / this read it
    saved_tensor_parallel: int | None = None  # the degree of the part the checkpoint is from (its segment's)

    def summary(self) -> dict:
        """results.json's `data_shards`: how the data was read in this part of the run."""
        shards = self.plan.shards or self.world_size // self.tensor_parallel
        out = {"shards": shards, "world_size": self.world_size, "exact": self.plan.exact}
        if self.tensor_parallel > 1:
            out["data_parallel"] = self.world_size // self.tensor_parallel
        saved_tp = self.saved_tensor_parallel or self.tensor_parallel
        if self.plan.step and (self.plan.saved_world_size not in (None, self.world_size)
                               or saved_tp != self.tensor_parallel):
            out["resharded_from"] = {"step": self.plan.step, "world_size": self.plan.saved_world_size or
                                     self.world_size, "tensor_parallel": saved_tp}
        if not self.plan.exact:
            out["why"] = self.plan.why
        return out

    def results(self, rec, stopped: dict | None) -> dict:
        """results.json's `segments` (the whole run's, this part closed) and `data_shards`."""
        if self.is_main:
            last = rec.steps[-1] if rec.steps else self.first_step - 1
            self.entries = close_segment(self.out_dir, last, stopped["reason"] if stopped else None)
        return {"segments": self.entries, "data_shards": self.summary()}


def configure(tc, cfg, dev, out_dir: Path, loader: type) -> tuple[Reshard, list[str]]:
    """Before the build, on every rank: the data plan from the newest checkpoint, the recipe's data loader wrapped in
    `loader` (common/harness/trainer.py's ShardedDataLoader), this part of the run opened in segments.json (rank 0).
    Returns the guard and notes."""
    p = plan(out_dir)
    tp = cfg.tensor_parallel_degree
    guard = Reshard(plan=p, world_size=dev.world_size, out_dir=Path(out_dir), is_main=dev.is_main,
                    first_step=p.step + 1, tensor_parallel=tp,
                    saved_tensor_parallel=segment_tensor_parallel(out_dir, p.step) if p.step else None)
    notes = []
    if not p.exact:  # nothing to carry over: the data starts from its beginning
        tc.checkpoint.exclude_from_loading = [*tc.checkpoint.exclude_from_loading, "dataloader"]
        if dev.is_main:
            print(f"[reshard] the data position of step {p.step} cannot be carried over ({p.why}): the data starts "
                  "from its beginning, so documents trained on before are trained on again", flush=True)
    inner = tc.dataloader
    tc.dataloader = loader.Config(dataset=inner.dataset, dataset_path=inner.dataset_path, shards=inner,
                                          data_shards=p.shards or 0, global_batch_size=cfg.global_batch_size)
    m, n = dev.world_size // tp, p.shards  # data-parallel ranks, data shards
    if n and (p.saved_world_size not in (None, dev.world_size) or n != m) and dev.is_main:
        spread = ("one shard a rank" if m == n else f"{n // m} shards a rank" if n % m == 0 else
                  f"each shard read by {m // n} ranks" if m % n == 0 else "each rank reads the shards it takes from")
        where = _ranks(dev.world_size) + (f" (tensor parallel {tp}: {m} data-parallel)" if tp > 1 else "")
        print(f"[reshard] step {p.step} of {_ranks(p.saved_world_size or n)} resumed on {where}: weights and "
              f"optimizer state resharded by DCP; the data stays in its {n} shard{'s' * (n != 1)}, each at its "
              f"position ({spread}); the global batch stays "
              f"{cfg.global_batch_size if cfg.global_batch_size > 0 else cfg.local_batch_size * m}", flush=True)
        notes.append(f"data: {n} shard{'s' * (n != 1)} on {m} data-parallel rank{'s' * (m != 1)}")
    if dev.is_main:
        open_segment(out_dir, guard.first_step, dev.world_size, guard.summary(), tensor_parallel=tp)
    return guard, notes


def dump_state(states: dict, path: Path, is_main: bool) -> None:
    """The whole training state (model, optimizer, LR schedule, step; `states`: the checkpoint manager's) as full
    tensors in one torch.save file, written by rank 0; every rank takes part in gathering the sharded tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    out = {}
    for name in ("model", "optimizer", "lr_scheduler", "train_state"):
        if name in states:
            for k, v in states[name].state_dict().items():
                out[f"{name}.{k}"] = full(v)
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(out, tmp)
        os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ segments.json
def check_segments(out_dir: Path) -> None:
    """OUT_DIR/segments.json, where there is one, read as the run record is: a regular file holding the list of
    parts this module writes. Anything else is one UserError, never silently replaced (the parts of the run on
    other world sizes would disappear from results.json and the report)."""
    from common.results import not_a_file

    path = Path(out_dir) / SEGMENTS
    if not path.exists() and not path.is_symlink():
        return
    fix = "it is left as it is; move it away (the run's parts before it are then not reported) or choose another --out_dir"
    kind = not_a_file(path)
    if kind is not None or path.is_symlink() and not path.exists():
        raise UserError(f"{path} is damaged: it is {kind or 'a dangling link'}, not the record of the run's parts: {fix}")
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} is damaged ({one_line(type(e).__name__ + ': ' + str(e))}): {fix}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("steps"), list)
                                             and len(r["steps"]) == 2 for r in rows):
        raise UserError(f"{path} is damaged (not the list of parts with their steps this run writes): {fix}")


def read_segments(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / SEGMENTS
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("steps"), list) and len(r["steps"]) == 2] \
        if isinstance(rows, list) else []


def segment_tensor_parallel(out_dir: Path, step: int) -> int | None:
    """The tensor-parallel degree of the part of the run that trained `step` (None: unknown, or no such part)."""
    for row in read_segments(out_dir):
        start, end = row["steps"]
        if isinstance(start, int) and start <= step and (end is None or step <= end):
            tp = row.get("tensor_parallel", 1)
            return tp if isinstance(tp, int) and tp > 0 else None
    return None


def open_segment(out_dir: Path, first: int, world_size: int, data: dict, tensor_parallel: int = 1) -> list[dict]:
    """A part of the run starts at step `first`: the earlier parts are kept up to step first - 1 (a part that ended
    without results is closed there: its checkpoint is where this one starts), later ones dropped (their steps
    are trained again), and this one added, open."""
    kept = []
    for row in read_segments(out_dir):
        start, end = row["steps"]
        if not isinstance(start, int) or start >= first:
            continue
        if end is None:  # it never said where it ended
            row = {**row, "stopped": NO_RESULT}
        kept.append({**row, "steps": [start, first - 1 if end is None else min(end, first - 1)]})
    kept.append({"steps": [first, None], "world_size": world_size, "tensor_parallel": tensor_parallel,
                 "stopped": None, "data": data})
    atomic_write_text(Path(out_dir) / SEGMENTS, json.dumps(kept, indent=1) + "\n")
    return kept


def close_segment(out_dir: Path, last: int, stopped: str | None) -> list[dict]:
    """This part of the run ends after step `last`: `stopped` is the reason of a stop (None: it trained all its
    steps)."""
    rows = read_segments(out_dir)
    if rows and rows[-1]["steps"][1] is None:
        rows[-1] = {**rows[-1], "steps": [rows[-1]["steps"][0], last], "stopped": stopped}
        atomic_write_text(Path(out_dir) / SEGMENTS, json.dumps(rows, indent=1) + "\n")
    return rows
