"""Benchmark: the compatibility lookup page with many rows in headless Chromium: time to open it and
time to filter it, against the one-second figure a lookup page should stay under on a laptop.

The rows are generated here (seeded: model ids, versions, tasks, results, a few distinct run_py
texts), written as one Parquet file, and the page is written by the example's own entry point,
`python examples/generate_compat_check.py lookup FILE --html PAGE`. Chromium (Debian's `chromium`
and `chromium-driver`, driven by selenium) then opens the page from disk:
    open_ms     navigation start -> the page's script has parsed the data and drawn the first rows
    search_ms   typing a model-id search (one input event -> rows redrawn and laid out), median
    filter_ms   picking a Transformers version, then a task (change events), median
Each figure is printed with its ratio to 1,000 ms. A screenshot of the page, its last row open, goes to
OUT_DIR/page.png.

    python bench/bench_compat_page.py --out_dir runs/bench/compat_page          # 10,000 rows, ~1 min
    python bench/bench_compat_page.py --preset tiny --out_dir runs/bench/page   # 500 rows (tests)
    python bench/bench_compat_page.py --page runs/compat/page.html --out_dir runs/bench/page_real  # a real page

Needs headless Chromium: `bash tools/install_browser.sh` (part of the set-up) installs it.
"""
from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common_bench as cb  # noqa: E402
from common import cli, results  # noqa: E402
from common.errors import UserError  # noqa: E402

SCRIPT = cb.ROOT / "examples" / "generate_compat_check.py"
BUDGET_MS = 1000.0  # what a lookup page should open and filter in


@dataclass
class Config:
    preset: str = "default"
    out_dir: str = field(default="runs/bench/compat_page", metadata={"help": "results.json, the page, a screenshot"})
    rows: int = field(default=10_000, metadata={"help": "generated rows (ignored with --page)",
                                                **cli.bounds(1, 1_000_000)})
    repeats: int = field(default=5, metadata={"help": "searches and filter changes timed (medians reported)",
                                              **cli.bounds(1, 100)})
    page: str | None = field(default=None, metadata={"help": "time and screenshot this page instead of generated rows"})

    def validate(self) -> None:  # each number's range is its field's bounds (checked before this)
        if self.page is not None and not Path(self.page).is_file():
            raise UserError(f"--page {self.page} is not a file")


def default() -> Config:
    """10,000 generated rows, 5 timed searches and filter changes."""
    return Config()


def tiny() -> Config:
    """Harness check: 500 rows, 2 repeats."""
    return replace(Config(), rows=500, repeats=2)


PRESETS = {"default": default, "tiny": tiny}


# ------------------------------------------------------------------------------------------ the browser
class BrowserMissing(Exception):
    """Headless Chromium or selenium is not installed."""


def open_browser(width: int = 1280, height: int = 1000):
    """Headless Chromium through selenium, with Debian's chromium and chromium-driver (never a download)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise BrowserMissing("headless Chromium is missing (chromium and chromium-driver): run "
                             "`bash tools/install_browser.sh` (part of `make setup`)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise BrowserMissing("selenium is not installed in this environment: run `make setup`") from None
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", f"--window-size={width},{height}"):
        options.add_argument(arg)  # --no-sandbox: Chromium refuses to run as root with its sandbox
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def wait_ready(browser, timeout_s: float = 30.0) -> None:
    """Until the page's script has drawn its first rows (it sets body[data-ready] last)."""
    deadline = time.monotonic() + timeout_s
    while browser.execute_script("return document.body && document.body.getAttribute('data-ready')") != "true":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the page did not become ready in {timeout_s} s; console: {browser.get_log('browser')}")
        time.sleep(0.01)


# Runs in the page: one synchronous input or change event, then a forced layout, timed in the page.
TIME_EVENT = """
const [id, value, kind] = arguments;
const e = document.getElementById(id);
const t0 = performance.now();
e.value = value;
e.dispatchEvent(new Event(kind));
document.body.offsetHeight;
return [performance.now() - t0, document.querySelectorAll('#rows tr.row').length,
        document.getElementById('count').textContent];
"""


