"""``[checkpoint] save_interval = "auto"`` (issue 37) without Slurm: the rule, the history it reads from a
progress log, the choice and where its inputs came from, the hindsight interval of ``bridge-report``, the
job ETA of ``bridge-status``, the bad input refused at submission, and the benchmark's use of the rule.

The real run (hard-killed twice on the local cluster) is tests/test_save_interval_slurm.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from bridge_test_helpers import MINIMAL_TRAINING_TOML, ROOT, Clock, submit_cli

from bridge_hpc.contracts import save_interval as rule
from bridge_hpc.contracts.progress_log import ProgressLog, parse_time, read_progress
from bridge_hpc.report.live import LiveStatus, job_eta, screen_lines

T0 = parse_time("2026-03-03 00:00:00")


def write_history(path: str, kills: int = 2, run_s: float = 600.0, step_s: float = 1.0, save_every: int = 100,
                  save_s: float = 2.0, gap_s: float = 30.0, last_done: bool = True) -> None:
    """``kills`` runs of ``run_s`` seconds that end without an Ending job line (SIGKILL), then, with
    ``last_done``, one that ends with its exit save and ``done``; saves every ``save_every`` steps."""
    clock = Clock(T0)
    log = ProgressLog(path, "9", 2, clock=clock)
    t, step = T0, 0
    for k in range(kills + (1 if last_done else 0)):
        clock.at(t)
        log.starting_job(k, startup_s=0, device="cpu")
        clock.at(t + 10)
        log.first_step(step + 1)
        saved = step
        n = 1
        while 10 + n * save_every * step_s + (n - 1) * save_s < run_s:
            clock.at(t + 10 + n * save_every * step_s + n * save_s)
            saved = step + n * save_every
            log.saved_checkpoint(saved, 0.0, 0.0, save_s=save_s)
            n += 1
        end = t + run_s
        if k == kills:  # the last run: its exit save, then done
            clock.at(end)
            log.saved_checkpoint(saved + 7, 0.0, 0.0, save_s=9.0)
            clock.at(end)
            log.ending_job("done", saved + 7, 0)
        step = saved
        t = end + gap_s


# ---------------------------------------------------------------------------------------------
# The rule and its inputs


def test_young_daly_in_seconds_and_in_steps_within_the_bounds():
    assert rule.young_daly_seconds(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert rule.interval_steps(2.0, 3600.0, 0.5) == round(math.sqrt(14400) / 0.5)
    assert rule.interval_steps(2.0, 3600.0, 0.5, lo=500) == 500
    assert rule.interval_steps(2.0, 3600.0, 0.5, hi=50) == 50
    assert rule.interval_steps(0.0, 3600.0, 0.5) == 1


def test_the_history_counts_unwarned_ends_leaves_exit_saves_out_and_times_the_steps(tmp_path):
    path = str(tmp_path / "progress.txt")
    write_history(path, kills=2)
    h = rule.read_history(path)
    assert [r.unwarned for r in h.runs] == [True, True, False]
    # a killed run's end is its last line (its last save at 10 + 5 x 102 s): a lower bound
    assert h.unwarned == 2 and h.allocated_s == pytest.approx(520 + 520 + 600)
    assert 9.0 not in h.interval_save_costs and h.exit_save_costs == [9.0]
    assert set(h.interval_save_costs) == {2.0}
    assert h.step_s == pytest.approx(1.0, rel=0.05)
    assert h.queue_waits_s == pytest.approx([110.0, 110.0])
    live = rule.read_history(path, last_run_live=True)
    assert [r.unwarned for r in live.runs] == [True, True, False]  # the last ended "done" anyway
    assert rule.read_history(str(tmp_path / "none.txt")).runs == []


def test_the_choice_names_where_each_input_came_from(tmp_path):
    first = rule.choose(rule.History())
    assert first.interval is None and "default" in first.save_cost_from and first.mtbf_from == "default"
    assert first.mtbf_s == rule.DEFAULT_MTBF_S
    prior = rule.choose(rule.History(), prior_mtbf_s=rule.prior_mtbf_s(100, 4), prior_from=rule.prior_from(100, 4))
    assert prior.mtbf_s == 25 * 3600 and prior.mtbf_from == "[cluster] node_mtbf_hours = 100 over 4 nodes"
    path = str(tmp_path / "progress.txt")
    write_history(path, kills=2, last_done=False)
    h = rule.read_history(path)
    c = rule.choose(h, lo=3, hi=10_000)
    assert c.save_cost_s == 2.0 and c.save_cost_from.startswith("history")
    # the prior (the default here) counts as one more interruption in its time
    assert c.mtbf_s == pytest.approx((2 * 520 + rule.DEFAULT_MTBF_S) / 3)
    assert c.mtbf_from.startswith("history: 2 in 17.3 min of allocation")
    assert c.step_from == "history" and c.interval == round(math.sqrt(2 * 2.0 * c.mtbf_s) / h.step_s)
    line = c.describe()
    for phrase in (f"{c.interval} steps", "save cost 2 s (history", "(history: 2 in", "(history)"):
        assert phrase in line, (phrase, line)
    assert rule.choose(h, hi=50).interval == 50


def test_exit_saves_stand_in_only_for_synchronous_interval_saves():
    h = rule.History(exit_save_costs=[8.0])
    assert rule.choose(h).save_cost_s == 8.0
    assert rule.choose(h, async_save=True).save_cost_s == rule.DEFAULT_SAVE_COST_S


def test_many_interruptions_refine_the_interval_on_their_lost_work():
    """Bursts: interruptions soon after each restart lose all their run's training whatever the interval, so
    the refined interval is longer than Young/Daly's on the average rate."""
    runs = []
    t = 0.0
    for k in range(30):
        span = 300.0 if k % 3 else 20_000.0
        runs.append(rule.RunSpan(t, t + span, True, t, True))
        t += span
    h = rule.History(runs=runs, interval_save_costs=[30.0], step_s=1.0)
    plain = rule.young_daly_seconds(30.0, rule.mtbf_estimate(h)[0])
    c = rule.choose(h)
    assert c.seconds > plain and "refined on the 30 interruptions" in c.describe()


