"""The static lookup page: one self-contained HTML file (data embedded, no server, no network) that
offers what the public lookup does: search by part of a model id, filters for the neuronx-cc and
Transformers versions, the task, the result and the compile audit, a "Selected" view (a curated list), an "All"
view, and "Trending" and "Downloads" views that follow the Hub's rankings for one task (a rankings file: a ranked
model without a row is "not tested", neither PASS nor FAIL; without the file those views say how to get one), and
per model the result, cores, wall time, memory, compile audit, version stack, packages, error, run.py and how to
reproduce the run.

Every value from a results file is untrusted. The data travels as JSON inside a
<script type="application/json"> element with <, > and & written as \\u escapes, so no value can close
that element; the page's script builds every cell with textContent, never as HTML; and a
Content-Security-Policy allows only the page's own script and style (by hash), no network at all.
The Reproduce block quotes every value, and shows a row's rerun command only when its `run_args` are a plain
list of the script's flags that its parser accepts (`rerun`), and the command that pulls its compiled graphs for its
compiler where it records a shared compile cache (`pull_command`). The page is meant to be shared: this machine's home
folder and the set-up's cache are written as `~` and `$QWEN3_RECIPES_CACHE` wherever a value names them. The page
is written only as a new file or over a page this module wrote (GENERATOR, check_target), never over a results file
it read, never through a symbolic link, and a FIFO of that name is never opened.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import shlex
import stat
from datetime import datetime, timezone
from pathlib import Path

from common.errors import UserError
from common.harness.compile_cache import key_from_versions
from compat_check.rows import COLUMNS

GENERATOR = '<meta name="generator" content="qwen3-trainium-recipes compat lookup">'  # in every page's <head>

# What the page shows of a row (run_py goes into a table of distinct texts: a run writes the same
# script into every row, and 10,000 copies of it would make the page hundreds of megabytes).
PAGE_COLUMNS = tuple(c for c in COLUMNS if c not in ("run_py",)) + ("source_file",)


def _cell(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    if hasattr(v, "isoformat"):  # a timestamp
        return v.isoformat() if str(v) != "NaT" else None
    if type(v).__module__ == "numpy":
        v = v.item()
    return v if isinstance(v, (str, int, float, bool)) else str(v)


def _cells(values: list) -> list:
    """`_cell` of each value, without a call for the values it leaves as they are (text, whole numbers, null)."""
    return [v if v is None or type(v) is str or type(v) is int else _cell(v) for v in values]


def _local_prefixes() -> list[tuple[str, str]]:
    """This machine's folders a shared page should not show, longest first, with what stands for them: the set-up's
    cache (judge models, assets) and the home folder (a user name)."""
    cache = os.environ.get("QWEN3_RECIPES_CACHE") or str(Path.home() / ".cache" / "qwen3-trainium-recipes")
    pairs = [(os.path.abspath(cache), "$QWEN3_RECIPES_CACHE"), (str(Path.home()), "~")]
    return sorted({p: s for p, s in pairs if p not in ("", "/")}.items(), key=lambda ps: -len(ps[0]))


def shareable(text, prefixes: list[tuple[str, str]]):
    """`text` with each local folder of `prefixes` (a path beginning there) written as what stands for it."""
    if type(text) is not str:
        return text
    for prefix, stand_in in prefixes:
        if prefix in text:
            text = text.replace(prefix + "/", stand_in + "/").replace(prefix + '"', stand_in + '"')
            text = stand_in if text == prefix else text
    return text


def _shell_word(word: str) -> str:
    """One word of a command a user may copy, quoted (shlex.quote); a path in the home folder as `~/` and the rest
    quoted, so that the shell of whoever copies it finds it in their own home, and this one's is not shown."""
    home = str(Path.home())
    if home not in ("", "/") and word.startswith(home + "/"):
        return "~/" + shlex.quote(word[len(home) + 1:])
    return shlex.quote(word)


# What a row records of its stack, by the names of the compile cache's key parts (common/harness/compile_cache.py).
KEY_COLUMNS = {"neuronx-cc": "neuronx_cc", "torch-neuronx": "torch_neuronx", "torch": "torch", "python": "python"}
PULL_READS = ("compile_cache_url", "device", *KEY_COLUMNS.values())  # the columns a pull command is made of


