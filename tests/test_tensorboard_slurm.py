"""TensorBoard by default: every run of a job adds to one trajectory, however often it is requeued.

Each run of a job writes its own event file in ``RUN/tensorboard`` whose writer purges the earlier files
from the run's first step on (:mod:`bridge_hpc.training.engine.metrics`). The events are read the ways TensorBoard
reads them: its Python reader (``EventAccumulator``, ``--load_fast=false``), a real ``tensorboard`` server
with its Rust data server (``--load_fast=true``, the default where installed) over HTTP, and the raw event
files record by record.

* ``test_a_killed_run_and_an_overlapping_resume_show_each_step_once`` (~15 s, no Slurm): a run SIGKILLed
  after training past its checkpoint and a run that resumes behind the previous one's last step; both
  readers must show each step once, with the value of the run that kept it.
* ``test_preempted_twice_on_slurm_events_match_metrics`` (~100 s): the demo job on the local cluster,
  preempted twice with ``scancel --signal=USR1`` and then finished; every scalar's steps rise strictly,
  the per-step ones have metrics.jsonl's steps and (but for the per-rank timings) its values to float32
  precision, and the goodput scalars equal the progress log's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
from bridge_test_helpers import drive, free_port, log_text, losses, sacct_runs, submit, wait_running_past

from bridge_hpc.contracts.progress_log import parse_progress
from bridge_hpc.contracts.run_folder import METRICS_FILE, RunFolder
from bridge_hpc.training.engine.metrics import (
    LOAD_TAG,
    LOST_STEPS_TAG,
    RESTARTS_TAG,
    SAVE_TAG,
    STARTUP_TAG,
    TENSORBOARD_TAGS,
    read_metrics,
)

Points = Dict[str, List[Tuple[int, float]]]


# ---------------------------------------------------------------------------------------------
# Reading events as TensorBoard does
# ---------------------------------------------------------------------------------------------


def accumulated(logdir: Path) -> Points:
    """tag -> [(step, value)] as TensorBoard's Python reader shows them (purge events honoured)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(logdir: Path) -> List[Path]:
    """The run's event files in the order TensorBoard reads them (by name)."""
    return sorted(p for p in logdir.iterdir() if p.name.startswith("events.out.tfevents."))


def raw_events(path: Path) -> Tuple[List[int], Points]:
    """One event file as written: the steps of its SessionLog.START events and tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto import event_pb2

    starts: List[int] = []
    points: Points = {}
    for event in EventFileLoader(str(path)).Load():
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            starts.append(event.step)
        for value in event.summary.value:
            points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return starts, points


def served(logdir: Path, tags: List[str], want: Dict[str, int], scratch: Path, timeout: float = 60) -> Points:
    """tag -> [(step, value)] from a real ``tensorboard --logdir LOGDIR --load_fast=true`` over HTTP (the
    Rust data server); ``want`` = tag -> the number of points to wait for (it loads in the background)."""
    port = free_port()
    with open(scratch / "tensorboard.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                   "127.0.0.1", "--port", str(port), "--load_fast=true", "--reload_interval=1"],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        got: Points = {}
        while time.time() < deadline:
            try:
                runs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5))
                got = {}
                for run, run_tags in runs.items():
                    for tag in tags:
                        if tag in run_tags:
                            query = urllib.parse.urlencode({"run": run, "tag": tag})
                            url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
                            got[tag] = [(step, value) for _, step, value in json.load(urllib.request.urlopen(url))]
                if all(len(got.get(tag, [])) >= n for tag, n in want.items()):
                    return got
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise AssertionError(f"tensorboard did not serve {want} within {timeout} s: got "
                             f"{ {t: len(p) for t, p in got.items()} }; {(scratch / 'tensorboard.log').read_text()[-2000:]}")
    finally:
        server.send_signal(signal.SIGTERM)  # it stops its data server on the way out
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def f32(value: float) -> float:
    """What a TensorBoard scalar (float32) holds of ``value``."""
    return float(np.float32(value))


def assert_strictly_rising(points: Points) -> None:
    for tag, pts in points.items():
        steps = [s for s, _ in pts]
        assert all(a < b for a, b in zip(steps, steps[1:])), f"{tag}: steps not strictly increasing: {steps}"


# ---------------------------------------------------------------------------------------------
# Without Slurm: a killed run and an overlapping resume, written by the real MetricsLogger
# ---------------------------------------------------------------------------------------------

#: One run of a job in its own process: MetricsLogger opened at RESUME, steps RESUME+1..UPTO logged with a
#: loss that says which run wrote it, a checkpoint "saved" every 10 steps; then it waits to be killed.
KILLED_RUN = """
import sys, time
from bridge_hpc.training.engine.metrics import MetricsLogger, RunStart
folder, resume, upto = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = MetricsLogger(folder + "/metrics.jsonl", 0, 1, folder + "/tensorboard")
m.open(resume, RunStart(restart_count=0, load_s=None, started_at=time.time()))
for step in range(resume + 1, upto + 1):
    m.log({"step": step, "loss": 10.0 + step / 100})
    if step % 10 == 0:
        m.log_checkpoint_saved(step, 0.5)
