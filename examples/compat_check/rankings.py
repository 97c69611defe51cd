"""The `rankings` subcommand of generate_compat_check.py: the Hub's own rankings of models per task (most downloaded,
trending), written to a file that `lookup --rankings` turns into its Trending and Downloads views, where a ranked
model nobody has checked yet shows as "not tested".

    python examples/generate_compat_check.py rankings --task text-generation --task image-text-to-text \\
        --limit 100 --out runs/compat/rankings.json        # or .parquet

Per task, two calls of huggingface_hub's `HfApi().list_models` (the Hub's /api/models listing, at HF_ENDPOINT when
set): `pipeline_tag=TASK`, `sort="downloads"` and `sort="trending_score"`, `limit=N`, `expand=[downloads, likes,
trendingScore, pipeline_tag]`. A model's rank is its place in the listing the Hub returns. Each (task, model) is one
record: model_id, task, downloads_rank, trending_rank (null where it is not in that top N), downloads,
trending_score, likes, fetched_at. Offline (HF_HUB_OFFLINE) or with the Hub out of reach it says so in one
`error:` line, exit 2, and writes nothing.

The file is JSON (an object: generator, fetched_at, endpoint, tasks, limit, models) or Parquet (the records, the
same fields in the schema's metadata), written atomically; --out must be a new file or a rankings file this
command wrote. Reading (`read_rankings`) takes either, ours or anyone's: every string is kept as text (shown,
never run), numbers that are not finite and non-negative are "not recorded", a record without a model id or task
is skipped, and a file without rank fields is ranked by its numbers (most first).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from common.errors import ArgumentParser, UserError, one_line

GENERATOR = "qwen3-trainium-recipes rankings"  # in every file this command writes: only such a file is replaced
TASKS = ("text-generation", "image-text-to-text")  # the tasks the check runs (the Hub's pipeline tags)
ORDERS = {"downloads": ("downloads", "downloads_rank", "downloads"),  # view: (Hub sort, rank field, number field)
          "trending": ("trending_score", "trending_rank", "trending_score")}
FIELDS = ("model_id", "task", "downloads_rank", "trending_rank", "downloads", "trending_score", "likes", "fetched_at")
EXPAND = ["downloads", "likes", "trendingScore", "pipeline_tag"]
HOW = ("write one where the Hub is reachable: python examples/generate_compat_check.py rankings --task "
       "text-generation --limit 100 --out rankings.json")


@dataclass
class Rankings:
    """A rankings file as read: its records (FIELDS each), where it came from, and what was skipped."""
    entries: list[dict]
    source: str
    fetched_at: str | None = None
    tasks: list[str] = field(default_factory=list)
    skipped: int = 0

    def ranked(self, view: str, task: str) -> list[dict]:
        """The records of `task` in `view`'s order (its rank field; records without one are not in the view)."""
        rank = ORDERS[view][1]
        return sorted((e for e in self.entries if e["task"] == task and e[rank] is not None), key=lambda e: e[rank])


