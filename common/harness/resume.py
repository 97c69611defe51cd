"""Resuming only the same run.

Each run records beside its checkpoints what they were written with (RECORD: script, model and initial weights,
world size, batch split, sequence length, data, dtype, schedule, seed...). A rerun resumes only when it matches,
and only with more --steps than the newest checkpoint; anything else is refused with one line naming each
difference, before anything is built or launched. Stopping: common/harness/stops.py.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common import cli
from common.errors import UserError, one_line
from common.recipe import GUARDED_RECORD
from common.results import atomic_write_text

RECORD = GUARDED_RECORD  # in OUT_DIR/checkpoint: the name a run of the core alone recognises a guarded folder by
# Flags a resume may change: they do not change what the next step computes.
MAY_CHANGE = {"preset", "steps", "checkpoint_every", "out_dir", "export", "export_tolerance", "compare_losses",
              "loss_tolerance", "load_check", "time_limit", "stop_margin_s", "nproc_per_node", "nnodes", "node_rank",
              "master_addr", "master_port", "oversubscribe", "reshard",
              "device", "lnc", "dry_run", "dry_run_ranks", "per_core_gib", "eval_every", "eval_steps", "eval_dataset_path", "tensorboard",
              "peak_tflops", "price_per_hour", "assumed_mfu", "profile", "profile_freq", "comm_timeout_s",
              "neff_cache_dir", "rendezvous_wait_s", "check_efa", "keep_checkpoints", "async_checkpoint", "disk_check",
              "mean_hours_between_interruptions", "storage_gb_per_s", "stop_notice_s"}

# The layout of the ranks and the memory it trades, which --reshard may change (DCP reshards the tensors).
DEFAULT_LAYOUT = {"tensor_parallel_degree": 1, "activation_checkpoint": "recipe"}
LAYOUT = set(DEFAULT_LAYOUT)


def _weights_identity(folder: str | None) -> dict | None:
    """An HF folder's identity without reading its weights: config.json's sha256 and each safetensors file's
    name, size and modification time."""
    if not folder:
        return None
    root = Path(folder).resolve()
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(root.glob("*.safetensors"))}
    config = root / "config.json"
    return {"path": str(root), "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()
            if config.is_file() else None, "safetensors": files}


# A training file up to WHOLE_MAX bytes is hashed whole; a larger one by SAMPLES blocks of SAMPLE_BYTES spread over it
# (the first and the last included) with its size and modification time; once READ_BUDGET bytes have been read,
# further files by size and modification time alone. A corpus of any size is identified in about a second.
WHOLE_MAX, SAMPLES, SAMPLE_BYTES, READ_BUDGET = 8 << 20, 16, 64 << 10, 256 << 20


def _train_files(folder: Path) -> list[Path]:
    """The files `load_dataset(folder, split="train")` reads (datasets' own resolution of the folder), else every
    regular file in it (hidden ones left out)."""
    if folder.is_file():  # a one-file dataset (--dataset FILE.jsonl)
        return [folder]
    try:
        import datasets

        files = [Path(str(f).removeprefix("file://"))
                 for f in datasets.load_dataset_builder(str(folder)).config.data_files["train"]]
    except Exception:  # datasets raises many types for a folder it cannot resolve: then every file counts
        files = [f for f in folder.rglob("*") if not any(part.startswith(".") for part in f.relative_to(folder).parts)]
    return sorted(f for f in files if f.is_file())


def _data_identity(dataset: tuple[str, str] | None) -> dict | None:
    """What the training data is, without reading a large corpus through: for each file the run reads, its size and
    sha256 (of the whole file, or of a bounded sample with its modification time: `hashed` says which)."""
    if not dataset:
        return None
    folder, read, files = Path(dataset[1]), 0, {}
    for f in _train_files(folder):
        st, h = f.stat(), hashlib.sha256()
        entry = {"size": st.st_size}
        try:
            name = f.name if f == folder else f.relative_to(folder).as_posix()
        except ValueError:
            name = str(f)
        if read < READ_BUDGET:
            with open(f, "rb") as fh:
                if st.st_size <= WHOLE_MAX:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                    entry["hashed"] = "whole"
                else:
                    for i in range(SAMPLES):
                        fh.seek((st.st_size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                        h.update(fh.read(SAMPLE_BYTES))
                    entry["hashed"] = f"{SAMPLES} blocks of {SAMPLE_BYTES >> 10} KiB"
            read += min(st.st_size, SAMPLES * SAMPLE_BYTES if st.st_size > WHOLE_MAX else st.st_size)
            entry["sha256"] = h.hexdigest()
        else:
            entry["hashed"] = "not read (the corpus is past the bytes hashed)"
        if entry["hashed"] != "whole":
            entry["mtime_ns"] = st.st_mtime_ns
        files[name] = entry
    return {"path": str(folder), "files": files}


def _data_problem(data) -> str | None:
    """What is wrong with a record's `data` (None: the shape `_data_identity` writes)."""
    if not isinstance(data, dict) or not isinstance(data.get("path"), str) or not isinstance(data.get("files"), dict):
        return f"a JSON {_kind(data)}, not an object with a path and files"
    for name, entry in data["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("hashed"), str)
                and isinstance(entry.get("sha256", ""), str) and isinstance(entry.get("mtime_ns", 0), int)):
            return f"of the wrong shape at {one_line(name)}"
    return None


def run_record(script: str, cfg, *, world_size: int, dataset: tuple[str, str] | None) -> dict:
    """What this run's checkpoints are written with: every setting except MAY_CHANGE (the model's shape among them:
    its flavor or flags, and --hf_checkpoint's config and files), with paths resolved, the data (its folder, and
    each file it reads by size and hash) and the world size."""
    settings = {k: v for k, v in cli.flags(cfg).items() if k not in MAY_CHANGE}
    for key in ("hf_assets", "dataset_path"):
        if settings.get(key):
            settings[key] = str(Path(settings[key]).resolve())
    settings["hf_checkpoint"] = _weights_identity(cfg.hf_checkpoint)
    return {"script": script, "world_size": world_size, "settings": settings,
            "dataset": list(dataset) if dataset else None, "data": _data_identity(dataset),
            "schedule_steps": cfg.steps}  # the LR schedule's length (torchtitan's: warm-up, then decay to --steps)


def _differences(old: dict, new: dict) -> list[str]:
    if old.get("script") != new["script"]:
        return [f"written by {old.get('script')}, this is {new['script']}"]
    out = []
    if old.get("world_size") != new["world_size"]:
        out.append(f"world size {new['world_size']} (checkpoint: {old.get('world_size')}; the data loader and "
                   "optimizer are sharded per rank)")
    for key in sorted(set(old.get("settings", {})) | set(new["settings"])):
        a, b = old.get("settings", {}).get(key, DEFAULT_LAYOUT.get(key)), new["settings"].get(key)
        if a == b:
            continue
        if key == "hf_checkpoint" and (a or {}).get("path") == (b or {}).get("path"):
            out.append(f"--hf_checkpoint {b['path']}: its files changed since the checkpoint's run started from them")
        elif key == "hf_checkpoint":
            out.append(f"--hf_checkpoint {(b or {}).get('path')} (checkpoint: {(a or {}).get('path')})")
        else:
            out.append(f"--{key} {json.dumps(b)} (checkpoint: {json.dumps(a)})")
    if old.get("dataset") != new["dataset"]:
        out.append(f"data {new['dataset']} (checkpoint: {old.get('dataset')})")
    elif "data" in old and old["data"] != new["data"]:  # a record of an earlier version has none: not compared
        was, now = (old["data"] or {}).get("files", {}), (new["data"] or {}).get("files", {})
        changed = sorted(n for n in set(was) | set(now) if was.get(n) != now.get(n))
        out.append(f"data {new['dataset'][1]}: the files training reads changed since the checkpoint's run read them "
                   f"({', '.join(changed[:5])}{f' and {len(changed) - 5} more' if len(changed) > 5 else ''}: "
                   "added, removed, resized or rewritten)")
    return out


def whole_checkpoints(out_dir: Path) -> list[int]:
    """Steps of the whole distributed checkpoints in OUT_DIR/checkpoint (their .metadata is written last)."""
    folder = Path(out_dir) / "checkpoint"
    steps = []
    for step_dir in folder.glob("step-*") if folder.is_dir() else []:
        if step_dir.name[5:].isdigit() and (step_dir / ".metadata").is_file():
            steps.append(int(step_dir.name[5:]))
    return sorted(steps)


# torch.distributed.checkpoint's .metadata is a pickle: it is never unpickled here. Its opcodes are walked
# (pickletools.genops decodes them; nothing is imported, built or called) for the file entries of its storage data,
# each a `_StorageInfo` state {relative_path, offset, length}: the files and the bytes the checkpoint needs.
_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_INT_OPS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_KEEPS_TOP = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME", "PROTO", "STOP"}  # leave the top of the stack as is
_OTHER = object()  # a value on the stack that is neither a string nor an int
METADATA_MAX = 4 << 30  # bytes: no checkpoint's metadata is near this


def _storage_files(data: bytes) -> dict[str, int]:
    """{file: bytes it must hold} that a DCP .metadata names, from its opcodes (never unpickled); ValueError when
    it is not a pickle of that shape."""
    import pickle
    import pickletools

    if len(data) < 2 or data[0] != pickle.PROTO[0] or not 2 <= data[1] <= pickle.HIGHEST_PROTOCOL:
        raise ValueError("it does not start as a pickle does")
    memo: dict[int, object] = {}
    last, window, files = _OTHER, [], {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if op.name == "MEMOIZE" else arg] = last
            if op.name in _KEEPS_TOP:
                continue
            if op.name in ("GET", "BINGET", "LONG_BINGET"):
                last = memo.get(arg, _OTHER)
            elif (op.name in _STRING_OPS and isinstance(arg, str)) or (
                    op.name in _INT_OPS and isinstance(arg, int) and not isinstance(arg, bool)):
                last = arg
            else:
                last = _OTHER
            window = [*window[-5:], last]
            if (len(window) == 6 and window[0] == "relative_path" and isinstance(window[1], str)
                    and window[2] == "offset" and window[4] == "length"
                    and all(isinstance(window[i], int) and window[i] >= 0 for i in (3, 5))):
                files[window[1]] = max(files.get(window[1], 0), window[3] + window[5])
    except Exception as e:  # genops raises ValueError and others on bytes that are no pickle
        raise ValueError(f"it is not a whole pickle ({one_line(str(e))[:120]})") from None
    if not files:
        raise ValueError("it names no data files (no storage entries of a distributed checkpoint)")
    return files


def checkpoint_damage(step_dir: Path) -> str | None:
    """What is wrong with the files of a distributed checkpoint that has its .metadata (None: every file its metadata
    names is there, a regular file holding at least the bytes the metadata places in it). Read without unpickling."""
    from common.results import not_a_file

    meta = Path(step_dir) / ".metadata"
    kind = not_a_file(meta)
    if kind is not None:
        return f"its .metadata is {kind}"
    size = meta.stat().st_size
    if size == 0 or size > METADATA_MAX:
        return f"its .metadata is {size} bytes"
    try:
        files = _storage_files(meta.read_bytes())
    except ValueError as e:
        return f"its .metadata is not a distributed checkpoint's metadata: {e}"
    except OSError as e:
        return f"its .metadata cannot be read ({one_line(e.strerror or str(e))})"
    problems = []
    for name, need in sorted(files.items()):
        path = Path(step_dir) / name
        if Path(name).name != name or name in ("", ".", ".."):
            problems.append(f"its .metadata names {one_line(name)!r}, not a file of the folder")
        elif (kind := not_a_file(path)) is not None:
            problems.append(f"{one_line(name)} is {kind}")
        elif not path.is_file():
            problems.append(f"{one_line(name)} is missing")
        elif path.stat().st_size < need:
            problems.append(f"{one_line(name)} is truncated ({path.stat().st_size} bytes, its .metadata places "
                            f"{need})")
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        return "; ".join(problems[:4]) + more
    return None


def _check_checkpoint_files(folder: Path, have: list[int]) -> None:
    """The newest whole checkpoint (the one torchtitan loads) has every file its metadata names, whole; else one
    UserError naming what is damaged and the newest undamaged step before it, if any."""
    step_dir = folder / f"step-{have[-1]}"
    damage = checkpoint_damage(step_dir)
    if damage is None:
        return
    earlier = next((s for s in reversed(have[:-1]) if checkpoint_damage(folder / f"step-{s}") is None), None)
    fix = (f"step {earlier} before it is whole: move {step_dir} out of {folder} (a renamed copy inside it still "
           f"counts as a step) and run the same command to resume from step {earlier}" if earlier is not None else
           f"no checkpoint before it is whole: move {step_dir} out of {folder} to start anew, or choose another "
           "--out_dir")
    raise UserError(f"the checkpoint of step {have[-1]}, {step_dir}, is damaged ({damage}): it cannot be resumed "
                    f"and is left as it is; {fix}")


RECORD_MAX = 16 << 20  # bytes: a record is a few hundred bytes, plus a line a data file


def _kind(value) -> str:
    """A JSON value's type, as JSON names it."""
    return ("null" if value is None else "boolean" if isinstance(value, bool) else
            "number" if isinstance(value, (int, float)) else "string" if isinstance(value, str) else
            "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__)


def _record_problem(old, new: dict) -> str | None:
    """What is wrong with the shape of a run record read back (None: it has the shape `run_record` writes), with
    this run's record `new` for the settings' types."""
    if not isinstance(old, dict):
        return f"it holds a JSON {_kind(old)}, not an object"
    script, world_size, settings, dataset = (old.get(k) for k in ("script", "world_size", "settings", "dataset"))
    if not isinstance(script, str):
        return f"its script is a JSON {_kind(script)}, not a string"
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size > 0):
        return f"its world_size is a JSON {_kind(world_size)}, not a positive integer"
    if not isinstance(settings, dict):
        return f"its settings is a JSON {_kind(settings)}, not an object"
    if dataset is not None and not (isinstance(dataset, list) and len(dataset) == 2
                                    and all(isinstance(x, str) for x in dataset)):
        return f"its dataset is a JSON {_kind(dataset)}, not a [name, folder] array or null"
    if "data" in old and old["data"] is not None and _data_problem(old["data"]):
        return f"its data is {_data_problem(old['data'])}"
    for key, value in settings.items():
        ours = new["settings"].get(key)
        if key == "hf_checkpoint":
            if value is not None and not (isinstance(value, dict) and isinstance(value.get("path"), str)
                                          and isinstance(value.get("safetensors"), dict)):
                return f"its setting hf_checkpoint is a JSON {_kind(value)}, not an object or null"
        elif _kind(value) in ("array", "object"):
            return f"its setting {one_line(key)} is a JSON {_kind(value)}, not a flag's value"
        elif value is not None and ours is not None and _kind(value) != _kind(ours):
            return f"its setting {one_line(key)} is a JSON {_kind(value)} where this run's is a {_kind(ours)}"
    return None


def read_record(folder: Path, new: dict) -> dict:
    """FOLDER/run.json, read as any input is: a regular file of JSON in the shape `run_record` writes (settings of
    the types this run's `new` record has). Anything else is one UserError naming the file and what is wrong; the
    checkpoints beside it are not loaded, and nothing is moved."""
    from common.results import not_a_file

    path = Path(folder) / RECORD
    fix = "they are not loaded; choose another --out_dir, or move that folder away"
    kind = not_a_file(path)
    if kind is not None:
        raise UserError(f"{path} is damaged: it is {kind}, not a regular file (the record of the run that wrote the "
                        f"checkpoints beside it): {fix}")
    if not path.is_file():
        raise UserError(f"{folder} holds checkpoints without a readable {RECORD} (the record of the run that wrote "
                        f"them): {fix}")
    try:
        with open(path, "rb") as f:
            raw = f.read(RECORD_MAX + 1)
    except OSError as e:
        raise UserError(f"{path} cannot be read ({one_line(e.strerror or str(e))}): {fix}") from None
    if len(raw) > RECORD_MAX:
        problem = f"it is over {RECORD_MAX >> 20} MiB, no record of a run"
    else:
        try:
            old = json.loads(raw.decode("utf-8"))
            problem = _record_problem(old, new)
        except UnicodeDecodeError:
            problem = "it is not UTF-8 text"
        except ValueError as e:
            problem = f"it is not valid JSON: {one_line(str(e))}"
        except RecursionError:
            problem = "it is not valid JSON: nested too deep"
    if problem:
        raise UserError(f"{path} is damaged ({problem}): the checkpoints beside it are not loaded and are left as "
                        "they are; restore it, choose another --out_dir, or move that folder away")
    return old


def compared(old: dict, new: dict, reshard: bool) -> tuple[dict, dict, str]:
    """Two run records as a resume compares them, and a hint for its refusal. With
    --reshard the world size is left out, and a global batch of -1 (local x ranks) is resolved with each record's own
    world size: the global batch must stay what it was (gradient accumulation takes up the change of ranks;
    common/harness/reshard.py)."""
    def resolved(record: dict) -> dict:
        settings = {k: v for k, v in (record.get("settings") or {}).items() if k not in LAYOUT}
        local, ranks = settings.get("local_batch_size"), record.get("world_size")
        tp = (record.get("settings") or {}).get("tensor_parallel_degree", 1)
        if settings.get("global_batch_size") == -1 and isinstance(local, int) and isinstance(ranks, int) \
                and isinstance(tp, int) and tp > 0:
            settings["global_batch_size"] = local * (ranks // tp)  # local x data-parallel ranks
        return {**record, "world_size": None, "settings": settings}

    if not reshard:
        ranks = new.get("world_size")
        moved = [f"--{k} {new['settings'].get(k, d)}" for k, d in sorted(DEFAULT_LAYOUT.items())
                 if (old.get("settings") or {}).get(k, d) != new["settings"].get(k, d)]
        if old.get("world_size") != ranks:
            moved.insert(0, f"on {ranks} rank{'s' * (ranks != 1)}")
        hint = f" ({', '.join(moved)}: add --reshard)" if moved else ""
        return old, new, hint
    old, new = resolved(old), resolved(new)
    batch = old["settings"].get("global_batch_size")
    hint = (f" (--reshard keeps the global batch: pass --global_batch_size {batch})"
            if batch != new["settings"].get("global_batch_size") else "")
    return old, new, hint


def check_resume(out_dir: Path, record: dict, steps: int, reshard: bool = False) -> int | None:
    """Before anything is built: the step this run resumes from (None: it starts anew), or one UserError naming
    why the checkpoints in OUT_DIR cannot be continued by this command. `reshard` (--reshard): another world size,
    tensor-parallel degree or activation checkpointing may continue them, with the same global batch
    (common/harness/reshard.py)."""
    have = whole_checkpoints(out_dir)
    if not have:
        return None
    folder = Path(out_dir) / "checkpoint"
    old = read_record(folder, record)
    old, record, hint = compared(old, record, reshard)  # --reshard: the world size may change (harness/reshard.py)
    export = Path(out_dir) / "hf_export"  # only where the run that wrote the checkpoints exported (not --no-export)
    way = (f"resume with the checkpoint's settings{hint} or start anew with another --out_dir" +
           (f", or continue from its exported weights with --hf_checkpoint {export} in a new --out_dir"
            if (export / "config.json").is_file() else ""))
    diffs = _differences(old, record)
    if diffs:
        raise UserError(f"{folder} was written by another run, so this one cannot resume it: "
                        + "; ".join(one_line(d) for d in diffs) + f". To go on: {way}")
    _check_checkpoint_files(folder, have)  # before anything is built: not a FileNotFoundError after the build
    if steps <= have[-1]:
        raise UserError(f"nothing to train: {folder / f'step-{have[-1]}'} is at step {have[-1]} and --steps is "
                        f"{steps}; pass a larger --steps to train on from it (the checkpoint is left as it is)")
    if isinstance(old.get("schedule_steps"), int) and old["schedule_steps"] != steps:
        print(f"[resume] --steps {steps}, the checkpoint's run had {old['schedule_steps']}: the learning rate's decay "
              f"(torchtitan's schedule: warm-up, then linear to 0 at the last step) is now spread over {steps} steps, "
              f"so steps after {have[-1]} train at other learning rates than that run's would have", flush=True)
    return have[-1]


def write_record(out_dir: Path, record: dict) -> None:
    atomic_write_text(Path(out_dir) / "checkpoint" / RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
