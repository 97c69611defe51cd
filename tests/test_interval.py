"""--checkpoint_every auto and the stop-notice verdict: Young's interval and the verdict from fixed durations fed
through the run's own StopControl (a known interval, the verdict flipping at its boundary), and one stop of a run
whose every save is slowed (tests/slow_native_qwen3.py) to three times its notice."""
from __future__ import annotations

import math
import signal

import pytest

from common.harness import interval
from common.harness.stops import EXIT_STOPPED, StopControl
from conftest import ROOT, assert_clean_error, example_command, read_results, run_in_process
from stop_helpers import finish, start, wait_for_step


def _stopped_with_slow_saves(tmp_path, monkeypatch, after: int, *args: str) -> tuple[dict, str]:
    """The native script (tests/slow_native_qwen3.py: every save's write 3 s longer) with `args`, 64-token sequences,
    no export, into tmp_path/o; SIGTERM once step `after` is logged; it stops with exit 75. (results, output)."""
    out = tmp_path / "o"
    cmd = [str(ROOT / "tests" / "slow_native_qwen3.py") if a.endswith("train_native_qwen3.py") else a
           for a in example_command("train_native_qwen3.py", *args, "--no-export", "--seq_len", "64", "--out_dir",
                                    str(out))]
    monkeypatch.setenv("SLOW_SAVE_S", "3")  # read when the command starts
    proc = start(cmd, tmp_path / "log")
    wait_for_step(proc, out, after)
    proc.send_signal(signal.SIGTERM)
    text = finish(proc)
    assert proc.returncode == EXIT_STOPPED, text[-3000:]
    return read_results(out), text


def test_youngs_interval_in_steps():
    # a 60 s save, an interruption a day on average: sqrt(2 x 60 x 86400) = 3220 s of training, 322 steps of 10 s
    assert interval.young_interval_steps(60, 10, 86400) == 322
    assert interval.young_interval_steps(1, 100, 1) == 1  # never below one step
    f = interval.interval_facts(322, save_s=60, step_s=10, mtbi_s=86400, save_source="measured", price_per_hour=36)
    assert f["expected_lost_s_per_interruption"] == 1610 and math.isclose(f["cost_lost_per_interruption"], 16.1)
    assert math.isclose(f["save_overhead"], 60 / 3280)


def test_the_verdict_flips_at_its_boundary():
    fits = interval.stop_verdict(step_s=30, batch_s=5, save_s=90, notice_s=120, comm_timeout_s=600,
                                 save_source="measured", evaluates=True)
    assert fits["fits"] and fits["worst_s"] == 120 and fits["advice"] == []
    short = interval.stop_verdict(step_s=30, batch_s=5, save_s=90, notice_s=119.9, comm_timeout_s=600,
                                  save_source="measured", evaluates=True)
    assert not short["fits"] and "a notice of at least 120 s" in short["advice"][0]
    assert "faster storage" in short["advice"][-1]
    # a held-out batch longer than a step is the worst case before the save (a stop skips a due evaluation)
    batch = interval.stop_verdict(step_s=10, batch_s=40, save_s=80, notice_s=119, comm_timeout_s=600,
                                  save_source="measured", evaluates=True)
    assert batch["worst_s"] == 120 and any("--eval_steps" in a for a in batch["advice"])
    timeout = interval.stop_verdict(step_s=1, batch_s=0, save_s=100, notice_s=900, comm_timeout_s=100,
                                    save_source="measured", evaluates=False)
    assert not timeout["fits"] and timeout["fits_notice"] and "--comm_timeout_s above" in timeout["advice"][0]


def test_the_auto_interval_from_the_run_s_measured_durations():
    stop = StopControl(end=None, margin_s=120, is_main=False)
    watch = interval.SaveWatch(stop, every="auto", mtbi_h=2, planned_save_s=20, notice_s=120, comm_timeout_s=600,
                               price_per_hour=None, evaluates=False, is_main=False)
    assert not watch.due(5, None)  # no step measured yet: no interval
    stop.steps_s = [30.0, 10.0, 10.0, 12.0]  # step 1 compiles: the median of the others, 10 s
    # before a save is measured: the planned 20 s, sqrt(2 x 20 x 7200) = 537 s, 54 steps
    assert watch.due(54, None) and not watch.due(53, None)
    assert watch.interval["save_source"] == "planned" and watch.interval["every_steps"] == 54
    stop.saved(54, 40.0, 40.0)  # measured: sqrt(2 x 40 x 7200) = 759 s, 76 steps, counted from the last save
    watch.saved()
    assert watch.interval["every_steps"] == 76 and watch.interval["save_source"] == "measured"
    assert watch.due(54 + 76, 54) and not watch.due(54 + 75, 54)
    assert watch.verdict["fits"] and watch.verdict["worst_s"] == 30.0 + 40.0 - 18.0  # the longest step after step 1


