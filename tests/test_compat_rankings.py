"""The `rankings` subcommand of examples/generate_compat_check.py against a local server that answers as the Hub's
model listing does (GET /api/models on 127.0.0.1, reached through HF_ENDPOINT: huggingface_hub's own client, not a
patched one), and the lookup's Trending and Downloads views in the terminal. The page's views in a real browser:
tests/test_compat_page.py.

HF_ENDPOINT is read when huggingface_hub is imported, so every `rankings` command here starts as a process of its
own with the variable set (the test process has imported it already).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from common.errors import one_line
from compat_check import lookup, rankings, rows
from conftest import ROOT, assert_clean_error, example_command, run_in_process, script_env

SCRIPT = "generate_compat_check.py"
HOSTILE_ID = "evil/<img src=x onerror=\"window.pwned=1\">"
# The Hub's catalogue, as the server holds it: (id, pipeline_tag, downloads, trendingScore, likes).
CATALOGUE = [
    ("Qwen/Qwen3-0.6B", "text-generation", 9_000_000, 40, 900),
    ("meta-llama/Llama-3.2-1B-Instruct", "text-generation", 7_000_000, 25, 1200),
    ("org/trending-newcomer", "text-generation", 1_000, 95, 30),
    (HOSTILE_ID, "text-generation", 5_000_000, 60, 5),
    ("org/small", "text-generation", 10, 1, 0),
    ("Qwen/Qwen3-VL-2B-Instruct", "image-text-to-text", 800_000, 70, 300),
    ("google/gemma-3-4b-it", "image-text-to-text", 900_000, 20, 400),
    ("org/fill-mask-model", "fill-mask", 99_000_000, 99, 9),
]
SORT_KEYS = {"downloads": 2, "trendingScore": 3, "likes": 4}


class _Hub(BaseHTTPRequestHandler):
    """GET /api/models?pipeline_tag=..&sort=..&limit=..&expand=..: the listing, most first, as a JSON list."""

    requests: list[dict] = []

    def do_GET(self):  # noqa: N802  (http.server's name)
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        type(self).requests.append({"path": url.path, "query": query})
        if url.path != "/api/models":
            self.send_error(404)
            return
        tag = query.get("pipeline_tag", [None])[0]
        models = [m for m in CATALOGUE if tag is None or m[1] == tag]
        sort = query.get("sort", [None])[0]
        if sort in SORT_KEYS:
            models.sort(key=lambda m: m[SORT_KEYS[sort]], reverse=True)
        models = models[: int(query.get("limit", ["1000"])[0])]
        expand = set(query.get("expand", []))
        items = []
        for model_id, pipeline_tag, downloads, trending, likes in models:
            item = {"_id": f"id-{abs(hash(model_id))}", "id": model_id}
            fields = {"downloads": downloads, "trendingScore": trending, "likes": likes, "pipeline_tag": pipeline_tag}
            item.update({k: v for k, v in fields.items() if k in expand})
            items.append(item)
        body = json.dumps(items).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def hub():
    """A local Hub listing on 127.0.0.1 (a free port), for the module's tests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _env(endpoint: str | None, offline: bool = False) -> dict:
    env = script_env()
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HTTP_PROXY",
                "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    env.update(NO_PROXY="127.0.0.1,localhost", HF_HUB_DISABLE_IMPLICIT_TOKEN="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HOME=str(Path(env.get("TMPDIR", "/tmp")) / "hf-home-rankings-test"))
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _rankings(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(example_command(SCRIPT, "rankings", *args), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_rankings_from_a_local_hub_listing(hub, tmp_path):
    _Hub.requests.clear()
    out = tmp_path / "rankings.json"
    proc = _rankings("--task", "text-generation", "--task", "image-text-to-text", "--limit", "3", "--out", str(out),
                     env=_env(hub))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"rankings: {out} (") and "text-generation: " in proc.stdout

    # the client asked as huggingface_hub asks the Hub: one listing per task and order, top 3, the fields we keep
    listings = [r for r in _Hub.requests if r["path"] == "/api/models"]
    asked = [(r["query"]["pipeline_tag"], r["query"]["sort"], r["query"]["limit"]) for r in listings]
    assert asked == [([task], [sort], ["3"]) for task in ("text-generation", "image-text-to-text")
                     for sort in ("downloads", "trendingScore")]
    assert all(set(r["query"]["expand"]) == {"downloads", "likes", "trendingScore", "pipeline_tag"} for r in listings)

    doc = json.loads(out.read_text())
    assert doc["generator"] == rankings.GENERATOR and doc["tasks"] == ["text-generation", "image-text-to-text"]
    assert doc["endpoint"] == hub and doc["limit"] == 3 and doc["fetched_at"]
    text = {m["model_id"]: m for m in doc["models"] if m["task"] == "text-generation"}
    # by downloads: Qwen3-0.6B, Llama, the hostile id; by trending: the newcomer, the hostile id, Qwen3-0.6B
    assert [(m, text[m]["downloads_rank"], text[m]["trending_rank"]) for m in text] == [
        ("Qwen/Qwen3-0.6B", 1, 3), ("meta-llama/Llama-3.2-1B-Instruct", 2, None), (HOSTILE_ID, 3, 2),
        ("org/trending-newcomer", None, 1)]
    assert (text["Qwen/Qwen3-0.6B"]["downloads"], text["Qwen/Qwen3-0.6B"]["trending_score"],
            text["Qwen/Qwen3-0.6B"]["likes"]) == (9_000_000, 40, 900)
    assert "org/small" not in text and not any(m["model_id"] == "org/fill-mask-model" for m in doc["models"])

    # Parquet: the same records; read back (ours or anyone's) by lookup's reader
    parquet = tmp_path / "rankings.parquet"
    proc = _rankings("--task", "text-generation", "--task", "image-text-to-text", "--limit", "3", "--out",
                     str(parquet), env=_env(hub))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = rankings.read_rankings(out), rankings.read_rankings(parquet)
    key = lambda e: {k: v for k, v in e.items() if k != "fetched_at"}  # noqa: E731
    assert [key(e) for e in a.entries] == [key(e) for e in b.entries] and a.tasks == b.tasks
    assert [e["model_id"] for e in a.ranked("trending", "image-text-to-text")] == [
        "Qwen/Qwen3-VL-2B-Instruct", "google/gemma-3-4b-it"]
    # a rerun replaces its own file; nothing else is ever written over
    assert _rankings("--task", "text-generation", "--limit", "2", "--out", str(out), env=_env(hub)).returncode == 0
    assert json.loads(out.read_text())["limit"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rankings_offline_or_unreachable_is_one_line_and_no_file(hub, tmp_path):
    out = tmp_path / "rankings.json"
    proc = _rankings("--task", "text-generation", "--out", str(out), env=_env(hub, offline=True))
    assert proc.returncode == 2
    assert_clean_error(proc, "rankings lists models on the Hub, and HF_HUB_OFFLINE is set (offline)")
    proc = _rankings("--task", "text-generation", "--out", str(out), env=_env(f"http://127.0.0.1:{_free_port()}"))
    assert proc.returncode == 2
    assert_clean_error(proc, "cannot list text-generation models by downloads on http://127.0.0.1:")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_rankings_bad_arguments_are_one_line(tmp_path, capsys):
    """Checked before the Hub is asked (in process: no request is made)."""
    results = tmp_path / "r.parquet"
    rows.write_row(results, {"model_id": "org/m", "result": "PASS"})
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}\n')
    before = {p: p.read_bytes() for p in (results, mine)}
    for args, needle in (
            (["--task", "text-generation", "--out", str(results)], f"--out {results} exists and is not a rankings"),
            (["--task", "text-generation", "--out", str(mine)], f"--out {mine} exists and is not a rankings file"),
            (["--task", "text-generation", "--out", str(tmp_path / "r.csv")], "must end in .json or .parquet"),
            (["--task", "text-generation", "--limit", "0", "--out", str(tmp_path / "x.json")], "--limit must be"),
            (["--task", "fill-mask", "--out", str(tmp_path / "x.json")], "argument --task: invalid choice"),
            (["--out", str(tmp_path / "x.json")], "the following arguments are required: --task")):
        try:
            code = rankings.rankings_main(args)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, (args, err)
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- lookup's ranked views, terminal
def ranked_fixture(folder: Path) -> tuple[Path, Path]:
    """Rows for some ranked models (every result, compile-audit counts on some) and a rankings file whose order
    differs from the rows' order, with models nobody tested and hostile strings."""
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / "results" / "r.parquet"
    for model_id, result, graphs, recompiles in (
            ("meta-llama/Llama-3.2-1B-Instruct", "FAIL", 34, 0), ("Qwen/Qwen3-0.6B", "PASS", 2, 0),
            ("org/dynamic-cache", "PASS", 32, 30), ("org/excluded", "EXCLUDED", None, None)):
        audit = {} if graphs is None else {
            "compile_graphs": graphs, "compile_recompiles": recompiles, "compile_graph_breaks": 0,
            "compile_recompile_reasons": json.dumps([f"forward call {i}: <b>guard</b> size mismatch"
                                                     for i in range(3, 3 + recompiles)]),
            "compile_graph_break_reasons": "{}",
            "compile_audit": json.dumps({"mode": "Dynamo, counting backend", "forward_calls": 32, "seconds": 1.5,
                                         "phases": {"prefill": 1, "first_decode_step": 1,
                                                    "later_decode_steps": recompiles}})}
        rows.write_row(results, {"model_id": model_id, "task": "text-generation", "result": result, "tp": 1,
                                 "exclusion": "no sharding plan" if result == "EXCLUDED" else None, **audit})
    models = [  # (model_id, task, downloads_rank, trending_rank, downloads, trending_score, likes)
        ("org/dynamic-cache", "text-generation", 4, 1, 1_000, 95, 3),
        ("Qwen/Qwen3-0.6B", "text-generation", 1, 3, 9_000_000, 40, 900),
        (HOSTILE_ID, "text-generation", 2, 2, 5_000_000, 60, 5),
        ("meta-llama/Llama-3.2-1B-Instruct", "text-generation", 3, None, 7_000_000, 25, 1200),
        ("org/excluded", "text-generation", 5, 4, 500, 10, 1),
        ("Qwen/Qwen3-VL-2B-Instruct", "image-text-to-text", 1, 1, 800_000, 70, 300),
    ]
    ranks = folder / "rankings.json"
    ranks.write_text(json.dumps({"generator": rankings.GENERATOR, "fetched_at": "2026-12-01T10:00:00+00:00",
                                 "tasks": ["text-generation", "image-text-to-text"], "models": [
        dict(zip(rankings.FIELDS, (*m, "2026-12-01T10:00:00+00:00"))) for m in models]}))
    return results.parent, ranks


def test_lookup_trending_and_downloads_in_the_terminal(tmp_path, capsys):
    results, ranks = ranked_fixture(tmp_path)

    def run(*argv: str) -> tuple[int, list[str], str]:
        code = lookup.lookup_main([str(results), "--rankings", str(ranks), *argv])
        captured = capsys.readouterr()
        return code, captured.out.splitlines(), captured.err

    code, lines, err = run("--view", "downloads")
    assert code == 0 and not err, err
    ids = [line.split()[1] for line in lines[1:-1]]
    assert ids == ["Qwen/Qwen3-0.6B", "evil/<img", "meta-llama/Llama-3.2-1B-Instruct", "org/dynamic-cache",
                   "org/excluded"]
    assert [line.split()[0] for line in lines[1:-1]] == ["1", "2", "3", "4", "5"]
    hostile = lines[2]
    assert "not tested" in hostile and "5000000" in hostile  # its rank and downloads, no verdict
    assert lines[-1] == (f"downloads for text-generation (5 ranked model(s), {ranks}, fetched "
                         "2026-12-01T10:00:00+00:00): 2 PASS, 1 FAIL, 1 EXCLUDED, 1 not tested (neither PASS nor FAIL; EXCLUDED and not tested "
                         "are not failures)")
    code, lines, _ = run()  # --rankings alone: trending, the rankings' first task
    assert [line.split()[1] for line in lines[1:-1]] == ["org/dynamic-cache", "evil/<img", "Qwen/Qwen3-0.6B",
                                                         "org/excluded"]
    assert lines[-1].startswith("trending for text-generation (4 ranked model(s)")
    code, lines, _ = run("--task", "image-text-to-text")
    assert "not tested" in lines[1] and lines[-1].endswith("0 PASS, 0 FAIL, 0 EXCLUDED, 1 not tested (neither PASS "
                                                           "nor FAIL; EXCLUDED and not tested are not failures)")
    # compiles once: audited rows without a recompile after the first decode step, nothing untested
    code, lines, _ = run("--view", "downloads", "--compiles_once")
    assert [line.split()[1] for line in lines[1:-1]] == ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B-Instruct"]
    assert lookup.lookup_main([str(results), "--compiles_once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 row(s): 1 PASS, 1 FAIL, 0 EXCLUDED (not failures)"
    assert "graphs" in lines[0] and "recompiles" in lines[0] and "graph_breaks" in lines[0]


def test_lookup_rankings_errors_are_one_line(tmp_path):
    """The lookup's command line (its __main__, in this process: it reads files and starts nothing)."""
    results, ranks = ranked_fixture(tmp_path)
    proc = run_in_process(SCRIPT, "lookup", str(results), "--view", "trending")
    assert proc.returncode == 2
    assert_clean_error(proc, "--view trending needs --rankings FILE: write one where the Hub is reachable")
    not_rankings = tmp_path / "not.json"
    not_rankings.write_text("{not json")
    proc = run_in_process(SCRIPT, "lookup", str(results), "--rankings", str(not_rankings))
    assert proc.returncode == 2
    assert_clean_error(proc, f"--rankings {not_rankings} is not a rankings file (JSON or Parquet)")
    page = tmp_path / "page.html"
    proc = run_in_process(SCRIPT, "lookup", str(results), "--rankings", str(ranks), "--html", str(ranks))
    assert proc.returncode == 2 and json.loads(ranks.read_text())["generator"] == rankings.GENERATOR
    proc = run_in_process(SCRIPT, "lookup", str(results), "--rankings", str(ranks), "--html", str(page))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == f"page: {page} (4 rows)", proc.stderr


def test_rankings_reader_takes_anyones_file(tmp_path):
    """A file without rank fields is ranked by its numbers; records without an id or task are skipped; numbers
    that are not finite and non-negative are not recorded."""
    path = tmp_path / "theirs.json"
    path.write_text(json.dumps([
        {"model_id": "a/low", "task": "text-generation", "downloads": 5, "trending_score": "9"},
        {"model_id": "a/high", "task": "text-generation", "downloads": 50, "trending_score": -1, "likes": "lots"},
        {"model_id": None, "task": "text-generation"}, {"task": "text-generation"}, "not a record"]))
    r = rankings.read_rankings(path)
    assert r.skipped == 3 and r.tasks == ["text-generation"]
    assert [e["model_id"] for e in r.ranked("downloads", "text-generation")] == ["a/high", "a/low"]
    assert [e["model_id"] for e in r.ranked("trending", "text-generation")] == ["a/low"]
    assert r.entries[1]["likes"] is None and r.entries[1]["trending_score"] is None


# --------------------------------------------------------------------------- a hostile Hub
class _Hostile(BaseHTTPRequestHandler):
    """A listing server that misbehaves as `answer(handler)` says; it records what it was sent (path, headers)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait for the client's ACK between
    answer = None  # set per test on a subclass
    seen: list[dict] = []

    def do_GET(self):  # noqa: N802  (http.server's name)
        type(self).seen.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
        type(self).answer(self)

    def json(self, items, link: str | None = None, length: int | None = None) -> bytes:
        body = json.dumps(items).encode() if not isinstance(items, bytes) else items
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        if link:
            self.send_header("Link", f'<{link}>; rel="next"')
        self.end_headers()
        return body

    def log_message(self, *args):  # quiet
        pass


class _Serving:
    """A _Hostile subclass answering with `answer`, served on `host` (a free port) in a thread, for one `with`."""

    def __init__(self, answer, host: str = "127.0.0.1", port: int = 0):
        self.handler = type("Handler", (_Hostile,), {"answer": staticmethod(answer), "seen": []})
        self.server = ThreadingHTTPServer((host, port), self.handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    @property
    def seen(self) -> list[dict]:
        return self.handler.seen


def test_rankings_numbers_out_of_range_are_not_recorded(tmp_path, capsys):
    """A count of 1 followed by 400 zeros (as the Hub would send it, or in a rankings file) is not recorded: it is
    past what a float64 holds exactly, like a negative or NaN one."""
    huge = 10**400

    def answer(h):
        models = [{"id": "org/huge", "downloads": huge, "likes": huge, "trendingScore": huge},
                  {"id": "org/fine", "downloads": 7, "likes": 2, "trendingScore": 1.5}]
        h.wfile.write(h.json(models))

    out = tmp_path / "rankings.json"
    with _Serving(answer) as hub:
        proc = _rankings("--task", "text-generation", "--limit", "2", "--out", str(out), env=_env(hub.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "6 value(s) out of range" in proc.stdout, proc.stdout  # 3 numbers, in both listings
    models = {m["model_id"]: m for m in json.loads(out.read_text())["models"]}
    assert [models["org/huge"][k] for k in ("downloads", "likes", "trending_score")] == [None, None, None]
    assert [models["org/fine"][k] for k in ("downloads", "likes", "trending_score")] == [7, 2, 1.5]

    # lookup --rankings reading such a file (anyone's)
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps([{"model_id": "org/huge", "task": "text-generation", "downloads": huge,
                                   "downloads_rank": huge, "trending_rank": 1, "likes": huge},
                                  {"model_id": "org/fine", "task": "text-generation", "downloads": 5,
                                   "downloads_rank": 1, "trending_rank": 2}]))
    results = tmp_path / "results.parquet"
    rows.write_row(results, {"model_id": "org/fine", "task": "text-generation", "result": "PASS"})
    assert lookup.lookup_main([str(results), "--rankings", str(theirs), "--view", "downloads"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:-1]] == [["1", "org/fine"]]  # no downloads rank: not in the view
    assert lookup.lookup_main([str(results), "--rankings", str(theirs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:4] for line in lines[1:-1]] == [["1", "org/huge", "not", "tested"], ["2", "org/fine",
                                                                                            "PASS", "5"]]
    assert lines[1].split()[4:6] == ["-", "-"]  # downloads and trending: not recorded


def test_rankings_stop_after_a_bounded_number_of_pages(tmp_path):
    """A server that answers an empty page with a Link to the next one, again and again (bounded here at 5000
    answers), gets one `error:` line after rankings.MAX_PAGES pages, not an endless loop."""

    def answer(h):
        page = len(h.server.RequestHandlerClass.seen)
        more = page < 5000
        h.wfile.write(h.json([], link=f"http://127.0.0.1:{h.server.server_address[1]}/api/models?cursor={page}"
                             if more else None))

    out = tmp_path / "rankings.json"
    with _Serving(answer) as hub:
        proc = _rankings("--task", "text-generation", "--limit", "3", "--out", str(out), env=_env(hub.url))
        asked = len(hub.seen)
    assert proc.returncode == 2, (asked, proc.stdout[-2000:], proc.stderr[-3000:])
    assert_clean_error(proc, f"went on past {rankings.MAX_PAGES} pages")
    assert asked == rankings.MAX_PAGES and not out.exists()


def test_rankings_have_an_overall_deadline(tmp_path):
    """A server that trickles its answer, one byte every 2 s (each read succeeds, so no per-read timeout fires),
    is cut off at --timeout_s with one `error:` line."""
    stop = threading.Event()

    def answer(h):
        h.json(b"", length=1000)  # headers that promise 1000 bytes
        for _ in range(60):  # bounded: 2 minutes at most
            if stop.wait(2):
                return
            try:
                h.wfile.write(b" ")
                h.wfile.flush()
            except OSError:  # the client gave up
                return

    out = tmp_path / "rankings.json"
    with _Serving(answer) as hub:
        try:
            proc = subprocess.run(example_command(SCRIPT, "rankings", "--task", "text-generation", "--timeout_s", "3",
                                                  "--out", str(out)),
                                  cwd=ROOT, env=_env(hub.url), capture_output=True, text=True, timeout=90)
        finally:
            stop.set()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_clean_error(proc, "no complete answer from", "within --timeout_s 3")
    assert not out.exists()


def test_the_token_goes_only_to_the_endpoint_it_was_given_for(tmp_path):
    """HF_TOKEN is sent to HF_ENDPOINT's origin (scheme, host and port) only: a Link to the next page on another
    port of the same host, and from there one on another host, are followed without it (one rankings command
    over three pages)."""
    token = "hf_secret_token_for_the_endpoint_only"

    def third_page(h):  # another host
        h.wfile.write(h.json([{"id": "org/third", "downloads": 1}]))

    def second_page(h):  # the endpoint's host, another port
        h.wfile.write(h.json([{"id": "org/second", "downloads": 2}], link=f"{other_host.url}/api/models?cursor=3"))

    def first_page(h):
        h.wfile.write(h.json([{"id": "org/first", "downloads": 3}], link=f"{other_port.url}/api/models?cursor=2"))

    with _Serving(third_page, "127.0.0.2") as other_host, _Serving(second_page, "127.0.0.1") as other_port, \
            _Serving(first_page) as hub:
        env = dict(_env(hub.url), HF_TOKEN=token, NO_PROXY="127.0.0.1,127.0.0.2,localhost")
        env.pop("HF_HUB_DISABLE_IMPLICIT_TOKEN")
        proc = _rankings("--task", "text-generation", "--limit", "5", "--out", str(tmp_path / "r.json"), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.seen and all(s["headers"].get("authorization") == f"Bearer {token}" for s in hub.seen)
    for elsewhere in (other_port, other_host):
        assert elsewhere.seen, "the Link to the next page was not followed"
        assert not any(token in json.dumps(s) for s in elsewhere.seen), elsewhere.seen
    ids = {m["model_id"] for m in json.loads((tmp_path / "r.json").read_text())["models"]}
    assert ids == {"org/first", "org/second", "org/third"}


def test_ranked_ids_with_control_characters_are_told_apart(tmp_path, capsys):
    """Two ids that differ after a newline are two lines that differ: control characters shown as U+FFFD (as
    common.errors.one_line shows them), not the id cut at its first line."""
    theirs = tmp_path / "theirs.json"
    ids = ["org/model\nevil", "org/model\nother", "org/model\x1b[2Jx"]
    theirs.write_text(json.dumps([{"model_id": m, "task": "text-generation", "downloads": 10 - i}
                                  for i, m in enumerate(ids)]))
    results = tmp_path / "results.parquet"
    rows.write_row(results, {"model_id": "org/model\nevil", "task": "text-generation", "result": "PASS"})
    for view in ("downloads", "rows"):
        argv = [str(results), *(["--rankings", str(theirs), "--view", view] if view != "rows" else [])]
        assert lookup.lookup_main(argv) == 0
        lines = capsys.readouterr().out.splitlines()[1:-1]  # the table's lines: below the header, above the summary
        if view == "rows":  # and above the line that says no shared compile cache is recorded
            assert lines.pop() == "no shared compile cache recorded: 1 of 1 row(s)"
        shown = [line.split()[1 if view != "rows" else 0] for line in lines]
        assert shown == ([one_line(m) for m in ids] if view != "rows" else [one_line(ids[0])]), shown


def test_sigterm_to_rankings_is_one_line_and_128_plus_the_signal(tmp_path):
    """The compatibility check's rule for a stop signal holds for its subcommands too: SIGTERM while `rankings`
    waits on the Hub ends it at once with one `error: interrupted by SIGTERM` line, exit 143, nothing written."""
    stop, asked = threading.Event(), threading.Event()

    def answer(h):
        asked.set()
        stop.wait(60)  # bounded: no answer for a minute at most

    out = tmp_path / "rankings.json"
    with _Serving(answer) as hub:
        proc = subprocess.Popen(example_command(SCRIPT, "rankings", "--task", "text-generation", "--out", str(out)),
                                cwd=ROOT, env=_env(hub.url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert asked.wait(60), "rankings never asked the server"
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, stderr[-3000:])
    assert_clean_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                       "error: interrupted by SIGTERM")
    assert not out.exists()