def pull_command(url, device, versions: dict) -> tuple[str | None, str | None]:
    """(the command that pulls a row's compiled graphs from its shared compile cache, the key it pulls), or (None,
    None) where the row records no shared cache URL or one that is not one printable line. The key is the one the
    row's versions give (common.harness.compile_cache.key_from_versions): the command refuses to run on a host of
    another key, so graphs are pulled only for the compiler that made them. A row that does not record every part
    of its key (a CUDA row: Triton and CUDA) gives the command without --key: it pulls the key of the host it runs
    on, for the row's device. `device`: the row's (None in the public files, whose rows all ran on Trainium). Every
    word quoted (shlex.quote, as the rerun command), this machine's home folder as ~."""
    if type(url) is not str or not url.strip() or not url.isprintable():
        return None, None
    device = device if type(device) is str else "neuron" if versions.get("neuronx-cc") else None
    key = key_from_versions(device, versions) if device else None
    words = ["python", "-m", "tools.compile_cache", "pull", url.strip()]
    words += ["--device", device] if device in ("cpu", "cuda", "neuron") else []
    words += ["--key", key] if key else []
    return " ".join(map(_shell_word, words)), key


def pull_cells(df) -> tuple[list, list]:
    """`pull_command` of every row of `df` (its `pull` and `pull_key` cells): each distinct stack once."""
    if "compile_cache_url" not in df.columns:
        return [None] * len(df), [None] * len(df)
    names = [c for c in PULL_READS if c in df.columns]
    made: dict = {}
    commands, keys = [], []
    for values in zip(*(df[c].tolist() for c in names)):
        if values not in made:
            row = dict(zip(names, values))
            made[values] = pull_command(row.get("compile_cache_url"), row.get("device"),
                                        {part: row.get(col) for part, col in KEY_COLUMNS.items()})
        commands.append(made[values][0])
        keys.append(made[values][1])
    return commands, keys


def _column(df, name: str, prefixes: list[tuple[str, str]] = ()) -> list:
    """Column `name` of `df` as the page's cells (`_cell` of each value, local folders as `shareable` writes them),
    or nulls where `df` has no such column."""
    if name not in df.columns:
        return [None] * len(df)
    series = df[name]
    if series.dtype == "float64":  # Python floats: a cell where finite, else null (as _cell)
        return [v if math.isfinite(v) else None for v in series.tolist()]
    cells = _cells(series.tolist())
    return [shareable(v, prefixes) for v in cells] if prefixes else cells


def rankings_data(rankings) -> dict | None:
    """The rankings the page embeds (rankings.Rankings), or None: the Trending and Downloads views then say how to
    write a rankings file."""
    if rankings is None:
        return None
    from compat_check.rankings import FIELDS

    columns = [_cells([e[c] for e in rankings.entries]) for c in FIELDS]  # a field at a time
    return {"source": rankings.source, "fetched_at": rankings.fetched_at, "tasks": rankings.tasks,
            "columns": list(FIELDS), "entries": [list(entry) for entry in zip(*columns)]}


