"""The compatibility lookup page (`generate_compat_check.py lookup ... --html PAGE`) in a real browser:
headless Chromium from Debian (chromium, chromium-driver) driven by selenium, opening the page from disk.

Nothing here is skipped: without Chromium or selenium every test fails with the set-up command to run.
Screenshots go under each test's run folder (its tmp_path).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from bench.bench_compat_page import BrowserMissing, generated_rows, open_browser, wait_ready, write_rows
from compat_check import page, rows
from conftest import run_in_process

STACK_NEW = {"neuronx_cc": "2.23.6484.0", "library": "transformers", "library_version": "5.16.0",
             "transformers": "5.16.0", "accelerate": "1.15.0", "torch_neuronx": "2.14.3", "torch": "2.14.0",
             "nki": "0.2.0", "python": "3.11.7", "neuron_driver": "2.25.4.0"}
STACK_OLD = dict(STACK_NEW, neuronx_cc="2.21.1", library_version="4.57.1", transformers="4.57.1")
RUN_PY = "# the script that ran\nprint('shown as text, never run')\n"
CACHE = "TORCH_NEURONX_NEFF_CACHE_DIR=/var/tmp/neff-cache"
SHARED = "s3://team bucket/compile-cache'; touch PWNED"  # a shared compile cache (compile_cache_url)


def _row(model_id: str, result: str, stack: dict, **extra) -> dict:
    return {"model_id": model_id, "result": result, "tp": 1, "runner": "single", "wall_s": 321.5, "hbm_peak_gb": 3.25,
            "hbm_capacity_gb": 24.0, "device": "neuron", "task": "text-generation", "run_py": RUN_PY,
            "compile_cache": CACHE, "run_args": f"--models {model_id} --task text-generation --cores 1",
            "packages": json.dumps({"tokenizers": "0.23.3", "pillow": "13.0.0"}), **stack, **extra}


@pytest.fixture(scope="module")
def browser():
    try:
        driver = open_browser()
    except BrowserMissing as e:
        pytest.fail(str(e))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """Two of our files (two compiler + Transformers stacks) with every kind of row."""
    folder = tmp_path_factory.mktemp("compat_page") / "results"
    new = rows.results_file(folder, STACK_NEW)
    for r in (
        _row("Qwen/Qwen3-8B", "PASS", STACK_NEW, tp=2, runner="tp", english=True),
        _row("Qwen/Qwen3-VL-2B-Instruct", "PASS", STACK_NEW, task="image-text-to-text", cpu_match=True),
        _row("meta-llama/Llama-3.2-1B-Instruct", "FAIL", STACK_NEW, cpu_match=False,
             error="RuntimeError: tokens differ\nsecond line", compile_cache_url=SHARED),
        _row("org/unlisted-model", "EXCLUDED", STACK_NEW, exclusion="no sharding plan: GPT2Config", tp=2, runner=None),
        _row("Qwen/Qwen3-0.6B", "EXCLUDED", STACK_NEW, unavailable=True, wall_s=None, hbm_peak_gb=None,
             exclusion="not fetched (no verdict; a rerun tries again): LocalEntryNotFoundError: offline"),
    ):
        rows.write_row(new, r)
    rows.write_row(rows.results_file(folder, STACK_OLD), _row("Qwen/Qwen3-8B", "FAIL", STACK_OLD, error="old"))
    return folder


def _shown_ids(browser) -> list[str]:
    return [b.text for b in browser.find_elements("css selector", "#rows button.model")]


def _console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def write_page(sources: Path, html: Path, *more: str) -> None:
    """The example's own command, `generate_compat_check.py lookup SOURCES --html PAGE`, run as its __main__ in this
    process (it reads files and starts nothing: no interpreter's start-up per page)."""
    proc = run_in_process("generate_compat_check.py", "lookup", str(sources), "--html", str(html), *more)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith(f"page: {html} ("), proc.stderr[-3000:]


def _open(browser, path: Path) -> None:
    browser.get(path.resolve().as_uri())
    wait_ready(browser)


def test_page_search_filters_and_a_row(browser, results, tmp_path):
    html = tmp_path / "page.html"
    write_page(results, html)  # the example's entry point: lookup RESULTS --html PAGE
    _open(browser, html)
    # Selected (the trn2 preset's curated list) first: the unlisted model is only under All
    assert browser.find_element("id", "view-selected").get_attribute("aria-pressed") == "true"
    selected = _shown_ids(browser)
    assert "org/unlisted-model" not in selected and len(selected) == 5
    browser.find_element("id", "view-all").click()
    assert len(_shown_ids(browser)) == 6
    assert "6 of 6 rows (All): 2 PASS, 2 FAIL, 2 EXCLUDED" in browser.find_element("id", "count").text

    browser.find_element("id", "q").send_keys("qwen3")  # search by part of the id, any case
    assert sorted(_shown_ids(browser)) == ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B",
                                           "Qwen/Qwen3-VL-2B-Instruct"]
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "compiler")).select_by_value("2.21.1")
    assert _shown_ids(browser) == ["Qwen/Qwen3-8B"]
    Select(browser.find_element("id", "compiler")).select_by_value("")
    Select(browser.find_element("id", "transformers")).select_by_value("5.16.0")
    Select(browser.find_element("id", "task")).select_by_value("image-text-to-text")
    assert _shown_ids(browser) == ["Qwen/Qwen3-VL-2B-Instruct"]
    Select(browser.find_element("id", "task")).select_by_value("")

    # EXCLUDED is shown apart from FAIL, with its reason; a model that was not fetched says so
    badges = {tr.find_element("css selector", "button.model").text: tr.find_element("css selector", ".badge")
              for tr in browser.find_elements("css selector", "#rows tr.row")}
    unfetched = badges["Qwen/Qwen3-0.6B"]
    assert unfetched.text == "EXCLUDED" and "excluded" in unfetched.get_attribute("class")
    assert "not fetched" in browser.find_element("css selector", "#rows").text

    # open a row: its version stack, packages, error, run.py as text, and how to reproduce it
    browser.find_element("id", "q").clear()
    browser.find_element("id", "q").send_keys("Llama")
    browser.find_element("css selector", "#rows button.model").click()
    detail = browser.find_element("css selector", "tr.detail")
    assert "wall time (includes compilation)" in detail.text and "321.5 s" in detail.text
    assert "2.23.6484.0" in detail.text and "tokenizers" in detail.text and "RuntimeError: tokens differ" in detail.text
    detail.find_element("css selector", "details.run-py summary").click()
    assert detail.find_element("css selector", "pre.run-py").get_attribute("textContent") == RUN_PY
    reproduce = detail.find_element("css selector", "pre.reproduce").text
    assert "pip install transformers==5.16.0 accelerate==1.15.0 torch==2.14.0" in reproduce
    assert "neuronx-cc==2.23.6484.0" in reproduce
    assert "export TORCH_NEURONX_NEFF_CACHE_DIR=/var/tmp/neff-cache" in reproduce
    assert "python generate_compat_check.py --models meta-llama/Llama-3.2-1B-Instruct" in reproduce
    pull = [line for line in reproduce.split("\n") if line.startswith("python -m tools.compile_cache")]
    assert [shlex.split(line) for line in pull] == [["python", "-m", "tools.compile_cache", "pull", SHARED, "--device",
                                                     "neuron", "--key",
                                                     "neuron_neuronx-cc-2.23.6484.0_torch-neuronx-2.14.3"]]
    assert SHARED in detail.text  # under Run, as text
    assert _console_errors(browser) == []
    shot = tmp_path / "page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    browser.set_window_size(390, 844)  # a phone: rows become cards, nothing needs sideways scrolling
    try:
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        browser.save_screenshot(str(tmp_path / "page-phone.png"))
    finally:
        browser.set_window_size(1280, 1000)


