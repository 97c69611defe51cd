"""tools/report.py: several runs' results.json in one picture and one table. The results.json files are written
here by hand (no training): one with every field a pilot run reports, one as the training scripts wrote them
before those fields (the README's SmolLM2 run), one with held-out losses and only part of `timing`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, assert_clean_error, run_python
from tools import report

VERSIONS = {"python": "3.11.7", "torch": "2.14.1", "torchtitan": "0.3.0", "transformers": "5.16.0"}


def old_style(losses=(4.431163787841797, 3.490324020385742, 4.2129411697387695), tokens_per_s=37.63126349914004,
              **extra) -> dict:
    """What train_hf_backend.py --preset smollm2 --init pretrained --steps 3 --no-export wrote in 2026-12."""
    steps = list(range(1, len(losses) + 1))
    return {"script": "train_hf_backend.py", "config": {"preset": "smollm2", "device": "auto", "steps": len(steps)},
            "versions": VERSIONS, "device": "cpu", "world_size": 1, "init": "pretrained",
            "first_step_loss": losses[0], "steps": steps, "losses": list(losses), "tokens_per_s": tokens_per_s,
            "history": {"steps": steps, "losses": list(losses)}, "train_seconds": 13.0, "stopped": None, **extra}


def full() -> dict:
    """Every field of a pilot run (docs/pilot-report.md)."""
    losses = [12.1, 11.6, 11.0, 10.7, 10.4, 10.2, 10.0, 9.9, 9.8, 9.7]
    steps = list(range(1, 11))
    return {"script": "train_native_qwen3.py",
            "config": {"preset": "qwen3_4b", "device": "auto", "steps": 10},
            "versions": {**VERSIONS, "torch": "2.14.0", "torch_neuronx": "2.14.3.0"},
            "device": "neuron", "world_size": 64, "steps": steps, "losses": losses,
            "history": {"steps": steps, "losses": losses}, "tokens_per_s": 15000.0, "train_seconds": 420.0,
            "timing": {"first_step_s": 412.5, "steady_step_s": 1.25, "warmup_steps_excluded": 2,
                       "steady_tokens_per_s": 209715.2, "steady_tokens_per_s_per_rank": 3276.8,
                       "compile_or_warmup_s": 410.0},
            "flops_per_token": 2.5e10, "mfu": 0.312,
            "peak_flops_per_device": {"value": 1.3e14, "source": "nominal bf16 per NeuronCore"},
            "memory": {"peak_gib": [7.1, 7.4, 7.2], "planned_gib": 8.5, "ratio": 0.87, "measured_by": "neuron-monitor"},
            "eval_losses": [{"step": 5, "loss": 10.9}, {"step": 10, "loss": 9.95}],
            "cost": {"usd": 12.5, "instance": "trn2.48xlarge"},
            "stopped": {"reason": "SIGTERM", "step": 10, "checkpoint": "checkpoint/step-10"}}


def with_evals() -> dict:
    """Held-out losses and part of `timing`, no MFU and no memory."""
    return old_style(losses=(11.172331809997559, 10.371922492980957, 9.306623458862305),
                     tokens_per_s=46.76587606409043, init="random",
                     eval_losses=[{"step": 1, "loss": 11.3}, {"step": 3, "loss": 9.5}, "not an entry"],
                     timing={"first_step_s": 6.25, "steady_step_s": 0.52})


def make_run(root: Path, name: str, data) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps(data) if not isinstance(data, str) else data)
    return d


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [make_run(tmp_path, "pilot_full", full()), make_run(tmp_path, "smol_pre", old_style()),
            make_run(tmp_path, "smol_rand", with_evals())]


def rows_of(text: str, labels) -> dict[str, list[str]]:
    """The first table's rows of the printed report, by label (columns split on two spaces or more)."""
    import re

    first = text.split("\n\n")[0].splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in first[1:]]
    return {row[0]: row for row in rows if row[0] in labels}