def page_data(df, selected: tuple[str, ...], sources: list[str], rerun=None, rankings=None) -> dict:
    """The JSON the page embeds: column names, one list per row, distinct run_py texts, the curated list.
    `rerun(run_args)` gives the argv that reruns a row, or None where run_args are not a plain list of the
    script's flags: the row's `rerun` cell is then null ("not reproducible from this row"), else the command,
    every word quoted (shlex.join). Built a column at a time (a row at a time took seconds for 100,000 rows)."""
    texts: dict[str, int] = {}
    commands: dict = {}
    run_args = df["run_args"].tolist() if "run_args" in df.columns else [None] * len(df)
    for args in run_args:  # a run's rows share their flags: each distinct text parsed once
        if isinstance(args, str) and args not in commands:
            argv = rerun(args) if rerun else None
            commands[args] = " ".join(map(_shell_word, ["python", "generate_compat_check.py", *argv])) if argv else None
    rerun_cells = [commands.get(args) if isinstance(args, str) else None for args in run_args]
    run_py = df["run_py"].tolist() if "run_py" in df.columns else [None] * len(df)
    text_cells = [texts.setdefault(t, len(texts)) if isinstance(t, str) and t else None for t in run_py]
    local = _local_prefixes()  # a page is meant to be shared: this machine's cache and home folders not named
    pulls, pull_keys = pull_cells(df)
    rows = [list(row) for row in zip(*(_column(df, c, local) for c in PAGE_COLUMNS),
                                     rerun_cells, pulls, pull_keys, text_cells)]
    return {"columns": [*PAGE_COLUMNS, "rerun", "pull", "pull_key", "run_py"], "rows": rows,
            "texts": [shareable(t, local) for t in texts], "selected": list(selected),
            "sources": [shareable(str(s), local) for s in sources], "rankings": rankings_data(rankings),
            "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def script_json(data: dict) -> str:
    """JSON that cannot end the <script> element holding it, whatever the strings in it say."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def render(data: dict, title: str = "Trainium compatibility lookup") -> str:
    csp = (f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
           "img-src data:; base-uri 'none'; form-action 'none'")
    return PAGE.format(csp=html.escape(csp), generator=GENERATOR, title=html.escape(title), style=STYLE,
                       script=SCRIPT, data=script_json(data))


def check_target(path: str | Path, inputs: list[Path]) -> None:
    """Refuse (UserError) to write the page through a symbolic link (to a page of ours, to nothing: the link is
    never followed), over a FIFO, folder, socket or device (never opened: a FIFO would wait for a writer forever),
    over one of the files it reads, or over an existing file that is not a page this module wrote (one whose <head>
    holds GENERATOR): a new file, or our own page, only."""
    from common.results import not_a_file

    path = Path(path)
    if path.is_symlink():
        raise UserError(f"--html {path} is a symbolic link: the page is never written through one; name a new file "
                        "for the page")
    if not os.path.lexists(path):
        return
    if (kind := not_a_file(path)) is not None:  # not a link (above): what is there itself
        raise UserError(f"--html {path} is {kind}, not a page this lookup wrote: it is left alone; name a new file "
                        "for the page")
    if any(f.exists() and os.path.samefile(path, f) for f in inputs):
        raise UserError(f"--html {path} is one of the results files this lookup reads: name a new file for the page")
    try:  # no link followed and no wait, should something else be put there meanwhile
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # not readable, or replaced by a link
        fd = None
    head = ""
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                head = f.read(4096).decode("utf-8", errors="replace").split("</head>")[0]
    if not (head.startswith("<!DOCTYPE html>") and GENERATOR in head):
        raise UserError(f"--html {path} exists and is not a page this lookup wrote: name a new file for the page, "
                        "or remove that one first")


def write_page(df, path: str | Path, selected: tuple[str, ...], sources: list[str], rerun=None,
               rankings=None) -> Path:
    from common.results import atomic_write_text

    path = Path(path)
    atomic_write_text(path, render(page_data(df, selected, sources, rerun, rankings)))
    return path


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
{generator}
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<header>
<h1>{title}</h1>
<p class="lede">Short reproducible runs: 32 greedy tokens per model on the fewest cores that hold it. A single-core
run must match CPU token for token; a sharded run must read as English. A PASS says nothing about throughput or
long outputs. Wall time includes compilation.</p>
</header>
<main>
<div class="views" role="group" aria-label="View">
<button id="view-selected" type="button" aria-pressed="true">Selected</button>
<button id="view-all" type="button" aria-pressed="false">All</button>
<button id="view-trending" type="button" aria-pressed="false">Trending</button>
<button id="view-downloads" type="button" aria-pressed="false">Downloads</button>
</div>
<form id="filters" class="filters" autocomplete="off">
<label>Model <input id="q" type="search" placeholder="part of a model id, e.g. qwen3"></label>
<label>neuronx-cc <select id="compiler"></select></label>
<label>Transformers <select id="transformers"></select></label>
<label>Task <select id="task"></select></label>
<label>Result <select id="result"></select></label>
<label>Compile audit <select id="audit"></select></label>
</form>
<p id="count" class="count" aria-live="polite"></p>
<p id="empty-note" class="note" hidden></p>
<table id="table">
<thead><tr><th class="rank-col">Rank</th><th>Model</th><th class="task-col">Task</th><th>Result</th>
<th class="rank-col">Downloads</th><th class="rank-col">Trending score</th><th>Cores</th>
<th>Wall time (s, incl. compilation)</th><th>Peak device memory (GiB)</th><th>Compile audit (graphs)</th>
<th>neuronx-cc</th><th>Transformers</th></tr></thead>
<tbody id="rows"></tbody>
</table>
<p><button id="more" type="button" hidden>Show more</button></p>
</main>
<footer id="footer"></footer>
<script type="application/json" id="compat-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""

STYLE = """
:root{--fg:#1b1f24;--muted:#57606a;--line:#d0d7de;--bg:#fff;--alt:#f6f8fa;--pass:#1a7f37;--fail:#cf222e;--excl:#8250df}
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header,main,footer{max-width:1200px;margin:0 auto;padding:0 16px}
h1{font-size:1.4rem;margin:16px 0 4px}
.lede,.count,.note,footer{color:var(--muted);font-size:.9rem;overflow-wrap:anywhere}
.views button{font:inherit;padding:6px 14px;border:1px solid var(--line);background:var(--alt);cursor:pointer}
.views button[aria-pressed=true]{background:var(--fg);color:#fff}
.filters{display:flex;flex-wrap:wrap;gap:8px 16px;margin:12px 0}
.filters label{display:flex;flex-direction:column;font-size:.8rem;color:var(--muted)}
.filters input,.filters select{font:inherit;padding:5px 6px;min-width:11rem;border:1px solid var(--line);
 border-radius:4px}
table{width:100%;border-collapse:collapse}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-size:.8rem;color:var(--muted);font-weight:600}
td.num{font-variant-numeric:tabular-nums}
button.model{font:inherit;background:none;border:0;padding:0;color:#0969da;cursor:pointer;text-align:left;
 word-break:break-all}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:.8rem;font-weight:600;color:#fff}
.badge.pass{background:var(--pass)}.badge.fail{background:var(--fail)}.badge.excluded{background:var(--excl)}
.badge.unknown{background:var(--muted)}
.badge.untested{background:#fff;color:var(--muted);border:1px dashed var(--muted)}
tr.untested td{color:var(--muted);font-style:italic}
.rank-col{display:none}
table.ranked .rank-col{display:table-cell}
table.ranked .task-col{display:none}
.filters select{max-width:20rem}
td.audit.recompiles{color:var(--fail);font-weight:600}
.why{display:block;color:var(--muted);font-size:.8rem}
tr.detail td{background:var(--alt)}
.detail h3{font-size:.95rem;margin:12px 0 4px}
.detail dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0}
.detail dt{color:var(--muted)}.detail dd{margin:0;word-break:break-word}
pre{background:#fff;border:1px solid var(--line);padding:8px;overflow:auto;max-height:28rem;white-space:pre-wrap;
 word-break:break-word;font-size:.8rem}
@media (max-width:720px){
 thead{display:none}
 table,tbody,tr,td{display:block;width:100%}
 tr.row{border:1px solid var(--line);border-radius:6px;margin:8px 0;padding:4px}
 td{border:0;padding:2px 6px}
 td[data-label]::before{content:attr(data-label) ": ";color:var(--muted);font-size:.8rem}
 table.ranked .rank-col{display:block}
 .detail dl{grid-template-columns:1fr}
}
"""

SCRIPT = r"""
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("compat-data").textContent);
  const COL = {};
  DATA.columns.forEach(function (c, i) { COL[c] = i; });
  const ROWS = DATA.rows;
  const SELECTED = new Set(DATA.selected);
  const RANKS = DATA.rankings;  // null: no rankings file was given
  const RCOL = {};
  if (RANKS) RANKS.columns.forEach(function (c, i) { RCOL[c] = i; });
  const RANKED = {trending: "trending_rank", downloads: "downloads_rank"};  // view -> the rank it follows
  const VIEWS = ["selected", "all", "trending", "downloads"];
  const NAMES = {selected: "Selected", all: "All", trending: "Trending", downloads: "Downloads"};
  const PAGE = 200;
  const state = {view: "selected", q: "", compiler: "", transformers: "", task: "", result: "", audit: "",
                 shown: PAGE, open: new Set()};
  const $ = function (id) { return document.getElementById(id); };
  function get(r, c) { const v = r[COL[c]]; return v === undefined ? null : v; }
  function rget(e, c) { const v = e[RCOL[c]]; return v === undefined ? null : v; }
  function text(v) { return v === null || v === undefined || v === "" ? "-" : String(v); }
  function el(tag, cls, content) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (content !== undefined) e.textContent = content;
    return e;
  }
  function compilerOf(r) { return get(r, "neuronx_cc") || "none"; }
  function transformersOf(r) { return get(r, "transformers") || get(r, "library_version") || "unknown"; }
  function taskOf(r) { return get(r, "task") || "text-generation"; }
  function resultOf(r) { return get(r, "result") || "unknown"; }
  function auditOf(r) {
    if (typeof get(r, "compile_graphs") !== "number") return "not audited";
    return get(r, "compile_recompiles") === 0 ? "compiles once" : "recompiles";
  }
  const BADGE = {PASS: "pass", FAIL: "fail", EXCLUDED: "excluded"};
  const UNTESTED = "not tested";

  function fillSelect(id, label, values, extra) {
    const s = $(id);
    s.appendChild(new Option(label ? "any " + label : "any", ""));
    Array.from(new Set(values)).sort().concat(extra || []).forEach(function (v) { s.appendChild(new Option(v, v)); });
    s.addEventListener("change", function () { state[id] = s.value; state.shown = PAGE; render(); });
  }
  const rankedTasks = RANKS ? RANKS.tasks : [];
  fillSelect("compiler", "version", ROWS.map(compilerOf));
  fillSelect("transformers", "version", ROWS.map(transformersOf));
  fillSelect("task", "task", ROWS.map(taskOf).concat(rankedTasks));
  fillSelect("result", "result", ROWS.map(resultOf), RANKS ? [UNTESTED] : []);
  fillSelect("audit", "", ["compiles once", "recompiles", "not audited"]);
  $("q").addEventListener("input", function () { state.q = $("q").value.trim().toLowerCase(); state.shown = PAGE;
                                                 render(); });
  $("filters").addEventListener("submit", function (e) { e.preventDefault(); });
  function setView(v) {
    state.view = v; state.shown = PAGE;
    VIEWS.forEach(function (w) { $("view-" + w).setAttribute("aria-pressed", String(v === w)); });
    render();
  }
  VIEWS.forEach(function (w) { $("view-" + w).addEventListener("click", function () { setView(w); }); });
  $("more").addEventListener("click", function () { state.shown += PAGE; render(); });

  function tested(r) {  // a row of the versions asked for: the model is tested with them
    if (state.compiler && compilerOf(r) !== state.compiler) return false;
    return !(state.transformers && transformersOf(r) !== state.transformers);
  }
  function verdict(r) { return (!state.result || resultOf(r) === state.result) &&
                               (!state.audit || auditOf(r) === state.audit); }
  function matches(r) {
    if (state.view === "selected" && !SELECTED.has(get(r, "model_id"))) return false;
    if (state.q && String(get(r, "model_id") || "").toLowerCase().indexOf(state.q) < 0) return false;
    if (state.task && taskOf(r) !== state.task) return false;
    return tested(r) && verdict(r);
  }
  // The task a ranked view shows: the Task filter's, else the rankings' first (the Hub ranks one task at a time).
  function rankedTask() { return state.task || (rankedTasks.length ? rankedTasks[0] : "text-generation"); }
  const BY_MODEL = new Map();  // task + NUL + model id -> row indices, in file order
  ROWS.forEach(function (r, i) {
    const k = taskOf(r) + "\u0000" + get(r, "model_id");
    if (!BY_MODEL.has(k)) BY_MODEL.set(k, []);
    BY_MODEL.get(k).push(i);
  });
  // Lines of a view: {row: index or null ("not tested"), entry: a ranking entry or null}.
  function lines() {
    const out = [];
    if (!RANKED[state.view]) {
      for (let i = 0; i < ROWS.length; i++) if (matches(ROWS[i])) out.push({row: i, entry: null});
      return out;
    }
    if (!RANKS) return out;
    const key = RANKED[state.view], task = rankedTask();
    const entries = RANKS.entries.filter(function (e) {
      return rget(e, "task") === task && typeof rget(e, key) === "number";
    });
    entries.sort(function (a, b) { return rget(a, key) - rget(b, key); });
    entries.forEach(function (e) {
      const id = String(rget(e, "model_id"));
      if (state.q && id.toLowerCase().indexOf(state.q) < 0) return;
      const rows = (BY_MODEL.get(task + "\u0000" + id) || []).filter(function (i) { return tested(ROWS[i]); });
      rows.forEach(function (i) { if (verdict(ROWS[i])) out.push({row: i, entry: e}); });
      const untestedShown = (!state.result || state.result === UNTESTED) &&
                            (!state.audit || state.audit === "not audited");
      if (!rows.length && untestedShown) out.push({row: null, entry: e});  // no row with these versions
    });
    return out;
  }
  function num(v, digits) { return typeof v === "number" ? v.toFixed(digits) : "-"; }
  function count(v) { return typeof v === "number" ? Math.round(v).toLocaleString("en-US") : "-"; }
  function badge(r) {
    const td = el("td");
    td.setAttribute("data-label", "Result");
    if (r === null) {
      td.appendChild(el("span", "badge untested", UNTESTED));
      td.appendChild(el("span", "why", "no row for this model and task: neither PASS nor FAIL"));
      return td;
    }
    td.appendChild(el("span", "badge " + (BADGE[resultOf(r)] || "unknown"), resultOf(r)));
    if (get(r, "unavailable") === true) td.appendChild(el("span", "why", "not fetched: no verdict"));
    else if (resultOf(r) === "EXCLUDED") td.appendChild(el("span", "why", "excluded, not a failure"));
    return td;
  }
  function cell(label, value, cls) {
    const td = el("td", cls, value);
    td.setAttribute("data-label", label);
    return td;
  }
  function auditText(r) {
    const g = get(r, "compile_graphs");
    if (typeof g !== "number") return "-";
    const rc = get(r, "compile_recompiles"), b = get(r, "compile_graph_breaks");
    return g + " graph(s), " + (rc ? rc + " recompile(s)" : "compiles once") +
           (typeof b === "number" && b ? ", " + b + " graph break(s)" : "");
  }
  function row(line, k) {
    const i = line.row, e = line.entry, r = i === null ? null : ROWS[i];
    const tr = el("tr", r === null ? "row untested" : "row");
    tr.appendChild(cell("Rank", e ? text(rget(e, RANKED[state.view])) : "-", "num rank-col"));
    const first = el("td");
    first.setAttribute("data-label", "Model");
    if (r === null) {
      first.appendChild(el("span", "model", text(rget(e, "model_id"))));
    } else {
      const b = el("button", "model", text(get(r, "model_id")));
      b.type = "button";
      b.setAttribute("aria-expanded", String(state.open.has(i)));
      b.addEventListener("click", function () {
        if (state.open.has(i)) state.open.delete(i); else state.open.add(i);
        render();
      });
      first.appendChild(b);
    }
    tr.appendChild(first);
    tr.appendChild(cell("Task", r === null ? text(rget(e, "task")) : taskOf(r), "task-col"));
    tr.appendChild(badge(r));
    tr.appendChild(cell("Downloads", e ? count(rget(e, "downloads")) : "-", "num rank-col"));
    tr.appendChild(cell("Trending score", e ? count(rget(e, "trending_score")) : "-", "num rank-col"));
    if (r === null) {
      ["Cores", "Wall time (s, incl. compilation)", "Peak device memory (GiB)", "Compile audit (graphs)",
       "neuronx-cc", "Transformers"].forEach(function (label) { tr.appendChild(cell(label, "-")); });
      return tr;
    }
    tr.appendChild(cell("Cores", typeof get(r, "tp") === "number" ? String(get(r, "tp")) : "-", "num"));
    tr.appendChild(cell("Wall time (s, incl. compilation)", num(get(r, "wall_s"), 1), "num"));
    tr.appendChild(cell("Peak device memory (GiB)", num(get(r, "hbm_peak_gb"), 2), "num"));
    tr.appendChild(cell("Compile audit (graphs)", auditText(r),
                        "audit" + (auditOf(r) === "recompiles" ? " recompiles" : "")));
    tr.appendChild(cell("neuronx-cc", compilerOf(r)));
    tr.appendChild(cell("Transformers", transformersOf(r)));
    return tr;
  }
  function dl(pairs) {
    const d = el("dl");
    pairs.forEach(function (p) { d.appendChild(el("dt", null, p[0])); d.appendChild(el("dd", null, text(p[1]))); });
    return d;
  }
  function json(raw) {  // a JSON cell, or null where it is not JSON (then shown as recorded)
    if (typeof raw !== "string" || !raw) return null;
    try { return JSON.parse(raw); } catch (e) { return null; }
  }
  function packages(r) {
    const raw = get(r, "packages");
    if (!raw) return [["recorded", null]];
    const p = json(raw);
    if (p && typeof p === "object" && !Array.isArray(p)) return Object.keys(p).map(function (k) { return [k, p[k]]; });
    return [["as recorded", raw]];
  }
  function auditDetail(r, box) {
    box.appendChild(el("h3", null, "Compile audit"));
    if (typeof get(r, "compile_graphs") !== "number" && !get(r, "compile_audit")) {
      box.appendChild(el("p", "note", "not audited (--compile_audit audits a --no_compile row; compiled rows always)"));
      return;
    }
    const a = json(get(r, "compile_audit")) || {};
    const phases = a.phases && typeof a.phases === "object" ? Object.keys(a.phases).map(function (k) {
      return k.replace(/_/g, " ") + " " + a.phases[k]; }).join(", ") : null;
    box.appendChild(dl([["graphs compiled", get(r, "compile_graphs")], ["per phase", phases],
                        ["recompiles after the first decode step", get(r, "compile_recompiles")],
                        ["graph breaks", get(r, "compile_graph_breaks")],
                        ["forward calls", typeof a.forward_calls === "number" ? a.forward_calls : null],
                        ["audit time", typeof a.seconds === "number" ? a.seconds.toFixed(1) + " s" : null],
                        ["how", typeof a.mode === "string" ? a.mode : get(r, "compile_audit")],
                        ["error", typeof a.error === "string" ? a.error : null]]));
    function listing(cls, title, raw, fmt) {
      const v = json(raw);
      let lines = null;
      if (Array.isArray(v)) lines = v.map(String);
      else if (v && typeof v === "object") lines = Object.keys(v).map(function (k) { return fmt(k, v[k]); });
      else if (raw) lines = [String(raw)];
      if (!lines || !lines.length) return;
      box.appendChild(el("h3", null, title));
      box.appendChild(el("pre", cls, lines.join("\n")));
    }
    listing("recompile-reasons", "Recompile reasons (the guard that failed)", get(r, "compile_recompile_reasons"));
    listing("break-reasons", "Graph-break reasons", get(r, "compile_graph_break_reasons"),
            function (k, n) { return n + " x " + k; });
  }
  function quote(s) { return /^[A-Za-z0-9_.,:\/=+-]+$/.test(s) ? s : "'" + s.replace(/'/g, "'\"'\"'") + "'"; }
  function reproduce(r) {
    const lines = ["# 1. the version stack of this row"];
    function pinned(pairs) {
      return pairs.filter(function (p) { return p[1] && p[1] !== "unknown"; })
                  .map(function (p) { return quote(p[0] + "==" + p[1]); });
    }
    const pins = pinned([["transformers", transformersOf(r)], ["accelerate", get(r, "accelerate")],
                         ["torch", get(r, "torch")]]);
    lines.push("pip install " + (pins.length ? pins.join(" ") : "transformers torch  # no versions recorded"));
    const neuron = pinned([["neuronx-cc", get(r, "neuronx_cc")], ["torch-neuronx", get(r, "torch_neuronx")],
                           ["nki", get(r, "nki")]]);
    if (neuron.length) lines.push("pip install " + neuron.join(" ") + "  # from the AWS Neuron pip repository");
    else lines.push("# no Neuron packages: this row ran without Trainium (" + text(get(r, "device")) + ")");
    lines.push("# 2. the script: run.py above, saved as a file (read it first: it is shown, never run here)");
    const rerun = get(r, "rerun");
    if (rerun) {  // built by page.py: a plain list of the script's flags, every word quoted (shlex.join)
      lines.push("#    with the common/ and examples/compat_check/ files its header lists");
      lines.push(rerun);
    } else if (get(r, "run_args")) {
      lines.push("# not reproducible from this row: its run_args (under Run) are not a plain list of the " +
                 "script's flags");
    } else {
      lines.push("python run.py");
    }
    lines.push("# 3. reuse the compiled graphs: only with the same compiler (neuronx-cc " + compilerOf(r) + ")");
    const cache = get(r, "compile_cache");
    if (cache && /^[A-Z_]+=/.test(cache)) {
      lines.push("export " + cache.split("=")[0] + "=" + quote(cache.slice(cache.indexOf("=") + 1)) +
                 "  # a copy of that folder from the machine that ran it");
    } else if (cache) {
      lines.push("# " + cache.replace(/[\r\n]+/g, " "));
    } else {
      lines.push("# where the graphs were cached is not recorded in this row: the first run compiles, reruns reuse it");
    }
    const pull = get(r, "pull");
    if (pull) {  // built by page.py: the row's shared compile cache and the key its versions give, every word quoted
      lines.push(get(r, "pull_key") ? "# the graphs of this compiler from the shared compile cache (run from the " +
                                      "repository's root; refused on a host of another key)"
                                    : "# from the shared compile cache: the row does not record every version of " +
                                      "its key, so this pulls the key of the host it runs on");
      lines.push(pull);
    } else if (get(r, "compile_cache_url")) {
      lines.push("# the shared compile cache recorded (under Run) is not one printable line: no command from it");
    } else {
      lines.push("# no shared compile cache recorded for this row");
    }
    // one line each: a newline or carriage return in a value (quoted or in a comment) cannot start a command
    return lines.map(function (l) { return l.replace(/[\u0000-\u001f\u007f-\u009f\u2028\u2029]/g, "\ufffd"); })
                .join("\n");
  }
  function detail(i) {
    const r = ROWS[i];
    const tr = el("tr", "detail");
    const td = el("td");
    td.colSpan = RANKED[state.view] ? 11 : 9;
    const box = el("div", "detail");
    box.appendChild(el("h3", null, "Verdict"));
    box.appendChild(dl([["result", resultOf(r)], ["exclusion", get(r, "exclusion")],
                        ["matches CPU", get(r, "cpu_match")], ["English", get(r, "english")],
                        ["notes", get(r, "notes")]]));
    if (get(r, "error")) {
      box.appendChild(el("h3", null, "Error"));
      box.appendChild(el("pre", "error", get(r, "error")));
    }
    box.appendChild(el("h3", null, "Run"));
    box.appendChild(dl([["task", taskOf(r)], ["cores", get(r, "tp")], ["runner", get(r, "runner")],
                        ["device", get(r, "device")],
                        ["wall time (includes compilation)", num(get(r, "wall_s"), 1) + " s"],
                        ["of which compiling", num(get(r, "compile_s"), 1) + " s"],
                        ["peak device memory", num(get(r, "hbm_peak_gb"), 2) + " GiB of " +
                                               num(get(r, "hbm_capacity_gb"), 1) + " GiB"],
                        ["tested at", get(r, "tested_at")], ["prompt", get(r, "prompt")], ["image", get(r, "image")],
                        ["generated text", get(r, "generated_text")],
                        ["compiled graphs cached in", get(r, "compile_cache")],
                        ["shared compile cache", get(r, "compile_cache_url") ||
                                                 "no shared compile cache recorded"],
                        ["rerun flags (as recorded)", get(r, "run_args")],
                        ["results file", get(r, "source_file")]]));
    auditDetail(r, box);
    box.appendChild(el("h3", null, "Version stack"));
    box.appendChild(dl(["neuronx_cc", "torch_neuronx", "nki", "neuron_driver", "library", "library_version",
                        "transformers", "accelerate", "torch", "python"].map(function (c) { return [c, get(r, c)]; })));
    box.appendChild(el("h3", null, "Extra packages"));
    box.appendChild(dl(packages(r)));
    const idx = get(r, "run_py");
    const src = typeof idx === "number" ? DATA.texts[idx] : null;
    const d = el("details", "run-py");
    d.appendChild(el("summary", null, src ? "run.py (" + src.split("\n").length + " lines; shown as text, never run)"
                                          : "run.py: not recorded"));
    if (src) d.appendChild(el("pre", "run-py", src));
    box.appendChild(d);
    box.appendChild(el("h3", null, "Reproduce"));
    box.appendChild(el("pre", "reproduce", reproduce(r)));
    td.appendChild(box);
    tr.appendChild(td);
    return tr;
  }
  function render() {
    const ranked = Boolean(RANKED[state.view]);
    $("table").className = ranked ? "ranked" : "";
    const hits = lines();
    const counts = {PASS: 0, FAIL: 0, EXCLUDED: 0};
    let untested = 0;
    hits.forEach(function (h) {
      if (h.row === null) { untested += 1; return; }
      const k = resultOf(ROWS[h.row]);
      if (k in counts) counts[k] += 1;
    });
    const tally = counts.PASS + " PASS, " + counts.FAIL + " FAIL, " + counts.EXCLUDED + " EXCLUDED";
    if (ranked) {
      const models = new Set(hits.map(function (h) { return rget(h.entry, "model_id"); })).size;
      $("count").textContent = NAMES[state.view] + " for " + rankedTask() + ": " + models + " ranked model(s), " +
        hits.length + " line(s): " + tally + ", " + untested + " " + UNTESTED + " (neither PASS nor FAIL; " +
        "EXCLUDED and not tested are not failures)" +
        (RANKS ? "; the Hub's rankings from " + RANKS.source + ", fetched " + text(RANKS.fetched_at) : "");
    } else {
      $("count").textContent = hits.length + " of " + ROWS.length + " rows (" + NAMES[state.view] + "): " + tally +
        " (excluded or not fetched; not counted as failures)";
    }
    const note = $("empty-note");
    if (ranked && !RANKS) {
      note.hidden = false;
      note.textContent = "No rankings in this page. Write a rankings file where the Hub is reachable: python " +
        "examples/generate_compat_check.py rankings --task text-generation --task image-text-to-text --limit 100 " +
        "--out rankings.json, then lookup SOURCES --rankings rankings.json --html PAGE.";
    } else if (ranked && rankedTasks.indexOf(rankedTask()) < 0) {
      note.hidden = false;
      note.textContent = "The rankings hold no " + rankedTask() + " models: pick " + rankedTasks.join(" or ") +
        " with Task.";
    } else {
      note.hidden = !(state.view === "selected" && hits.length === 0);
      note.textContent = "None of these rows is in the curated list (the trn2_selected preset's models): see All.";
    }
    const body = document.createDocumentFragment();
    hits.slice(0, state.shown).forEach(function (h, k) {
      body.appendChild(row(h, k));
      if (h.row !== null && state.open.has(h.row)) body.appendChild(detail(h.row));
    });
    const tbody = $("rows");
    tbody.replaceChildren(body);
    $("more").hidden = hits.length <= state.shown;
    $("more").textContent = "Show more (" + Math.min(PAGE, hits.length - state.shown) + " of " +
                            (hits.length - state.shown) + " left)";
  }
  $("footer").textContent = "Written " + DATA.written_at + " from " + DATA.sources.join(", ") +
    (RANKS ? "; rankings " + RANKS.source + " (fetched " + text(RANKS.fetched_at) + ")" : "") + ".";
  const anySelected = ROWS.some(function (r) { return SELECTED.has(get(r, "model_id")); });
  setView(anySelected ? "selected" : "all");
  document.body.setAttribute("data-ready-ms", String(Math.round(performance.now())));  // since navigation start
  document.body.setAttribute("data-ready", "true");
})();
"""
