"""The `rankings` subcommand of generate_compat_check.py: the Hub's own rankings of models per task (most downloaded,
trending), written to a file that `lookup --rankings` turns into its Trending and Downloads views, where a ranked
model nobody has checked yet shows as "not tested".

    python examples/generate_compat_check.py rankings --task text-generation --task image-text-to-text \\
        --limit 100 --out runs/compat/rankings.json        # or .parquet

Per task, two listings of the Hub's /api/models (at HF_ENDPOINT when set), as huggingface_hub's
`HfApi().list_models` asks for them and with the token it would send: `pipeline_tag=TASK`, `sort=downloads` and
`sort=trendingScore`, `limit=N`, `expand=[downloads, likes, trendingScore, pipeline_tag]`. A model's rank is its
place in the listing the Hub returns. Each (task, model) is one record: model_id, task, downloads_rank,
trending_rank (null where it is not in that top N), downloads, trending_score, likes, fetched_at. Offline
(HF_HUB_OFFLINE) or with the Hub out of reach it says so in one `error:` line, exit 2, and writes nothing.

The answers are untrusted, and bounded: the whole command within --timeout_s (every listing, page and byte; a
server that answers a byte at a time is cut off too), at most MAX_PAGES pages a listing (Link: rel="next") and
MAX_PAGE_BYTES a page, each past its bound one `error:` line with nothing written; a number outside 0 to MAX_COUNT
(2^53; a 1 followed by 400 zeros, say) is not recorded, and the `rankings:` line counts them. The token goes to
HF_ENDPOINT's origin (scheme, host, port) only, never to another one a Link header names.

The file is JSON (an object: generator, fetched_at, endpoint, tasks, limit, models) or Parquet (the records, the
same fields in the schema's metadata), written atomically; --out must be a new file or a rankings file this
command wrote. Reading (`read_rankings`) takes either, ours or anyone's: every string is kept as text (shown,
never run), numbers outside 0 to MAX_COUNT are "not recorded", a record without a model id or task is skipped,
and a file without rank fields is ranked by its numbers (most first).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from common.errors import ArgumentParser, UserError, one_line

GENERATOR = "qwen3-trainium-recipes rankings"  # in every file this command writes: only such a file is replaced
TASKS = ("text-generation", "image-text-to-text")  # the tasks the check runs (the Hub's pipeline tags)
ORDERS = {"downloads": ("downloads", "downloads_rank", "downloads"),  # view: (Hub sort, rank field, number field)
          "trending": ("trendingScore", "trending_rank", "trending_score")}
FIELDS = ("model_id", "task", "downloads_rank", "trending_rank", "downloads", "trending_score", "likes", "fetched_at")
EXPAND = ["downloads", "likes", "trendingScore", "pipeline_tag"]
TIMEOUT_S = 300  # --timeout_s by default: every listing, page and byte of one rankings command together
MAX_PAGES = 100  # pages one listing may take (Link: rel="next"), whatever they hold
MAX_PAGE_BYTES = 64 * 2**20  # one page's body (1000 models with the fields asked for: well under 1 MiB)
MAX_COUNT = 2**53  # the largest count recorded: every whole number up to it is exact in a float64 (Parquet's)
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
def fetch(tasks: list[str], limit: int, timeout_s: float = TIMEOUT_S) -> tuple[dict, int]:
    """The rankings document: per task, the Hub's listing by downloads and by trending score, top `limit` each; and
    how many numbers of the listings were out of range (not recorded). All of it within `timeout_s` seconds."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"rankings lists models on the Hub, and HF_HUB_OFFLINE is set (offline): unset it on a "
                        f"machine that reaches {constants.ENDPOINT}; lookup --rankings reads the file offline")
    endpoint, fetched_at = constants.ENDPOINT, datetime.now(timezone.utc).isoformat(timespec="seconds")
    late = UserError(f"no complete answer from {endpoint} within --timeout_s {timeout_s:g} (every listing and page "
                     "of this command together): the Hub is slow or out of reach; nothing written")
    deadline, done = time.monotonic() + timeout_s, {}

    def work():  # in a thread of its own: a server that answers a byte at a time cannot hold the command past the
        try:     # deadline (each read of it is in time); the thread gives up at its next read past it
            done["listings"] = _listings(endpoint, tasks, limit, deadline, late)
        except BaseException as e:  # noqa: BLE001  handed to the caller
            done["error"] = e

    worker = threading.Thread(target=work, name="rankings-fetch", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise late
    if "error" in done:
        raise done["error"]
    entries: dict[tuple[str, str], dict] = {}
    dropped = 0
    for task in tasks:
        for sort, rank_field, _ in ORDERS.values():
            models, n = done["listings"][task, sort]
            dropped += n
            for rank, model in enumerate(models, 1):
                e = entries.setdefault((task, model["id"]), dict.fromkeys(FIELDS) | {
                    "model_id": model["id"], "task": task, "fetched_at": fetched_at})
                e[rank_field] = rank
                for name in ("downloads", "trending_score", "likes"):
                    if model[name] is not None:
                        e[name] = model[name]
    order = {t: i for i, t in enumerate(tasks)}
    models = sorted(entries.values(), key=lambda e: (order[e["task"]], e["downloads_rank"] or math.inf,
                                                     e["trending_rank"] or math.inf))
    return {"generator": GENERATOR, "fetched_at": fetched_at, "endpoint": endpoint, "tasks": tasks,
            "limit": limit, "models": models}, dropped


def _origin(url) -> tuple:
    """Scheme, host and port (the default one where none is written): where a token may go."""
    return url.scheme, url.host, url.port or {"http": 80, "https": 443}.get(url.scheme)


def _listings(endpoint: str, tasks: list[str], limit: int, deadline: float, late: UserError) -> dict:
    """{(task, Hub sort): (models, numbers not recorded)} for every task and order, over one connection pool. The
    token (HF_TOKEN, or the one huggingface_hub stored) goes to the endpoint's origin only: never to another host
    or port a Link header names (httpx drops it from a redirect to another origin too)."""
    import httpx
    import huggingface_hub
    from huggingface_hub import constants

    # The token huggingface_hub would send (HF_TOKEN, else the stored one; none with HF_HUB_DISABLE_IMPLICIT_TOKEN).
    # Not its build_hf_headers: that also fetches a registry from the endpoint for its user agent, and fails on an
    # answer of the wrong shape.
    token = None if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN else huggingface_hub.get_token()
    bare = {"user-agent": f"{GENERATOR}; hf_hub/{huggingface_hub.__version__}"}
    headers = dict(bare, authorization=f"Bearer {token}") if token else bare
    home = _origin(httpx.URL(endpoint))
    with httpx.Client(follow_redirects=True) as client:
        return {(task, sort): _listing(client, endpoint, lambda url: headers if _origin(url) == home else bare,
                                       task, sort, limit, deadline, late)
                for task in tasks for sort, _, _ in ORDERS.values()}


def _listing(client, endpoint: str, headers_for, task: str, sort: str, limit: int, deadline: float,
             late: UserError) -> tuple[list[dict], int]:
    """One listing of the Hub, as {id, downloads, trending_score, likes}, following its Link: rel="next" pages for
    at most MAX_PAGES pages; ids that are not text are left out, numbers out of range not recorded (counted)."""
    import httpx

    where = f"{task} models by {sort} on {endpoint}"
    url = httpx.URL(endpoint.rstrip("/") + "/api/models")
    params = [("pipeline_tag", task), ("sort", sort), ("limit", str(limit)), *(("expand", e) for e in EXPAND)]
    out, dropped = [], 0
    for _ in range(MAX_PAGES):
        try:
            items, url = _page(client, url, params, headers_for(url), deadline, late)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  httpx, a bad Link, JSON (nested past the recursion limit too)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            why = "offline, or the Hub is out of reach" if isinstance(e, httpx.HTTPError) else \
                "its answer cannot be read as a listing of models"
            raise UserError(f"cannot list {where} ({why}): {type(e).__name__}: {first}") from None
        params = None  # a next page's link holds its own query
        for m in items:
            model_id = m.get("id", m.get("modelId")) if isinstance(m, dict) else None
            if not (isinstance(model_id, str) and model_id):
                continue
            model = {"id": model_id}
            for name, key in (("downloads", "downloads"), ("trending_score", "trendingScore"), ("likes", "likes")):
                model[name] = _count(m.get(key))
                dropped += model[name] is None and m.get(key) is not None
            out.append(model)
        if len(out) >= limit or url is None:
            return out[:limit], dropped
    raise UserError(f"the listing of {where} went on past {MAX_PAGES} pages (each naming a next one) with "
                    f"{len(out)} of {limit} models: stopped there, nothing written")


def _page(client, url, params, headers: dict, deadline: float, late: UserError):
    """One page: (its JSON list, the URL of the next page or None). Every read of it ends by the deadline; a body
    over MAX_PAGE_BYTES is refused. UserError for an HTTP error status."""
    import httpx

    left = deadline - time.monotonic()
    if left <= 0:
        raise late
    with client.stream("GET", url, params=params, headers=headers, timeout=httpx.Timeout(min(left, 60.0))) as r:
        if r.status_code >= 400:
            raise UserError(f"cannot list models on {r.url.copy_with(query=None)}: the Hub answered HTTP "
                            f"{r.status_code} {r.reason_phrase}")
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_PAGE_BYTES:
                raise UserError(f"cannot list models on {r.url.copy_with(query=None)}: a page of more than "
                                f"{MAX_PAGE_BYTES // 2**20} MiB, refused")
            if time.monotonic() > deadline:
                raise late
        link = r.links.get("next", {}).get("url")
        next_url = r.url.join(link) if link else None
    items = json.loads(body)
    if not isinstance(items, list):
        raise ValueError(f"a JSON {type(items).__name__}")
    return items, next_url


# ------------------------------------------------------------------------------------------ the file
def _count(v) -> int | float | None:
    """A number from 0 to MAX_COUNT (an int where it is whole), or None: anything else (negative, NaN, infinite,
    past MAX_COUNT such as a 1 followed by 400 zeros, not a number) is not recorded."""
    if type(v) is int:  # the usual case, first
        return v if 0 <= v <= MAX_COUNT else None
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if type(v).__module__ == "numpy":
        v = v.item()
    if isinstance(v, int):  # compared as an int: float() of a 400-digit one would overflow
        return v if 0 <= v <= MAX_COUNT else None
    if not isinstance(v, float) or not 0 <= v <= MAX_COUNT:  # NaN compares false
        return None
    return int(v) if v.is_integer() else v


def _rank(v) -> int | None:
    n = _count(v)
    return int(n) if isinstance(n, int) and n >= 1 else None


def _text(v) -> str | None:
    if type(v) is str:  # the usual case, first
        return v or None
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

            table = pq.read_table(p, use_threads=False)  # no Arrow thread pool left to exit (rows.read_table)
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
    p.add_argument("--timeout_s", type=float, default=TIMEOUT_S,
                   help=f"seconds for the whole command on the Hub: every listing, page and byte together (1-86400; "
                        f"default {TIMEOUT_S})")
    args = p.parse_args(argv)
    try:
        if not 1 <= args.limit <= 1000:
            raise UserError(f"--limit must be between 1 and 1000, got {args.limit}")
        if not 1 <= args.timeout_s <= 86400:  # NaN fails this too
            raise UserError(f"--timeout_s must be between 1 and 86400, got {args.timeout_s:g}")
        tasks = list(dict.fromkeys(args.task))
        path = check_out(args.out)
        doc, dropped = fetch(tasks, args.limit, args.timeout_s)
        try:
            write_rankings(path, doc)
        except OSError as e:
            raise UserError(f"--out {args.out} cannot be written: {e.strerror or e}") from None
        counts = ", ".join(f"{t}: {sum(m['task'] == t for m in doc['models'])}" for t in tasks)
        print(one_line(f"rankings: {path} ({len(doc['models'])} model(s); {counts}; from {doc['endpoint']} at "
                       f"{doc['fetched_at']})" + (f"; {dropped} value(s) out of range (not a number from 0 to 2^53), "
                                                  "not recorded" if dropped else "")))
    except UserError as e:
        print(one_line(f"error: {e}"), file=sys.stderr)
        return 2
    return 0