def test_picture_and_table(runs, tmp_path, capsys):
    out = tmp_path / "cmp" / "report.png"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out

    from matplotlib.image import imread

    img = imread(out)
    w, h = report.pixel_size(3)
    assert img.shape[:2] == (h, w)
    gray = img[..., :3].mean(axis=2)
    assert gray.std() > 0.05 and (gray < 0.5).mean() > 0.005  # not blank: text, lines and bars drawn
    assert report._png_text(out)[report.PNG_KEY] == report.PNG_VALUE

    rows = rows_of(text, ["pilot_full", "smol_pre", "smol_rand"])
    assert set(rows) == {"pilot_full", "smol_pre", "smol_rand"}
    assert rows["pilot_full"] == ["pilot_full", "train_native_qwen3.py", "qwen3_4b", "neuron", "64", "10", "12.100",
                                  "9.700", "412", "1.25", "209,715", "31.2%", "7.4 / 8.5 (0.87x)", "2.14.0", "0.3.0",
                                  "5.16.0"]
    # the older results.json: its whole-run tokens/s marked, the rest "-"
    assert rows["smol_pre"] == ["smol_pre", "train_hf_backend.py", "smollm2", "cpu", "1", "3", "4.431", "4.213",
                                "-", "-", "37.6*", "-", "-", "2.14.1", "0.3.0", "5.16.0"]
    assert rows["smol_rand"][6:12] == ["11.172", "9.307", "6.25", "0.52", "46.8*", "-"]
    assert "* tokens/s over the whole run" in text

    details = text.split("\n\n")[1]
    assert "9.950" in details and "nominal bf16 per NeuronCore" in details and "neuron-monitor" in details
    assert "usd 12.5, instance trn2.48xlarge" in details and "SIGTERM after step 10" in details and "9.500" in details  # smol_rand's last held-out loss

    md = out.with_suffix(".md").read_text()
    assert md.startswith(report.MD_MARKER)
    table = [line for line in md.split("\n\n")[2].splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3 and "| smol\\_pre | train\\_hf\\_backend.py | smollm2 | cpu | 1 | 3 | 4.431 |" in md
    assert not list(out.parent.glob(".*.tmp"))  # atomic writes leave nothing behind

    # run again over its own report: replaced
    before = out.stat().st_mtime_ns
    assert report.main([str(runs[1]), "--out", str(out), "--label", "again"]) == 0
    assert out.stat().st_mtime_ns >= before and "again" in out.with_suffix(".md").read_text()
    assert imread(out).shape[:2] == report.pixel_size(1)[::-1]


def test_untrusted_text_is_shown_as_text(tmp_path, capsys):
    """Labels and strings from results.json are text: no mathtext, no hidden legend entry, no split line, no
    Markdown; values of the wrong type are "-" with a note, never a crash."""
    odd = old_style(script="a|b\n$x^2$ <b>", config={"preset": ["not", "text"]}, device="\x1b[31mred",
                    world_size=10**400, versions={"torch": None}, timing={"first_step_s": "fast"}, mfu=True,
                    memory={"peak_gib": ["x", 3.0], "planned_gib": 0}, eval_losses="none",
                    history={"steps": [1, 2], "losses": [float("nan"), 2.0]})
    run = make_run(tmp_path, "odd", odd)
    out = tmp_path / "odd.png"
    label = "_$\\frac{1}{0}$ | *x*"
    assert report.main([str(run), "--out", str(out), "--label", label]) == 0
    text = capsys.readouterr().out
    row = rows_of(text, [label])[label]
    assert row[1:7] == ["a|b\N{REPLACEMENT CHARACTER}$x^2$ <b>", "-", "\N{REPLACEMENT CHARACTER}[31mred", "-",
                        "2", "-"]
    assert row[-3:] == ["-", "-", "-"] and "3 / 0" in " ".join(row)
    # each value of the wrong type or out of range is named in a note below the tables (JSON null is no value)
    notes = text.split("not drawn:\n", 1)[1]
    for needle in ("config.preset = a list: not text", "world_size = an integer of 401 digits: outside 1 to 1e7",
                   'timing.first_step_s = "fast": not a number', "mfu = true: not a number",
                   'memory.peak_gib[0] = "x": not a number', 'eval_losses = "none": not a list',
                   "history.losses: 1 value not a finite number from -1e6 to 1e6, not drawn (step 1: nan)"):
        assert needle in notes, needle
    assert "versions.torch" not in notes
    md = out.with_suffix(".md").read_text()
    assert r"| \_\$\\frac{1}{0}\$ \| \*x\* | a\|b" + "\N{REPLACEMENT CHARACTER}" + r"\$x^2\$ \<b\> |" in md
    assert report._plot_text(label) == " _\\$\\frac{1}{0}\\$ | *x*"


def test_bad_inputs_one_error_line(runs, tmp_path, capsys):
    """Through the real command line: each refusal is one `error:` line, exit 2, and nothing is written."""
    bad_json = make_run(tmp_path, "bad_json", "{not json")
    a_list = make_run(tmp_path, "a_list", "[1, 2]")
    foreign = tmp_path / "loss.png"  # a PNG this tool did not write (a run's loss plot)
    from matplotlib import pyplot as plt

    plt.imsave(foreign, np.zeros((4, 4, 3)))
    foreign_md = tmp_path / "mine.md"
    foreign_md.write_text("# my notes\n")
    ok = str(runs[1])
    assert report.main([ok, "--out", str(tmp_path / "own.png")]) == 0
    (tmp_path / "mine.png").write_bytes((tmp_path / "own.png").read_bytes())  # ours, but mine.md beside it is not
    cases = [
        ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.png")], "no results.json"),
        ([str(bad_json), "--out", str(tmp_path / "r.png")], "not a readable JSON results file"),
        ([str(a_list), "--out", str(tmp_path / "r.png")], "not a results object"),
        ([ok, "--out", str(runs[1] / "results.json")], "the report is a PNG"),
        ([ok, "--out", str(foreign)], "is not a report this tool wrote"),
        ([ok, "--out", str(tmp_path / "mine.png")], "mine.md exists and is not a report this tool wrote"),
        ([ok, str(runs[2]), "--out", str(tmp_path / "r.png"), "--label", "one"], "one --label per RUN_DIR"),
        ([ok, "--out", str(tmp_path / "r.png"), "--lab", "x"], "unrecognized arguments"),
        ([ok], "--out"),
    ]
    before = {p: p.read_bytes() for p in (foreign, foreign_md, runs[1] / "results.json")}
    for argv, needle in cases:
        proc = run_python([sys.executable, "-m", "tools.report", *argv], cwd=ROOT, timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert_clean_error(proc, needle)
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "r.png").exists() and not (tmp_path / "r.md").exists()


def test_help_names_the_commands():
    proc = run_python([sys.executable, "-m", "tools.report", "--help"], cwd=ROOT, timeout=120)
    assert proc.returncode == 0
    for needle in ("RUN_DIR", "--out", "--label", "--init pretrained", "--init random", "docs/pilot-report.md"):
        assert needle in proc.stdout, needle


def _with(**changes) -> dict:
    """full() with some fields replaced (`timing__first_step_s=...` replaces one field of `timing`)."""
    data = full()
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = data
        for p in parents:
            d = d[p]
        d[last] = value
    return data


INF, NAN = float("inf"), float("nan")
# (results.json, {column of the first table: what it shows}, a note, the panels of the picture with a note)
EXTREMES = {
    "first_step_1e308": (_with(timing__first_step_s=1e308), {"first step s": "-", "steady step s": "1.25"},
                         "timing.first_step_s = 1.00e+308: outside 1e-6 to 1e7 s", (2,)),
    "peak_gib_1e308": (_with(memory={"peak_gib": [1e308], "planned_gib": 8.5}), {"peak / planned GiB": "- / 8.5"},
                       "memory.peak_gib[0] = 1.00e+308: outside 0, or 1e-6 to 1e6 GiB", (4,)),
    "peak_gib_1e306": (_with(memory={"peak_gib": [7.1, 1e306], "planned_gib": 8.5}),
                       {"peak / planned GiB": "7.1 / 8.5 (0.84x)"}, "memory.peak_gib[1] = 1.00e+306: outside", (4,)),
    "planned_1e-308": (_with(memory={"peak_gib": [7.4], "planned_gib": 1e-308}), {"peak / planned GiB": "7.4 / -"},
                       "memory.planned_gib = 1.00e-308: outside 0, or 1e-6 to 1e6 GiB", (4,)),
    "losses_1e308_-1e308_inf": (_with(history={"steps": [1, 2, 3], "losses": [1e308, -1e308, INF]}),
                                {"steps": "3", "first loss": "-", "last loss": "-"},
                                "history.losses: 3 values not a finite number from -1e6 to 1e6, not drawn "
                                "(step 1: 1.00e+308, step 2: -1.00e+308, step 3: inf)", (1,)),
    "mfu_1e300": (_with(mfu=1e300), {"MFU": "-", "tokens/s": "209,715"},
                  "mfu = 1.00e+300: outside 1e-9 to 1 (a fraction of the peak)", (3,)),
    "tokens_1e308": (_with(timing__steady_tokens_per_s=1e308), {"tokens/s": "15,000*", "MFU": "31.2%"},
                     "timing.steady_tokens_per_s = 1.00e+308: outside 0, or 1e-6 to 1e12 tokens/s", (3,)),
    "nan": (_with(timing={"first_step_s": NAN, "steady_step_s": 1.25, "steady_tokens_per_s": NAN}, mfu=NAN),
            {"first step s": "-", "steady step s": "1.25", "tokens/s": "15,000*", "MFU": "-"},
            "timing.first_step_s = nan: not finite", (2, 3)),
    "negative_times": (_with(timing={"first_step_s": -5.0, "steady_step_s": -1e300}),
                       {"first step s": "-", "steady step s": "-"},
                       "timing.steady_step_s = -1.00e+300: outside 1e-6 to 1e7 s", (2,)),
    "wrong_types": (_with(timing="fast", memory=[7.4], world_size="64"),
                    {"world size": "-", "first step s": "-", "peak / planned GiB": "-"},
                    'timing = "fast": not an object', (2, 4)),
}


@pytest.mark.parametrize("case", list(EXTREMES))
def test_extreme_values_are_left_out_with_a_note(case, tmp_path, capsys):
    """A value of the wrong type, not finite, or out of its range (report.Range) is "-" in the table and absent
    from the picture, with a note naming the field and the value; the picture is still written, and the other
    runs are drawn as they are."""
    data, cells, note, panels = EXTREMES[case]
    runs = [make_run(tmp_path, case, data), make_run(tmp_path, "pilot_full", full())]
    out = tmp_path / "extreme.png"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert report._png_text(out)[report.PNG_KEY] == report.PNG_VALUE
    rows = rows_of(text, [case, "pilot_full"])
    assert {c: rows[case][report.COLUMNS.index(c)] for c in cells} == cells
    assert rows["pilot_full"][6:13] == ["12.100", "9.700", "412", "1.25", "209,715", "31.2%", "7.4 / 8.5 (0.87x)"]
    assert f"{case}: {note}" in text
    assert report.md_cell(f"{case}: {note}") in out.with_suffix(".md").read_text()
    loaded = [report.load_run(str(r), r.name) for r in runs]
    for p in (1, 2, 3, 4):  # the panels those fields belong to carry notes, the others none
        assert bool(report._note_lines(loaded, p, out)) == (p in panels), p


def test_a_profiled_run_links_its_traces_and_compares_no_memory(tmp_path, capsys):
    """A --profile run: its trace files named in the table (paths from the run's folder, sizes), linked from
    FILE.md relative to it; its memory not compared with the plan (no ratio computed from the two either); an MFU
    the run left out shown as "-" with the run's reason."""
    traces = [{"step": 10, "path": f"profile_traces/iteration_10/rank{r}_trace.json.gz", "bytes": 115388 + r}
              for r in range(3)]
    data = _with(memory={"peak_gib": [7.4], "planned_gib": 8.5, "comparable": False, "ratio": None,
                         "not_comparable": "profiled run"}, mfu=None,
                 mfu_note="MFU would be 12.2, above 1: the peak 0.001 TFLOPS a device (--peak_tflops) is below")
    hostile = [{"step": 10, "path": "../../../etc/passwd", "bytes": 1}, {"step": 10, "path": 5, "bytes": 1},
               {"step": 10, "path": "/etc/passwd", "bytes": 1},
               {"step": 10, "path": "profile_traces/iteration_10/deleted_trace.json.gz", "bytes": 1}]
    data["profile"] = {"every": 10, "steps": [10], "folder": "profile_traces", "traces": traces + hostile}
    run = make_run(tmp_path / "runs", "profiled", data)
    for t in traces:
        (run / t["path"]).parent.mkdir(parents=True, exist_ok=True)
        (run / t["path"]).write_bytes(b"trace")
    out = tmp_path / "out" / "r.png"
    assert report.main([str(run), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    row = rows_of(text, ["profiled"])["profiled"]
    assert row[report.COLUMNS.index("MFU")] == "-"
    assert row[report.COLUMNS.index("peak / planned GiB")] == "7.4 / 8.5 (not comparable: profiled)"
    first = str(run / "profile_traces" / "iteration_10" / "rank0_trace.json.gz")
    assert f"{first} (0.12 MB), " in text and "and 1 more" in text
    assert "profiled: MFU left out by the run: MFU would be 12.2, above 1" in text
    assert "not comparable: a profiled run (--profile)" in text
    md = out.with_suffix(".md").read_text()
    assert "(<../runs/profiled/profile_traces/iteration_10/rank0_trace.json.gz>)" in md
    assert "passwd>)" not in md and "deleted_trace.json.gz>)" not in md  # named in the notes as text, not linked
    assert "not a path inside the run's folder: not linked" in text and "moved or deleted" in text
    assert report.load_run(str(run), "p").memory_ratio is None  # panel 4 says "profiled: not comparable"


def test_a_cpu_mfu_is_against_the_best_peak_measured_on_the_machine_and_marked_indicative(tmp_path, monkeypatch,
                                                                                           capsys):
    """The CPU peak is the best measured on this machine so far (kept in the cache folder): a run that starts while
    the machine is busy measures lower and keeps the earlier figure, a faster measurement raises it. The pilot line
    and the report mark a CPU run's MFU as indicative, and its memory (the process's resident set) as not comparable
    with the plan."""
    from common import paths
    from common.harness import pilot

    monkeypatch.setattr(paths, "CACHE_DIR", tmp_path / "cache" / "assets")
    assert pilot.best_cpu_peak(5e10, "float32", 1) == (5e10, 1)
    assert pilot.best_cpu_peak(2e10, "float32", 1) == (5e10, 2)  # a busy machine's measurement: the best stays
    assert pilot.best_cpu_peak(8e10, "float32", 1) == (8e10, 3)
    assert pilot.best_cpu_peak(1e10, "bfloat16", 1) == (1e10, 1)  # another dtype: a figure of its own
    peak = pilot.peak_flops("cpu", "float32", None)
    assert peak["indicative"] is True and peak["value"] >= 8e10 and "best of 4 measurement(s)" in peak["source"]
    line = pilot.format_line({"timing": {"first_step_s": 2.0, "steady_step_s": 1.0, "steady_tokens_per_s": 256},
                              "flops_per_token": 1e6, "mfu": 0.1, "peak_flops_per_device": peak,
                              "memory": {"peak_gib": [1.0], "planned_gib": 2.0}, "cost": None})
    assert "MFU 0.100 (CPU: indicative) of" in line, line
    data = _with(memory={"peak_gib": [1.8], "planned_gib": 0.4, "comparable": False, "ratio": None,
                         "not_comparable": pilot.CPU_NOT_COMPARABLE})
    data["peak_flops_per_device"] = {**data["peak_flops_per_device"], "indicative": True}
    run = make_run(tmp_path / "runs", "cpu", data)
    assert report.main([str(run), "--out", str(tmp_path / "r.png")]) == 0
    text = capsys.readouterr().out
    assert "cpu: MFU indicative: a CPU run" in text
    row = rows_of(text, ["cpu"])["cpu"]  # a CPU run's resident set is not set against the plan's tensors
    assert row[report.COLUMNS.index("peak / planned GiB")] == "1.8 / 0.4 (not comparable: CPU)"
    assert "not comparable: a CPU run, whose peak is the process's resident set" in text


def test_a_phase_a_one_process_run_did_not_go_through_is_no_out_of_range_value(tmp_path, capsys):
    """A one-process run has no launch of its own: its `launch` phase is 0 (common/harness/phases.py), a phase that
    did not happen, not a value out of its range, and not listed among the phases; a negative one is still left
    out with a note."""
    phases = {"launch": 0.0, "imports": 11.2, "checks": 0.6, "plan": 0.1, "device": 0.05, "build": 1.9, "load": 0.3,
              "load check": 0.8, "first step": 1.4}
    first = {"phases": phases, "total_s": sum(phases.values()), "longest_over_ranks": dict(phases)}
    run = make_run(tmp_path, "one_process", old_style(time_to_first_step=first))
    assert report.main([str(run), "--out", str(tmp_path / "r.png")]) == 0
    text = capsys.readouterr().out
    assert "Left out" not in text and "launch" not in text, text
    assert "one_process: command to step 1: imports 11.2 s, checks 0.6 s, plan 0.1 s, device 0.1 s" in text

    first["phases"] = {**phases, "launch": -3.0}
    run = make_run(tmp_path, "negative_launch", old_style(time_to_first_step=first))
    assert report.main([str(run), "--out", str(tmp_path / "r.png")]) == 0
    text = capsys.readouterr().out
    assert "negative_launch: time_to_first_step.phases.launch = -3: outside 0, or 1e-6 to 1e7 s" in text, text