# ------------------------------------------------------------------------------------------ the rows
def generated_rows(n: int, seed: int = 0) -> list[dict]:
    """n rows across 4 compiler and 3 Transformers versions, both tasks and every result."""
    rng = random.Random(seed)
    orgs = ("Qwen", "meta-llama", "google", "mistralai", "microsoft", "HuggingFaceTB", "openai", "org")
    scripts = [f"# run.py variant {i}\nprint('shown, never run')\n" * 40 for i in range(8)]
    rows = []
    for i in range(n):
        result = rng.choice(("PASS", "PASS", "FAIL", "EXCLUDED"))
        rows.append({
            "model_id": f"{rng.choice(orgs)}/model-{i:05d}-{rng.choice(('instruct', 'base', 'vl', 'chat'))}",
            "library": "transformers", "tp": rng.choice((1, 2, 4, 8, 16)), "runner": rng.choice(("single", "tp", "ep")),
            "result": result, "error": "RuntimeError: boom" if result == "FAIL" else None,
            "exclusion": "no sharding plan" if result == "EXCLUDED" else None,
            "wall_s": rng.uniform(60, 2000), "hbm_peak_gb": rng.uniform(1, 90), "hbm_capacity_gb": 24.0,
            "cpu_match": rng.choice((True, False, None)), "english": rng.choice((True, False, None)),
            "neuronx_cc": rng.choice(("2.21.1", "2.22.3", "2.23.6484.0", None)),
            "transformers": (tv := rng.choice(("4.57.1", "5.12.0", "5.16.0"))), "library_version": tv,
            "torch": "2.14.0", "python": "3.11.7", "task": rng.choice(("text-generation", "image-text-to-text")),
            "run_py": rng.choice(scripts)})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.results import atomic_path

    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
    return path


def write_page(sources: Path, page: Path) -> None:
    """The example's own entry point: `generate_compat_check.py lookup SOURCES --html PAGE`."""
    cmd = [sys.executable, str(SCRIPT), "lookup", str(sources), "--html", str(page)]
    proc = subprocess.run(cmd, cwd=cb.ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")


# ------------------------------------------------------------------------------------------ main
def measure(browser, page: Path, repeats: int) -> dict:
    browser.get(page.resolve().as_uri())
    wait_ready(browser)
    open_ms = float(browser.execute_script("return document.body.getAttribute('data-ready-ms')"))
    rows_all = browser.execute_script("return document.getElementById('compat-data').textContent.length")
    browser.find_element("id", "view-all").click()
    searches, filters = [], []
    for i in range(repeats):
        ms, _, _ = browser.execute_script(TIME_EVENT, "q", f"model-{i}", "input")
        searches.append(ms)
        browser.execute_script(TIME_EVENT, "q", "", "input")
    for _ in range(repeats):
        for select in ("transformers", "task"):
            options = browser.execute_script(f"return Array.from(document.getElementById('{select}').options)"
                                             ".map(o => o.value)")
            ms, shown, count = browser.execute_script(TIME_EVENT, select, options[-1], "change")
            filters.append(ms)
        for select in ("transformers", "task"):
            browser.execute_script(TIME_EVENT, select, "", "change")
    return {"open_ms": open_ms, "search_ms": statistics.median(searches), "filter_ms": statistics.median(filters),
            "search_samples_ms": searches, "filter_samples_ms": filters, "data_chars": rows_all,
            "last_filter": {"rows_drawn": shown, "count_line": count},
            "console_errors": [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]}


def main(cfg: Config) -> dict:
    out_dir = cli.check_out_dir(cfg.out_dir).resolve()
    if cfg.page:
        page, n = Path(cfg.page).resolve(), None
    else:
        t0 = time.perf_counter()
        n = cfg.rows
        source = write_rows(out_dir / "rows" / "generated.parquet", generated_rows(n))
        page = out_dir / "page.html"
        write_page(source, page)
        print(f"[bench] {n:,} rows -> {page} ({page.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    try:
        browser = open_browser()
    except BrowserMissing as e:
        raise UserError(str(e)) from None
    try:
        figures = measure(browser, page, cfg.repeats)
        browser.find_elements("css selector", "#rows button.model")[-1].click()  # the screenshot shows a row open
        with results.atomic_path(out_dir / "page.png") as tmp:
            tmp.write_bytes(browser.get_screenshot_as_png())
    finally:
        browser.quit()
    rows = [{"what": what, "ms": figures[key], "over_budget": cb.ratio(figures[key], BUDGET_MS)}
            for what, key in (("open (navigation -> first rows drawn)", "open_ms"),
                              ("search (one input event, redraw, layout)", "search_ms"),
                              ("filter (one change event, redraw, layout)", "filter_ms"))]
    table = cb.format_table(rows, [("what", "step", ""), ("ms", "ms (median)", ".1f"),
                                   ("over_budget", f"ms / {BUDGET_MS:.0f} ms", ".3f")])
    table += (f"\n{f'{n:,} generated rows' if n else 'the given page'}; {page.stat().st_size / 1e6:.1f} MB; "
              f"console errors: {len(figures['console_errors'])}; screenshot {out_dir / 'page.png'}")
    out = {"config": cfg, "rows": rows, "page": str(page), "page_bytes": page.stat().st_size,
               "generated_rows": n, "baseline": f"{BUDGET_MS:.0f} ms (a lookup page should open and filter within it)",
               "screenshot": str(out_dir / "page.png"), **figures}
    cb.write(out_dir, "compat_page", out, table)
    return out


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, Config, PRESETS, __doc__, default_preset="default"))