# ------------------------------------------------------------------------------------------ fetching
def fetch(tasks: list[str], limit: int) -> dict:
    """The rankings document: per task, the Hub's listing by downloads and by trending score, top `limit` each."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"rankings lists models on the Hub, and HF_HUB_OFFLINE is set (offline): unset it on a "
                        f"machine that reaches {constants.ENDPOINT}; lookup --rankings reads the file offline")
    api, fetched_at = HfApi(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    entries: dict[tuple[str, str], dict] = {}
    for task in tasks:
        for sort, rank_field, _ in ORDERS.values():
            for rank, model in enumerate(_listing(api, constants.ENDPOINT, task, sort, limit), 1):
                e = entries.setdefault((task, model["id"]), dict.fromkeys(FIELDS) | {
                    "model_id": model["id"], "task": task, "fetched_at": fetched_at})
                e[rank_field] = rank
                for name in ("downloads", "trending_score", "likes"):
                    if model[name] is not None:
                        e[name] = model[name]
    order = {t: i for i, t in enumerate(tasks)}
    models = sorted(entries.values(), key=lambda e: (order[e["task"]], e["downloads_rank"] or math.inf,
                                                     e["trending_rank"] or math.inf))
    return {"generator": GENERATOR, "fetched_at": fetched_at, "endpoint": constants.ENDPOINT, "tasks": tasks,
            "limit": limit, "models": models}


def _listing(api, endpoint: str, task: str, sort: str, limit: int) -> list[dict]:
    """One listing of the Hub, as {id, downloads, trending_score, likes}; ids that are not text are left out."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        models = list(api.list_models(pipeline_tag=task, sort=sort, limit=limit, expand=EXPAND))
    except OfflineModeIsEnabled:
        raise UserError(f"rankings lists models on the Hub, and the Hub client is offline (HF_HUB_OFFLINE): run it "
                        f"on a machine that reaches {endpoint}") from None
    except Exception as e:  # noqa: BLE001  httpx, HTTP status, JSON: each becomes one line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(f"cannot list {task} models by {sort} on {endpoint} (offline, or the Hub is out of reach): "
                        f"{type(e).__name__}: {first}") from None
    out = []
    for m in models:
        model_id = getattr(m, "id", None)
        if isinstance(model_id, str) and model_id:
            out.append({"id": model_id, "downloads": _count(getattr(m, "downloads", None)),
                        "trending_score": _count(getattr(m, "trending_score", None)),
                        "likes": _count(getattr(m, "likes", None))})
    return out[:limit]


# ------------------------------------------------------------------------------------------ the file
def _count(v) -> int | float | None:
    """A finite, non-negative number (an int where it is whole), or None: anything else is not recorded."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if type(v).__module__ == "numpy":
        v = v.item()
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return int(v) if float(v).is_integer() and abs(v) < 2**53 else float(v)


def _rank(v) -> int | None:
    n = _count(v)
    return int(n) if isinstance(n, int) and n >= 1 else None


def _text(v) -> str | None:
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return str(v) if str(v) else None


def is_rankings_file(path: Path) -> bool:
    """A file this command wrote: JSON whose `generator` is ours, or Parquet whose schema metadata says so."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if head == b"PAR1":
            import pyarrow.parquet as pq

            meta = pq.read_schema(path).metadata or {}
            return meta.get(b"generator") == GENERATOR.encode()
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return isinstance(doc, dict) and doc.get("generator") == GENERATOR
    except Exception:  # noqa: BLE001  not readable, not JSON, not Parquet: not ours
        return False


def check_out(out: str) -> Path:
    """--out: a .json or .parquet file, new or a rankings file this command wrote (never a results file or yours)."""
    path = Path(out)
    if path.suffix.lower() not in (".json", ".parquet"):
        raise UserError(f"--out {out} must end in .json or .parquet")
    if path.exists() and not (path.is_file() and is_rankings_file(path)):
        raise UserError(f"--out {out} exists and is not a rankings file this command wrote: name a new file, or "
                        "remove that one first")
    return path


def write_rankings(path: Path, doc: dict) -> None:
    """Atomically (a temp file beside it, renamed): JSON as the document, Parquet as its records with the rest in
    the schema's metadata."""
    from common.results import atomic_path, atomic_write_text

    if path.suffix.lower() == ".json":
        atomic_write_text(path, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"downloads_rank": pa.int64(), "trending_rank": pa.int64(), "downloads": pa.float64(),
             "trending_score": pa.float64(), "likes": pa.float64()}
    schema = pa.schema([(c, types.get(c, pa.string())) for c in FIELDS])
    meta = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in doc.items() if k != "models"}
    table = pa.Table.from_pylist([{c: m.get(c) for c in FIELDS} for m in doc["models"]], schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table.replace_schema_metadata(meta), tmp)