def test_a_run_that_times_its_steps_first_decides_with_the_measured_step():
    c = rule.choose(rule.History()).with_step(0.25, "this run's steps 2-4", 1, None)
    assert c.interval == round(c.seconds / 0.25) and "this run's steps 2-4" in c.describe()
    fields = dict(c.progress_fields(4))
    assert fields[rule.INTERVAL] == str(c.interval) and fields["Iteration"] == "4"


def test_the_progress_line_of_a_choice_is_read_back_as_the_run_s_interval(tmp_path):
    path = str(tmp_path / "progress.txt")
    log = ProgressLog(path, "3", 2, clock=Clock(T0))
    log.starting_job(0, startup_s=0)
    log.save_interval(rule.choose(rule.History()).with_step(0.5, "timed").progress_fields(4))
    (run,) = read_progress(path).runs
    assert rule.history_of_runs([run]).runs[0].interval == rule.choose(rule.History()).with_step(0.5, "x").interval


# ---------------------------------------------------------------------------------------------
# Hindsight (bridge-report) and the job ETA (bridge-status)


def test_hindsight_finds_the_interval_that_would_have_lost_least(tmp_path):
    path = str(tmp_path / "progress.txt")
    write_history(path, kills=6, run_s=3000.0, save_every=20, save_s=2.0)
    h = rule.hindsight(rule.read_history(path))
    assert h.unwarned == 6 and h.lost_to_saves_s > 0
    assert dict(h.curve)[h.best] == h.best_lost_s == min(v for _, v in h.curve)
    assert h.best > 20  # saving every 20 steps at 2 s a save, with 6 interruptions in 5 h, saves too often
    assert h.best_lost_s < h.lost_to_saves_s + h.lost_to_interruptions_s


def test_bridge_report_shows_the_intervals_used_and_the_best_in_hindsight(tmp_path):
    from bridge_hpc.cli.report import load_run_report
    from bridge_hpc.report.table import format_report, reports_to_json

    path = str(tmp_path / "progress.txt")
    write_history(path, kills=3, run_s=3000.0, save_every=20)
    run = load_run_report(path)
    text = format_report([run])
    assert "save interval (steps) per run:" in text and "best save interval in hindsight:" in text
    data = reports_to_json([run])["save_interval"]
    assert data["best_interval"] == run.save_interval.best and data["unwarned_interruptions"] == 3