HOSTILE = [
    "<img src=x onerror=\"document.title='pwned';window.pwned=1\">",
    "</script><script>window.pwned=1;document.title='pwned'</script>",
    "evil\"><svg onload=window.pwned=1>",
]


def hostile_page(folder: Path) -> Path:
    """A results file whose ids, errors, notes, exclusions, versions and scripts are markup."""
    path = folder / "hostile.parquet"
    for i, text in enumerate(HOSTILE):
        rows.write_row(path, _row(text, ("PASS", "FAIL", "EXCLUDED")[i], dict(STACK_NEW, transformers=text),
                                  error=text, notes=text, exclusion=text, run_py=text + "\n" + RUN_PY,
                                  run_args=text, compile_cache=text, packages=json.dumps({text: text})))
    return path


def test_hostile_rows_render_as_text(browser, tmp_path):
    """Ids, errors and scripts holding tags and </script> show as text: no markup, no script run,
    no console error, every row there."""
    source = hostile_page(tmp_path)
    html = tmp_path / "hostile.html"
    write_page(source, html)
    _open(browser, html)
    browser.find_element("id", "view-all").click()
    for i in range(len(HOSTILE)):  # open every row (each click redraws the table)
        browser.find_elements("css selector", "#rows button.model")[i].click()
    assert _shown_ids(browser) == HOSTILE
    assert browser.title == "Trainium compatibility lookup"
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('img, svg').length") == 0
    assert browser.execute_script("return document.scripts.length") == 2  # the data and the page's own script
    texts = [e.get_attribute("textContent") for e in browser.find_elements("css selector", "pre.run-py")]
    assert texts == [t + "\n" + RUN_PY for t in HOSTILE]
    assert _console_errors(browser) == []
    browser.save_screenshot(str(tmp_path / "hostile.png"))


