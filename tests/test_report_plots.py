"""bridge-report's figure and table, from real runs on the local cluster.

Two jobs are made once for the module: the demo as shipped (configs/local-tiny.toml, 40 steps) and the
demo preempted once (200 steps, ``scancel --signal=USR1`` past step 60, requeued, finished). The tests
build the figure objects and check what a person would read off them against what the runs left
behind, read here independently of the report: the losses in metrics.jsonl, the validation lines and
the step each run resumed from in the job's log, the run boundaries in the progress log.
About a minute on 2 cores (both jobs, most of it start-up of the ranks).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from bridge_test_helpers import CONFIG, ROOT, drive, log_text, losses, submit, submit_cli, wait_running_past

from bridge_hpc.cli.report import load_run_report, main
from bridge_hpc.contracts.progress_log import parse_progress
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.report.plot import (
    IN_JOB_RESTART,
    ITERATION_LABEL,
    LOSS_LABEL,
    QUEUE_WAIT,
    build_figure,
    save_figure,
)
from bridge_hpc.report.units import format_rate

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PREEMPTED_ITERS = 200
PREEMPT_PAST = 60
#: The lines rank 0 prints, read here with patterns of the test's own.
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+)")
LOADED = re.compile(r"loaded checkpoint \S+ \(iteration (\d+)\)")
SEGMENTS = ("training", "start-up", "checkpoint save", "checkpoint load", "lost work", "in-job restart")
UNIT_SECONDS = {"s": 1.0, "min": 60.0, "h": 3600.0}


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """{"demo": (run_dir, job_id), "preempted": (run_dir, job_id)}, both COMPLETED."""
    base = tmp_path_factory.mktemp("report-plots")
    demo = base / "demo"
    proc = submit_cli(str(CONFIG), "--set", f"job.run_dir={demo}", cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    demo_job = proc.stdout.split()[2]
    preempted = base / "preempted"
    preempted_job = submit(preempted, PREEMPTED_ITERS)  # runs after the demo: the node has 2 CPUs
    wait_running_past(preempted_job, preempted, PREEMPT_PAST, timeout=600)  # other jobs may be queued first
    subprocess.run(["scancel", "--signal=USR1", preempted_job], check=True)
    assert drive(preempted_job) == "COMPLETED", log_text(preempted, preempted_job)[-3000:]
    assert drive(demo_job) == "COMPLETED", log_text(demo, demo_job)[-3000:]
    return {"demo": (demo, demo_job), "preempted": (preempted, preempted_job)}


# --------------------------------------------------------------------------------------------------
# What the runs left behind, read without the report


def validation_from_log(run_dir: Path, job_id: str) -> dict:
    return {int(step): float(value) for step, value in VALIDATION.findall(log_text(run_dir, job_id))}


def validation_from_metrics(run_dir: Path) -> dict:
    """step -> the validation loss metrics.jsonl's record of that step carries (full precision)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def assert_validation_shown(validation, run_dir: Path, job_id: str, steps: list) -> None:
    """The validation line holds metrics.jsonl's values at ``steps``, which are what the job printed."""
    recorded, printed = validation_from_metrics(run_dir), validation_from_log(run_dir, job_id)
    assert sorted(recorded) == sorted(printed) == steps
    assert all(recorded[s] == pytest.approx(printed[s], rel=1e-6) for s in steps)  # printed as %.6E
    assert list(validation.get_xdata()) == steps and list(validation.get_ydata()) == [recorded[s] for s in steps]


def resumed_steps(run_dir: Path, job_id: str) -> list:
    return [int(step) for step in LOADED.findall(log_text(run_dir, job_id))]


def tokens_per_s(run_dir: Path, steps) -> float:
    """Tokens over step time for ``steps``, from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    chosen = [r for r in records if r["step"] in set(steps)]
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in chosen) / sum(r["step_time_s"] for r in chosen)


def run_spans(run_dir: Path) -> list:
    """(start, end) epoch of each run: the ranks' process start and the Ending job line."""
    spans = []
    for run in parse_progress(RunFolder(str(run_dir)).progress_log()):
        start = run.start.time - float(run.start.fields["Seconds since process start"])
        spans.append((start, run.last("Ending job").time))
    return spans