def test_the_job_eta_counts_requeues_and_says_when_it_cannot_be_known(tmp_path):
    path = str(tmp_path / "progress.txt")
    write_history(path, kills=2, last_done=False)
    h = rule.read_history(path, last_run_live=True)
    assert job_eta(h, 10, None, 1.0, running=True).seconds is None
    none_yet = job_eta(h, None, 1000, None, running=True)
    assert none_yet.seconds is None and none_yet.note.startswith("not yet")
    eta = job_eta(h, 400, 1000, 1.0, running=True, allocation_left_s=100.0, time_limit_s=700.0)
    # 600 steps of 1 s, 2 s saves every 100 steps: +2 %; the time limit ends this allocation after 100 s and
    # then every ~690 s: at least one requeue, each with its start-up (10 s) and queue wait (30 s)
    p = eta.parts
    assert p["time_limit_requeues"] == 1 and p["startup_s"] == pytest.approx(10) and p["queue_wait_s"] == pytest.approx(110)
    assert p["save_share"] == pytest.approx(2 / 100, rel=0.1)
    assert eta.seconds == pytest.approx(600 * 1.0 * (1 + p["save_share"]) + p["requeues_expected"] * (10 + 110)
                                        + p["unwarned_expected"] * p["lost_per_interruption_s"])
    pending = job_eta(h, 400, 1000, 1.0, running=False)
    assert pending.parts["requeues_expected"] >= 1  # the allocation it waits for
    status = LiveStatus("9", "RUNNING", 2, step=400, train_iters=1000, eta_s=eta.seconds, eta_note=eta.note)
    text = "\n".join(screen_lines(status, Path("runs/x")))
    assert "job ETA" in text and "requeues expected" in text and "allocation left" in text
    unknown = LiveStatus("9", "PENDING", 2, eta_note="not yet: no step of this job timed yet")
    assert "not yet: no step" in "\n".join(screen_lines(unknown, Path("runs/x")))


# ---------------------------------------------------------------------------------------------
# Bad input at submission, and the benchmark


BAD = [
    ("not auto", '[checkpoint]\nsave_interval = "autox"\n', "checkpoint.save_interval", "'auto'"),
    ("bounds reversed", '[checkpoint]\nsave_interval = "auto"\nsave_interval_min = 500\nsave_interval_max = 50\n',
     "checkpoint.save_interval_max", ">= checkpoint.save_interval_min (500)"),
    ("a bound of 0", '[checkpoint]\nsave_interval = "auto"\nsave_interval_min = 0\n', "checkpoint.save_interval_min",
     "must be > 0"),
    ("bounds of a fixed interval", '[checkpoint]\nsave_interval = 100\nsave_interval_max = 50\n',
     "checkpoint.save_interval_max", 'bounds checkpoint.save_interval = "auto" only'),
    ("negative MTBF", '[cluster]\nnode_mtbf_hours = -5.0\n[checkpoint]\nsave_interval = "auto"\n',
     "cluster.node_mtbf_hours", "positive number of hours"),
    ("MTBF of zero", '[cluster]\nnode_mtbf_hours = 0\n', "cluster.node_mtbf_hours", "positive number of hours"),
    ("MTBF not a number", '[cluster]\nnode_mtbf_hours = "long"\n', "cluster.node_mtbf_hours", "expected a number"),
]


@pytest.mark.parametrize("what,text,key,phrase", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_and_nothing_submitted(tmp_path: Path, what, text, key, phrase):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nrun_dir = "runs/x"\n' + text.replace("[checkpoint]\n", "[checkpoint]\nsave = \"ck\"\n")
                   + MINIMAL_TRAINING_TOML)
    result = submit_cli("job.toml", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert f"key '{key}'" in result.stderr and "job.toml" in result.stderr and phrase in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()
    set_form = submit_cli("job.toml", "--set", "checkpoint.save_interval=\"auto \"", cwd=tmp_path)
    assert set_form.returncode == 2 and "Traceback" not in set_form.stderr


def test_the_benchmark_simulates_the_product_s_rule_function(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_save_interval", ROOT / "benchmarks" / "save_interval.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.rule is rule  # imported, not a copy
    out = tmp_path / "si.json"
    assert bench.main(["--interruptions", "40", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and all(r["auto_lost_h"] > 0 and r["best_fixed"] in bench.FIXED for r in rows)