def test_an_asynchronous_save_s_wait_sets_the_interval_and_its_whole_write_the_verdict():
    """--async_checkpoint: training waits 2 s for a save whose write takes 111 s. The interval is the wait's
    (sqrt(2 x 2 x 7200) = 170 s, 17 steps of 10 s), at once; the verdict (a stop's save is written whole) is the
    planned save's until the write has ended, then the write's: a step and 111 s do not fit 120 s."""
    stop = StopControl(end=None, margin_s=120, is_main=False)
    watch = interval.SaveWatch(stop, every="auto", mtbi_h=2, planned_save_s=20, notice_s=120, comm_timeout_s=600,
                               price_per_hour=None, evaluates=False, is_main=False, async_saves=True)
    stop.steps_s = [30.0, 10.0, 10.0]
    stop.saved(3, 2.0, None)  # the wait measured, the write going on
    watch.saved()
    assert watch.interval["every_steps"] == 17 and watch.interval["save_s"] == 2.0
    assert watch.interval["save_source"] == "measured, the part training waits for"
    assert watch.verdict["fits"] and watch.verdict["save_source"] == "planned"  # no write measured yet
    stop.written(111.0)
    watch.written()
    assert not watch.verdict["fits"] and watch.verdict["save_s"] == 111.0 and watch.verdict["worst_s"] == 121.0
    assert watch.interval["every_steps"] == 17  # the write does not move the interval
    assert watch.results()["saves"] == {"asynchronous": True, "each": [{"step": 3, "wait_s": 2.0, "write_s": 111.0}]}