print("logged", upto, flush=True)
time.sleep(600)
"""


def _run_in_process(folder: Path, resume: int, upto: int, run: int) -> None:
    from bridge_hpc.training.engine.metrics import MetricsLogger, RunStart

    m = MetricsLogger(str(folder / METRICS_FILE), 0, 1, RunFolder(str(folder)).tensorboard)
    m.open(resume, RunStart(restart_count=run, load_s=0.25, started_at=time.time() - 1.0))
    for step in range(resume + 1, upto + 1):
        m.log({"step": step, "loss": 10.0 * (run + 1) + step / 100})
        if step % 10 == 0:
            m.log_checkpoint_saved(step, 0.5)
    m.close()


def test_a_killed_run_and_an_overlapping_resume_show_each_step_once(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    # run 0: trains to 27, checkpoint at 20, SIGKILLed (its writer never closes)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(folder), "0", "27"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().split() == ["logged", "27"]
    finally:
        proc.kill()
        proc.wait()
    time.sleep(1.1)  # event file names carry the second they were made: one run per second at most
    _run_in_process(folder, 20, 40, run=1)  # resumes at 20, closes at 40 after a checkpoint at 30 ...
    time.sleep(1.1)
    _run_in_process(folder, 30, 45, run=2)  # ... and run 2 resumes at 30: steps 31-40 written twice

    logdir = folder / "tensorboard"
    files = event_files(logdir)
    assert len(files) == 3
    raw = [raw_events(f) for f in files]
    assert [starts for starts, _ in raw] == [[1], [21], [31]]  # purge_step = the first step each run trains
    assert [s for s, _ in raw[0][1]["lm loss"]][:20] == list(range(1, 21))  # on disk by its checkpoint, though killed
    assert [s for s, _ in raw[1][1]["lm loss"]] == list(range(21, 41))  # the overlap is in the files ...

    def owner(step: int) -> int:  # the run whose value TensorBoard must show
        return 0 if step <= 20 else 1 if step <= 30 else 2

    metrics = read_metrics(str(folder / METRICS_FILE))
    assert sorted(metrics) == list(range(1, 46))
    want_loss = [(s, f32(10.0 * (owner(s) + 1) + s / 100)) for s in range(1, 46)]
    assert [(s, f32(r["loss"])) for s, r in sorted(metrics.items())] == want_loss
    points = accumulated(logdir)  # ... and not in what TensorBoard shows
    assert_strictly_rising(points)
    assert points["lm loss"] == want_loss
    assert points[SAVE_TAG] == [(10, 0.5), (20, 0.5), (30, 0.5), (40, 0.5)]
    assert points[RESTARTS_TAG] == [(1, 0.0), (21, 1.0), (31, 2.0)]
    assert points[LOST_STEPS_TAG] == [(1, 0.0), (21, 7.0), (31, 10.0)]  # 21-27, then 31-40: trained twice
    assert points[LOAD_TAG] == [(21, 0.25), (31, 0.25)]
    assert [s for s, _ in points[STARTUP_TAG]] == [1, 21, 31] and all(v >= 1.0 for _, v in points[STARTUP_TAG][1:])
    # The Rust data server ignores purge events but drops a series' points from a step on when that step
    # comes again: the same view.
    tags = ["lm loss", SAVE_TAG, RESTARTS_TAG, LOST_STEPS_TAG]
    server = served(tmp_path, tags, {"lm loss": 45, RESTARTS_TAG: 3}, tmp_path)
    assert {tag: [(s, f32(v)) for s, v in server[tag]] for tag in tags} == {tag: points[tag] for tag in tags}


# ---------------------------------------------------------------------------------------------
# On the local cluster: preempted twice, then finished
# ---------------------------------------------------------------------------------------------

ITERS = 200
PREEMPT_AT = (50, 130)
EVAL_INTERVAL = 50  # bridge_test_helpers.overrides


@pytest.mark.slurm
@pytest.mark.slow
def test_preempted_twice_on_slurm_events_match_metrics(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS)
    for step in PREEMPT_AT:
        wait_running_past(job_id, run_dir, step)
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED", log_text(run_dir, job_id)[-4000:]
    runs = parse_progress(RunFolder(str(run_dir)).progress_log())
    assert [r.last("Ending job").fields["Reason"] for r in runs] == ["signal", "signal", "done"]
    assert len(sacct_runs(job_id)) == 3
    loaded = [int(r.last("Loaded checkpoint").fields["Iteration"]) for r in runs[1:]]
    first_steps = [1] + [step + 1 for step in loaded]
    assert first_steps == [int(r.last("First step").fields["Iteration"]) for r in runs]

    losses(run_dir)  # fails on a step logged twice
    metrics = read_metrics(str(run_dir / METRICS_FILE))
    assert sorted(metrics) == list(range(1, ITERS + 1))

    # The raw files: one per run, each purging from its first step and writing nothing before it; the runs
    # ended on a checkpoint of their last step (USR1), so no step is even written twice.
    logdir = Path(RunFolder(str(run_dir)).tensorboard)
    files = event_files(logdir)
    assert len(files) == len(runs)
    written: Dict[str, List[int]] = {}
    for path, first in zip(files, first_steps):
        starts, points = raw_events(path)
        assert starts == [first], path
        assert_strictly_rising(points)
        assert min(s for pts in points.values() for s, _ in pts) >= first, path
        for tag, pts in points.items():
            written.setdefault(tag, []).extend(s for s, _ in pts)
    assert written["lm loss"] == list(range(1, ITERS + 1))

    # What TensorBoard shows: the per-step scalars equal metrics.jsonl; the timings (each rank times its
    # own steps, and metrics.jsonl is rank 0's while TensorBoard is the last rank's) on the same steps.
    points = accumulated(logdir)
    assert_strictly_rising(points)
    for key, tag in TENSORBOARD_TAGS.items():
        want = [(s, f32(r[key])) for s, r in sorted(metrics.items()) if r.get(key) is not None]
        if key in ("tokens_per_s", "step_time_s"):
            assert [s for s, _ in points[tag]] == [s for s, _ in want] and all(v > 0 for _, v in points[tag]), tag
        elif want:
            assert points[tag] == want, tag
    for tag in ("lm loss", "learning-rate", "grad-norm", "throughput/tokens_per_sec", "iteration-time"):
        assert len(points[tag]) == ITERS, tag
    validation = [s for s, _ in points["lm loss validation"]]
    assert set(validation) <= set(range(EVAL_INTERVAL, ITERS + 1, EVAL_INTERVAL)) and validation[-1] == ITERS

    # Goodput: the progress log's figures (it rounds seconds to 0.1), at the steps they belong to. The
    # progress log is rank 0's and TensorBoard the last rank's: a save is timed between barriers and a
    # load is the slowest rank's (collectives.slowest_rank), so both records hold one figure however
    # busy the machine (each rank's own load time differed by > 0.05 s under load).
    saves = [e for r in runs for e in r.of("Saved checkpoint")]
    assert [s for s, _ in points[SAVE_TAG]] == [int(e.fields["Iteration"]) for e in saves]
    assert all(abs(v - e.number("Save seconds")) <= 0.051 for (_, v), e in zip(points[SAVE_TAG], saves))
    assert [s for s, _ in points[LOAD_TAG]] == first_steps[1:]
    assert all(abs(v - r.last("Loaded checkpoint").number("Load seconds")) <= 0.051
               for (_, v), r in zip(points[LOAD_TAG], runs[1:]))
    assert points[RESTARTS_TAG] == [(s, float(r.restart_count)) for s, r in zip(first_steps, runs)] == \
        list(zip(first_steps, [0.0, 1.0, 2.0]))
    assert points[LOST_STEPS_TAG] == [(s, 0.0) for s in first_steps]  # each run saved the step it stopped at
    assert [s for s, _ in points[STARTUP_TAG]] == first_steps
    for (_, value), run in zip(points[STARTUP_TAG], runs):  # the last rank's clock against rank 0's
        assert abs(value - run.last("First step").number("Start-up seconds")) < 2.0

    # And a real `tensorboard --logdir runs/` (the Rust data server) shows the same.
    tags = ["lm loss", "lm loss validation", SAVE_TAG, RESTARTS_TAG]
    server = served(tmp_path, tags, {"lm loss": ITERS, RESTARTS_TAG: 3}, tmp_path)
    assert {tag: [(s, f32(v)) for s, v in server[tag]] for tag in tags} == {tag: points[tag] for tag in tags}