# run_args -> the argv its Reproduce command must give to shlex.split (None: "not reproducible from this row")
RERUNS = {
    shlex.join(["--models", "x; touch PWNED", "--prompt", "it's $(id) `id` | sh", "--no_compile", "--cores", "2"]):
        ["--models", "x; touch PWNED", "--prompt", "it's $(id) `id` | sh", "--no_compile", "--cores", "2"],
    "--models x; touch PWNED": None,  # a second command
    "--models x && touch PWNED": None,
    "--models 'x\ntouch PWNED'": None,  # a control character in a word
    "--models x --evil 1": None,  # not the script's flag
    "--models x --device gpu": None,  # a value its parser refuses
    "--models 'x": None,  # an unclosed quote
    "--help": None,
}


def _shell_words(line: str) -> list[str]:
    """The words of one shell line, an unquoted control operator (; & | && ( ) < >) as a word of its own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def test_reproduce_quotes_every_word_and_shows_no_command_for_other_run_args(browser, tmp_path):
    """A row's rerun command, copied from the page, gives shlex.split exactly the recorded argv; run_args that are
    not a plain list of the script's flags show "not reproducible from this row"; no value (a version, the device,
    the compile cache) can put a second command on a line of its own."""
    source = tmp_path / "reruns.parquet"
    for i, args in enumerate(RERUNS):
        rows.write_row(source, _row(f"org/m{i}", "PASS", dict(STACK_NEW, torch="2.14.0\ntouch PWNED"), run_args=args,
                                    neuronx_cc=None, torch_neuronx=None, nki=None, device="cpu\r\ntouch PWNED",
                                    compile_cache="TORCHINDUCTOR_CACHE_DIR=/tmp/c\ntouch PWNED"))
    html = tmp_path / "reruns.html"
    write_page(source, html)
    _open(browser, html)
    browser.find_element("id", "view-all").click()
    for i in range(len(RERUNS)):
        browser.find_elements("css selector", "#rows button.model")[i].click()
    blocks = [e.get_attribute("textContent") for e in browser.find_elements("css selector", "pre.reproduce")]
    assert len(blocks) == len(RERUNS)
    for (args, argv), block in zip(RERUNS.items(), blocks):
        commands = [_shell_words(line) for line in block.split("\n")]
        commands = [words for words in commands if words]  # comments are no command
        assert [words[0] for words in commands] == (["pip", "python", "export"] if argv else ["pip", "export"]), block
        assert not any(set(w) <= set("();<>|&") for words in commands for w in words), block
        assert "# no shared compile cache recorded for this row" in block.split("\n"), block
        rerun = [line for line in block.split("\n") if line.startswith("python")]
        if argv is None:
            assert rerun == [] and "# not reproducible from this row" in block, (args, block)
        else:
            assert [shlex.split(line) for line in rerun] == [["python", "generate_compat_check.py", *argv]], block
    assert "touch PWNED" in browser.find_element("css selector", "#rows").text  # the values are still shown, as text
    assert _console_errors(browser) == []


def test_page_embeds_data_that_cannot_close_its_script_element():
    data = page.page_data(rows.normalize(__import__("pandas").DataFrame([{"model_id": "</script><!--"}])), (), [])
    text = page.script_json(data)
    assert "<" not in text and ">" not in text and json.loads(text)["rows"][0][0] == "</script><!--"
    assert "http" not in page.render(data).split("<script")[0].replace("http-equiv", "")  # nothing to fetch


def test_ten_thousand_rows_open_and_filter(browser, tmp_path):
    """The page holds 10,000 rows and stays usable (bench/bench_compat_page.py reports the figures)."""
    source = write_rows(tmp_path / "many.parquet", generated_rows(10_000))
    html = tmp_path / "many.html"
    write_page(source, html)
    _open(browser, html)
    browser.find_element("id", "view-all").click()
    assert browser.find_element("id", "count").text.startswith("10000 of 10000 rows (All)")
    assert len(_shown_ids(browser)) == 200  # drawn a page at a time
    browser.find_element("id", "q").send_keys("model-00042-")
    assert all("model-00042-" in m for m in _shown_ids(browser)) and len(_shown_ids(browser)) == 1
    assert _console_errors(browser) == []


# --------------------------------------------------------------------------- Trending and Downloads
def _ranked_page(tmp_path: Path, with_rankings: bool = True) -> Path:
    """The ranked fixture of tests/test_compat_rankings.py (rows for some ranked models, a rankings file in another
    order, untested models, a hostile id), plus a record whose task, and a fetched_at, are markup; written by the
    example's own command, `lookup RESULTS --rankings FILE --html PAGE`."""
    from test_compat_rankings import ranked_fixture

    results, ranks = ranked_fixture(tmp_path / "ranked")
    doc = json.loads(ranks.read_text())
    doc["fetched_at"] = HOSTILE[1]
    doc["models"].append({"model_id": HOSTILE[2], "task": HOSTILE[0], "downloads_rank": 1, "trending_rank": 1,
                          "downloads": 3, "trending_score": 1, "likes": 0, "fetched_at": HOSTILE[1]})
    ranks.write_text(json.dumps(doc))
    html = tmp_path / "ranked.html"
    write_page(results, html, *(["--rankings", str(ranks)] if with_rankings else []))
    return html