# --------------------------------------------------------------------------------------------------
# Checks shared by the figures


def panels(fig):
    axes = fig.axes
    assert len(axes) == 4, [a.get_title() for a in axes]  # CPU ranks: no TFLOP/s/GPU axis
    return axes


def time_unit_of(label: str) -> float:
    unit = re.search(r"\((s|min|h)\)$", label)
    assert unit, label
    return UNIT_SECONDS[unit.group(1)]


def goodput_bars(ax) -> dict:
    """label -> total width of the goodput panel's bar containers (segments of the allocated bar)."""
    widths = {}
    for container in ax.containers:
        name = re.sub(r" [0-9.]+%$", "", container.get_label())
        widths[name] = widths.get(name, 0.0) + sum(p.get_width() for p in container.patches)
    return widths


def check_goodput(ax, report) -> dict:
    unit = time_unit_of(ax.get_xlabel())
    widths = goodput_bars(ax)
    assert set(widths) == set(SEGMENTS) | {QUEUE_WAIT}
    totals = report.totals
    assert sum(widths[s] for s in SEGMENTS) * unit == pytest.approx(totals["allocated_s"])
    assert widths["training"] * unit == pytest.approx(totals["training_s"]) and widths["training"] > 0
    assert widths[QUEUE_WAIT] * unit == pytest.approx(totals["between_allocations_s"])
    return widths