def read_rankings(path: str | os.PathLike) -> Rankings:
    """A rankings file (JSON or Parquet, ours or anyone's) as records of FIELDS. UserError if it is not one."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--rankings {path} is not a file: {HOW}")
    try:
        with open(p, "rb") as f:
            parquet = f.read(4) == b"PAR1"
        if parquet:
            import pyarrow.parquet as pq

            table = pq.read_table(p)
            names = table.column_names
            if len(set(names)) != len(names):
                raise ValueError("it names a column more than once")
            meta = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
                    for k, v in (table.schema.metadata or {}).items()}
            records, fetched_at = table.to_pylist(), meta.get("fetched_at")
            tasks = meta.get("tasks")
        else:
            doc = json.loads(p.read_text(encoding="utf-8"))
            records = doc.get("models") if isinstance(doc, dict) else doc
            fetched_at = doc.get("fetched_at") if isinstance(doc, dict) else None
            tasks = doc.get("tasks") if isinstance(doc, dict) else None
        if not isinstance(records, list):
            raise ValueError("no list of models in it")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  JSON, Parquet, encoding: one line
        raise UserError(f"--rankings {path} is not a rankings file (JSON or Parquet): {type(e).__name__}: "
                        f"{str(e)[:200]}") from None
    entries, skipped = [], 0
    for r in records:
        r = r if isinstance(r, dict) else {}
        model_id, task = _text(r.get("model_id", r.get("id"))), _text(r.get("task"))
        if not (model_id and task):
            skipped += 1
            continue
        entries.append({"model_id": model_id, "task": task, "downloads_rank": _rank(r.get("downloads_rank")),
                        "trending_rank": _rank(r.get("trending_rank")), "downloads": _count(r.get("downloads")),
                        "trending_score": _count(r.get("trending_score")), "likes": _count(r.get("likes")),
                        "fetched_at": _text(r.get("fetched_at")) or _text(fetched_at)})
    for _, rank, number in ORDERS.values():  # no rank recorded at all: ranked by the number, most first
        if entries and not any(rank in r for r in records if isinstance(r, dict)):
            for task in dict.fromkeys(e["task"] for e in entries):
                mine = [e for e in entries if e["task"] == task and e[number] is not None]
                for i, e in enumerate(sorted(mine, key=lambda e: -e[number]), 1):
                    e[rank] = i
    if isinstance(tasks, str):
        try:
            tasks = json.loads(tasks)
        except ValueError:
            tasks = None
    found = list(dict.fromkeys(e["task"] for e in entries))
    tasks = [t for t in tasks if t in found] if isinstance(tasks, list) else []
    return Rankings(entries, str(path), _text(fetched_at), tasks + [t for t in found if t not in tasks], skipped)


# ------------------------------------------------------------------------------------------ the subcommand
def rankings_main(argv: list[str] | None = None, *, prog: str = "rankings") -> int:
    p = ArgumentParser(prog=prog, description="Write the Hub's rankings of models per task (most downloaded, "
                       "trending) to a file, for `lookup --rankings FILE` (its Trending and Downloads views).")
    p.add_argument("--task", action="append", choices=TASKS, required=True,
                   help="a pipeline tag the check runs; repeat for several (one listing per task and order)")
    p.add_argument("--limit", type=int, default=100, help="models per task and order (1-1000; default 100)")
    p.add_argument("--out", required=True, help="the rankings file: .json or .parquet (new, or one this wrote)")
    args = p.parse_args(argv)
    try:
        if not 1 <= args.limit <= 1000:
            raise UserError(f"--limit must be between 1 and 1000, got {args.limit}")
        tasks = list(dict.fromkeys(args.task))
        path = check_out(args.out)
        doc = fetch(tasks, args.limit)
        try:
            write_rankings(path, doc)
        except OSError as e:
            raise UserError(f"--out {args.out} cannot be written: {e.strerror or e}") from None
        counts = ", ".join(f"{t}: {sum(m['task'] == t for m in doc['models'])}" for t in tasks)
        print(one_line(f"rankings: {path} ({len(doc['models'])} model(s); {counts}; from {doc['endpoint']} at "
                       f"{doc['fetched_at']})"))
    except UserError as e:
        print(one_line(f"error: {e}"), file=sys.stderr)
        return 2
    return 0