@pytest.mark.extended
def test_with_async_saves_training_waits_for_the_copy_and_a_stop_for_the_whole_write(tmp_path, monkeypatch):
    """--async_checkpoint --checkpoint_every 4, each save's background write slowed by 3 s (tests/slow_native_qwen3.py);
    SIGTERM once step 6 is logged. The save of step 4 held training for less than its write (the copy of the state,
    under a second here); the stop's save, asynchronous too, was waited for: exit 75 once its checkpoint is whole,
    training having waited the whole write; the verdict is the whole write's."""
    out = tmp_path / "o"
    res, _ = _stopped_with_slow_saves(tmp_path, monkeypatch, 6, "--steps", "12", "--checkpoint_every", "4",
                                      "--async_checkpoint")
    stopped = res["stopped"]["step"]
    periodic, last = res["saves"]["each"][0], res["saves"]["each"][-1]
    assert res["saves"]["asynchronous"] and periodic["step"] == 4 and last["step"] == stopped >= 6, res["saves"]
    assert periodic["wait_s"] < 3 <= periodic["write_s"], periodic  # training went on while it was written
    assert 3 <= last["write_s"] <= last["wait_s"], last  # the stop's save: waited for, whole
    assert (out / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()
    assert res["stop_safety"]["save_s"] == max(r["write_s"] for r in res["saves"]["each"])


def test_a_lone_interruption_interval_and_absurd_storage_are_refused(tmp_path):
    """--mean_hours_between_interruptions sets the auto interval alone: without auto it is one error line, not
    ignored (--storage_gb_per_s alone is used: the stop-notice verdict, the dry run's); a bandwidth below any
    storage's is refused by its bounds (1e-300 was an OverflowError at step 1)."""
    out = str(tmp_path / "o")
    proc = run_in_process("train_native_qwen3.py", "--mean_hours_between_interruptions", "5", "--dry_run",
                          "--out_dir", out)
    assert_clean_error(proc, "--mean_hours_between_interruptions sets the --checkpoint_every auto interval and "
                             "nothing else: add --checkpoint_every auto (it is '0')")
    proc = run_in_process("train_native_qwen3.py", "--checkpoint_every", "auto", "--storage_gb_per_s", "1e-300",
                          "--dry_run", "--out_dir", out)
    assert_clean_error(proc, "--storage_gb_per_s", "1e-06", "1e-6 is 1 kB/s")
    proc = run_in_process("train_native_qwen3.py", "--checkpoint_every", "often", "--out_dir", out)
    assert_clean_error(proc, "--checkpoint_every takes a number of steps (0 to 10000000) or auto, got 'often'")


def test_the_interval_of_a_save_planned_over_absurd_storage_is_never_an_overflow():
    # a save of 1e299 s over a million hours: sqrt(2 x 1e299 x 3.6e9) overflows as one product; here, MAX_EVERY
    assert interval.young_interval_steps(1e299, 0.5, 3.6e9) == interval.MAX_EVERY
    assert interval.young_interval_steps(float("inf"), 1.0, 3600) == interval.MAX_EVERY
    f = interval.interval_facts(interval.MAX_EVERY, save_s=1e299, step_s=0.5, mtbi_s=3.6e9, save_source="planned")
    assert len(interval.format_interval(f)) < 400  # figures of three digits, not of 300


def test_without_an_interruption_interval_the_published_one_is_assumed_and_said(capsys, monkeypatch):
    """No --mean_hours_between_interruptions: DEFAULT_MTBI_H a host over the job's hosts (torchrun's WORLD_SIZE /
    LOCAL_WORLD_SIZE), said in the interval's line with the flag that sets one's own."""
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # 2 hosts: 1500 h
    stop = StopControl(end=None, margin_s=120, is_main=False)
    watch = interval.SaveWatch(stop, every="auto", mtbi_h=None, planned_save_s=20, notice_s=120,
                               comm_timeout_s=600, price_per_hour=None, evaluates=False, is_main=True)
    stop.steps_s = [30.0, 10.0, 10.0]
    assert watch.due(10**6, None)
    # sqrt(2 x 20 x 1500 x 3600) = 14697 s, 1470 steps of 10 s
    assert watch.interval["mean_time_between_interruptions_s"] == 1500 * 3600
    assert watch.interval["every_steps"] == 1470
    line = capsys.readouterr().out
    assert "mean time between interruptions 1500 h, assumed: 3000 h a host from Llama 3's failure rate, over 2 " \
           "hosts; --mean_hours_between_interruptions H for your own" in line, line


def test_the_interval_is_said_again_only_when_it_moves_materially(capsys):
    """The median step moves the interval by a step or so nearly every step: said once, then again only when it
    moves by more than a fifth (and more than one step)."""
    stop = StopControl(end=None, margin_s=120, is_main=False)
    watch = interval.SaveWatch(stop, every="auto", mtbi_h=2, planned_save_s=20, notice_s=120, comm_timeout_s=600,
                               price_per_hour=None, evaluates=False, is_main=True)
    stop.steps_s = [30.0, 10.0]
    watch.due(1, None)  # 54 steps of 10 s
    for s in (10.2, 10.4, 10.6, 10.8, 11.0, 11.2):  # 54 to 51 steps: no news
        stop.steps_s.append(s)
        watch.due(1, None)
    assert watch.interval["every_steps"] < 54
    assert capsys.readouterr().out.count("[checkpoint] auto: every") == 1
    stop.steps_s = [30.0, 5.0]  # 107 steps: a material change
    watch.due(1, None)
    out = capsys.readouterr().out
    assert out.count("[checkpoint] auto: every") == 1 and "every 107 steps" in out, out


def test_the_write_probe_measures_and_leaves_nothing(tmp_path):
    gb_per_s = interval.write_probe(tmp_path, nbytes=4 << 20)
    assert math.isfinite(gb_per_s) and gb_per_s > 0
    assert list(tmp_path.iterdir()) == []


def test_auto_alone_measures_the_storage_and_assumes_the_interruption_interval(tmp_path):
    """--checkpoint_every auto with neither figure: OUT_DIR's bandwidth measured before step 1 and said, the
    interruption interval the published one, said with its flag; the run trains and records its interval."""
    out = tmp_path / "o"
    proc = run_in_process("train_native_qwen3.py", "--checkpoint_every", "auto", "--steps", "3", "--no-export",
                          "--seq_len", "64", "--out_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "[checkpoint] OUT_DIR's write bandwidth: " in text and " GB/s measured (32 MiB written" in text, text
    assert "assumed: 3000 h a host from Llama 3's failure rate, over 1 host;" in text, text
    res = read_results(out)
    assert res["checkpoint_interval"]["mean_time_between_interruptions_s"] == 3000 * 3600
    assert res["config"]["storage_gb_per_s"] > 0 and not list(out.glob(".write-probe-*"))


@pytest.mark.extended
def test_a_save_three_times_longer_than_the_notice_is_reported_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    """Every save slowed by 3 s, a notice of 1 s, --checkpoint_every auto; SIGTERM once step 2 is logged (the save
    after step 1 is done by then: it comes before step 2 trains): the warning comes after the first save, the stop
    still saves and exits 75, and results.json holds the verdict and the interval with its inputs."""
    # an interruption every 3.6 ms: sqrt(2 x save x MTBI) is under 0.2 s, so the interval is one step at any step
    # time above that, and the first save (after step 1) comes before the signal, on a fast machine or a busy one
    res, text = _stopped_with_slow_saves(tmp_path, monkeypatch, 2, "--steps", "8", "--checkpoint_every", "auto",
                                         "--mean_hours_between_interruptions", "0.000001", "--storage_gb_per_s", "0.1",
                                         "--stop_notice_s", "1")
    v = res["stop_safety"]
    assert not v["fits"] and v["save_source"] == "measured" and v["save_s"] >= 3 >= 3 * v["notice_s"], v
    assert "[stop notice] a stop needs" in text and "WARNING it does not fit" in text
    assert text.index("WARNING it does not fit") < text.index("[stop] SIGTERM")  # said before the stop came
    f = res["checkpoint_interval"]
    assert f["save_source"] == "measured" and f["every_steps"] == interval.young_interval_steps(
        f["save_s"], f["step_s"], f["mean_time_between_interruptions_s"])
    assert res["stopped"]["reason"] == "SIGTERM"