def restart_markers(ax) -> list:
    return [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"]


# --------------------------------------------------------------------------------------------------
# Tests


def test_demo_run_figure(jobs):
    run_dir, job_id = jobs["demo"]
    run = load_run_report(str(run_dir))
    loss, progress, throughput, goodput = panels(build_figure([run]))

    want = losses(run_dir)
    assert sorted(want) == list(range(1, 41))  # the demo's train_iters
    training, validation = loss.lines
    assert (training.get_label(), validation.get_label()) == ("training", "validation")
    assert list(training.get_xdata()) == sorted(want) and list(training.get_ydata()) == [want[s] for s in sorted(want)]
    assert_validation_shown(validation, run_dir, job_id, [20, 40])  # eval_interval 20
    assert (loss.get_xlabel(), loss.get_ylabel()) == ("step", LOSS_LABEL)
    assert restart_markers(loss) == []

    (line,) = progress.lines
    (start, end), = run_spans(run_dir)
    unit = time_unit_of(progress.get_xlabel())
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    assert (xs[0], ys[0], ys[-1]) == (0, 0, 40) and xs[-1] * unit == pytest.approx(end - start)
    assert 2 <= xs[-1] < 120, progress.get_xlabel()  # numbers a person reads, not 0.0030 h
    assert progress.get_ylabel() == ITERATION_LABEL and not progress.patches  # no queue wait

    (bar,) = throughput.patches
    rate = tokens_per_s(run_dir, range(2, 41))  # the first step is start-up
    label = throughput.get_ylabel()
    scale = {"training throughput (tokens/s)": 1, "training throughput (k tokens/s)": 1e3,
             "training throughput (M tokens/s)": 1e6}[label]
    assert bar.get_height() * scale == pytest.approx(rate) and 1 <= bar.get_height() < 1000

    widths = check_goodput(goodput, run.report)
    saved = [float(e.fields["Save seconds"]) for r in parse_progress(run.progress_log) for e in r.of("Saved checkpoint")]
    seconds = time_unit_of(goodput.get_xlabel())
    assert len(saved) == 4 and widths["checkpoint save"] * seconds == pytest.approx(sum(saved))  # save_interval 10
    assert widths[QUEUE_WAIT] == 0


def test_preempted_run_figure(jobs):
    run_dir, job_id = jobs["preempted"]
    run = load_run_report(str(run_dir))
    loss, progress, throughput, goodput = panels(build_figure([run]))

    resumed = resumed_steps(run_dir, job_id)
    assert len(resumed) == 1 and PREEMPT_PAST <= resumed[0] < PREEMPTED_ITERS, resumed
    assert restart_markers(loss) == resumed
    assert f" requeue {job_id}/1: step {resumed[0]}" in [t.get_text() for t in loss.texts]
    want = losses(run_dir)
    training, validation = loss.lines[:2]
    assert list(training.get_xdata()) == list(range(1, PREEMPTED_ITERS + 1))
    assert list(training.get_ydata()) == [want[s] for s in range(1, PREEMPTED_ITERS + 1)]
    assert_validation_shown(validation, run_dir, job_id, [50, 100, 150, 200])

    spans = run_spans(run_dir)
    assert len(spans) == 2
    unit = time_unit_of(progress.get_xlabel())
    first, second = progress.lines
    assert (first.get_ydata()[-1], second.get_ydata()[0], second.get_ydata()[-1]) == (resumed[0], resumed[0],
                                                                                       PREEMPTED_ITERS)
    (wait,) = progress.patches
    t0 = spans[0][0]
    assert wait.get_label() == QUEUE_WAIT
    assert wait.get_x() * unit == pytest.approx(spans[0][1] - t0)
    assert (wait.get_x() + wait.get_width()) * unit == pytest.approx(spans[1][0] - t0)
    assert second.get_xdata()[0] == pytest.approx(wait.get_x() + wait.get_width())

    heights = [p.get_height() for p in throughput.patches]
    assert len(heights) == 2 and all(1 <= h < 1000 for h in heights)
    assert [t.get_text() for t in throughput.get_xticklabels()] == [f"{job_id}/0", f"{job_id}/1"]

    widths = check_goodput(goodput, run.report)
    seconds = time_unit_of(goodput.get_xlabel())
    assert widths[QUEUE_WAIT] * seconds == pytest.approx(spans[1][0] - spans[0][1])
    loaded = [float(e.fields["Load seconds"]) for r in parse_progress(run.progress_log) for e in r.of("Loaded checkpoint")]
    assert len(loaded) == 1 and widths["checkpoint load"] * seconds == pytest.approx(loaded[0])
    assert widths[IN_JOB_RESTART] == 0


def test_two_run_folders_overlaid_and_compared(jobs, tmp_path, capsys):
    (demo, _), (preempted, preempted_job) = jobs["demo"], jobs["preempted"]
    runs = [load_run_report(str(demo), "demo"), load_run_report(str(preempted), "preempted")]
    fig = build_figure(runs)
    loss, progress, throughput, goodput = panels(fig)
    labelled = {line.get_label(): line for line in loss.lines if not line.get_label().startswith("_")}
    assert set(labelled) == {"demo: training", "demo: validation", "preempted: training", "preempted: validation"}
    assert len(labelled["demo: training"].get_xdata()) == 40
    assert len(labelled["preempted: training"].get_xdata()) == PREEMPTED_ITERS
    assert labelled["demo: training"].get_color() != labelled["preempted: training"].get_color()
    assert restart_markers(loss) == resumed_steps(preempted, preempted_job)  # the demo did not resume
    assert [len(line.get_xdata()) > 1 for line in progress.lines] == [True] * 3
    assert len(throughput.patches) == 3
    assert len(goodput.get_yticks()) == 4  # allocated and queue wait of each folder
    out = tmp_path / "report.png"
    save_figure(fig, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main([str(demo), str(preempted), "--plot", str(tmp_path / "cli.png")]) == 0
    text = capsys.readouterr().out
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    comparison = text.split("comparison\n")[1].splitlines()
    header = re.split(r"\s{2,}", comparison[0])
    rows = {cells[0]: dict(zip(header, cells)) for cells in (re.split(r"\s{2,}", line) for line in comparison[1:])}
    assert set(rows) == {"demo", "preempted"}
    for name, run_dir, iters in (("demo", demo, 40), ("preempted", preempted, PREEMPTED_ITERS)):
        row = rows[name]
        assert (row["devices"], row["final step"], row["TFLOP/s/GPU"]) == ("2 cpu", str(iters), "-")
        assert row["final loss"] == f"{losses(run_dir)[iters]:.4f}"
        assert row["runs"] == ("1" if name == "demo" else "2")
    # the demo's run row: devices and tokens/s as a person reads them
    demo_row = re.split(r"\s{2,}", text.splitlines()[2])
    assert demo_row[2] == "2 cpu" and demo_row[7] == format_rate(tokens_per_s(demo, range(2, 41)))