def _lines(browser) -> list[tuple[str, str, str]]:
    """(rank, model id, result) of each drawn line."""
    out = []
    for tr in browser.find_elements("css selector", "#rows tr.row"):
        rank = tr.find_element("css selector", "td.rank-col").text
        model = tr.find_element("css selector", ".model").text
        out.append((rank, model, tr.find_element("css selector", ".badge").text))
    return out


def test_trending_and_downloads_views_follow_the_rankings(browser, tmp_path):
    from test_compat_rankings import HOSTILE_ID
    from selenium.webdriver.support.ui import Select

    html = _ranked_page(tmp_path)
    _open(browser, html)
    assert browser.find_element("id", "table").get_attribute("class") == ""  # Selected: no rank column
    assert not browser.find_element("css selector", "thead th.rank-col").is_displayed()

    browser.find_element("id", "view-trending").click()  # the rankings' first task, in trending order
    assert browser.find_element("id", "view-trending").get_attribute("aria-pressed") == "true"
    assert browser.find_element("id", "table").get_attribute("class") == "ranked"
    assert _lines(browser) == [("1", "org/dynamic-cache", "PASS"), ("2", HOSTILE_ID, "not tested"),
                               ("3", "Qwen/Qwen3-0.6B", "PASS"), ("4", "org/excluded", "EXCLUDED")]
    count = browser.find_element("id", "count").text
    assert count.startswith("Trending for text-generation: 4 ranked model(s), 4 line(s): 2 PASS, 0 FAIL, 1 EXCLUDED, "
                            "1 not tested (neither PASS nor FAIL; EXCLUDED and not tested are not failures)")
    untested = browser.find_elements("css selector", "#rows tr.row.untested")
    assert len(untested) == 1 and "5,000,000" in untested[0].text  # its downloads, beside its rank
    badge = untested[0].find_element("css selector", ".badge")
    assert "untested" in badge.get_attribute("class") and "pass" not in badge.get_attribute("class")
    assert badge.value_of_css_property("background-color") != browser.find_element(
        "css selector", "#rows .badge.pass").value_of_css_property("background-color")
    assert not untested[0].find_elements("css selector", "button")  # nothing to open: no row
    shot = tmp_path / "rankings-trending.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    browser.set_window_size(390, 844)  # a phone: ranked lines become cards too, rank and downloads labelled
    try:
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        shown = [td.get_attribute("data-label") for td in untested[0].find_elements("css selector", "td")
                 if td.is_displayed()]
        assert shown[:5] == ["Rank", "Model", "Result", "Downloads", "Trending score"], shown
        browser.save_screenshot(str(tmp_path / "rankings-trending-phone.png"))
    finally:
        browser.set_window_size(1280, 1000)

    browser.find_element("id", "view-downloads").click()  # the other order, Llama (not trending) included
    assert [m for _, m, _ in _lines(browser)] == ["Qwen/Qwen3-0.6B", HOSTILE_ID, "meta-llama/Llama-3.2-1B-Instruct",
                                                  "org/dynamic-cache", "org/excluded"]
    assert [r for r, _, _ in _lines(browser)] == ["1", "2", "3", "4", "5"]
    Select(browser.find_element("id", "result")).select_by_value("not tested")
    assert _lines(browser) == [("2", HOSTILE_ID, "not tested")]
    Select(browser.find_element("id", "result")).select_by_value("")
    Select(browser.find_element("id", "audit")).select_by_value("compiles once")  # audited, no decode recompile
    assert [m for _, m, _ in _lines(browser)] == ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B-Instruct"]
    Select(browser.find_element("id", "audit")).select_by_value("")
    Select(browser.find_element("id", "task")).select_by_value("image-text-to-text")
    assert _lines(browser) == [("1", "Qwen/Qwen3-VL-2B-Instruct", "not tested")]
    browser.execute_script(  # a task that is markup (selenium cannot build a selector for its value): text
        "const s = document.getElementById('task'); s.value = arguments[0]; s.dispatchEvent(new Event('change'));",
        HOSTILE[0])
    assert HOSTILE[0] in [o.get_attribute("value") for o in Select(browser.find_element("id", "task")).options]
    assert _lines(browser) == [("1", HOSTILE[2], "not tested")]
    browser.save_screenshot(str(tmp_path / "rankings-hostile-task.png"))
    Select(browser.find_element("id", "task")).select_by_value("")

    # the compile audit in a row: counts in the table, the guard reasons (markup here) as text in its detail
    browser.find_element("id", "view-all").click()
    cells = {tr.find_element("css selector", ".model").text: tr.find_element("css selector", "td.audit")
             for tr in browser.find_elements("css selector", "#rows tr.row")}
    assert cells["Qwen/Qwen3-0.6B"].text == "2 graph(s), compiles once"
    assert cells["org/dynamic-cache"].text == "32 graph(s), 30 recompile(s)"
    assert "recompiles" in cells["org/dynamic-cache"].get_attribute("class") and cells["org/excluded"].text == "-"
    browser.find_element("id", "q").send_keys("dynamic")
    browser.find_element("css selector", "#rows button.model").click()
    reasons = browser.find_element("css selector", "pre.recompile-reasons").get_attribute("textContent")
    assert reasons.split("\n")[0] == "forward call 3: <b>guard</b> size mismatch" and len(reasons.split("\n")) == 30
    assert "later decode steps 30" in browser.find_element("css selector", "tr.detail").text

    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('img, svg, b').length") == 0
    assert browser.execute_script("return document.scripts.length") == 2
    assert HOSTILE[1] in browser.find_element("id", "footer").text  # the hostile fetched_at, as text
    assert browser.title == "Trainium compatibility lookup"
    assert _console_errors(browser) == []


def test_ranked_views_without_rankings_say_where_to_get_them(browser, tmp_path):
    html = _ranked_page(tmp_path, with_rankings=False)
    _open(browser, html)
    for view in ("trending", "downloads"):
        browser.find_element("id", f"view-{view}").click()
        assert _shown_ids(browser) == [] and not browser.find_elements("css selector", "#rows tr")
        note = browser.find_element("id", "empty-note")
        assert note.is_displayed() and note.text.startswith("No rankings in this page.")
        assert "generate_compat_check.py rankings --task text-generation" in note.text
    browser.save_screenshot(str(tmp_path / "no-rankings.png"))
    browser.find_element("id", "view-all").click()  # the other views as before
    assert len(_shown_ids(browser)) == 4 and not browser.find_element("id", "empty-note").is_displayed()
    assert _console_errors(browser) == []
