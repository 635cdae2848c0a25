"""``[checkpoint] save_interval = "auto"`` on the local Slurm cluster (issue 37): one job, hard-killed twice.

The demo's tiny GPT (2 CPU ranks) with ``save_interval = "auto"`` runs through ``bridge-submit``; its
ranks are SIGKILLed twice (``scancel --signal=KILL <job>.0``: the job step, not the batch script, which
then requeues the job as after any failure of the ranks), each time just after the current run has
made an interval save, and the job finishes in its third run. Every assertion reads that one job
(a module-scoped fixture, about 3 minutes on a busy machine):

- each run's start logs its interval, its two inputs and where each came from, and the interval changes
  as the history grows (the first run has the ``[cluster]`` prior and the default save cost, the
  later ones their own history);
- the losses equal, bit for bit, those of a straight run of the same job (torchrun, no kill);
- ``bridge-report`` shows the intervals used and the best one in hindsight;
- ``bridge-status`` shows the job's ETA after the second requeue, within 20 % of the actual finish.

Nothing here races the wall clock: the test waits for events (lines in progress.txt, steps in
metrics.jsonl, Slurm states), with generous bounds only as a last resort. The ETA check is made
robust on a busy 2-core machine so: each step sleeps 0.24 s (``TEST_STEP_SLEEP``, the faulty forward
step's knob: sleep, not CPU, so a loaded machine stretches it little), so the 100-odd steps left when
the ETA is taken last ~30 s against a second's noise; the ETA is read once, by ``bridge-status
--json``, just after the third run's fifth step, and compared with the time the run's ``Ending job``
line records minus the time it was read -- a figure, not a race. The ``[cluster]`` prior (30 min)
counts as one interruption more in the ETA's forecast of further ones (as in the interval rule), so two
kills in the job's first two minutes forecast about 0.05 of a further requeue in the last 30 s, not one
a minute; the job's start-ups (10-25 s here) and queue waits priced at that rate are a few percent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from bridge_test_helpers import (
    CONFIG,
    FAULTY_FORWARD_STEP,
    ROOT,
    job_story,
    log_text,
    losses,
    release_when_held,
    sacct_state,
    squeue_state,
    steps_done,
    submit_cli,
)
from warm_ranks import run_job

from bridge_hpc.contracts.progress_log import ENDING_JOB, FIRST_STEP, SAVED_CHECKPOINT, read_progress
from bridge_hpc.contracts.save_interval import SAVE_INTERVAL_EVENT

pytestmark = pytest.mark.slurm

STEPS = 240
#: What every run of the job and the straight run share.
SETTINGS = [
    f"train.train_iters={STEPS}", "train.eval_interval=1000", "logger.log_interval=10",
    'checkpoint.save_interval="auto"', "checkpoint.save_interval_max=100", "checkpoint.most_recent_k=3",
    "cluster.node_mtbf_hours=0.5",  # a 30-minute prior: in range for a job this short
    f'job.forward_step="{FAULTY_FORWARD_STEP}:forward_step"',
]
#: Only the Slurm job sleeps in its steps (the straight run's numerics are the same).
SLEEP = ['env.TEST_STEP_SLEEP="0.12"']  # per micro-batch: 2 a step
WAIT_S = 240.0  # the last-resort bound of each wait


def _progress(run_dir: Path):
    path = run_dir / "checkpoints" / "progress.txt"
    return read_progress(str(path)).runs if path.exists() else []


def _wait(what: str, job_id: str, run_dir: Path, done) -> None:
    """Until ``done()``, releasing Slurm's requeue hold on the way; the job's story when it does not come."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if done():
            return
        state = squeue_state(job_id)
        if state is None:
            break
        release_when_held(job_id)
        time.sleep(0.2)
    # The job may have ended, or done what was awaited, between done() and squeue above: asked once more.
    if done():
        return
    raise AssertionError(f"{what}: did not happen\n{job_story(run_dir, job_id)}")


def _saved_in_run(run_dir: Path, n: int, saves: int) -> bool:
    runs = _progress(run_dir)
    return len(runs) > n and len(runs[n].of(SAVED_CHECKPOINT)) >= saves


def _kill_ranks(job_id: str) -> None:
    subprocess.run(["scancel", "--signal=KILL", f"{job_id}.0"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def killed_twice(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto_interval")
    run_dir, straight = tmp / "run", tmp / "straight"
    # the straight run first, alone on the 2 cores: 2 ranks as torchrun starts them, the same job, no sleep, no kill
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    run_job(CONFIG, [f"job.run_dir={straight}", *SETTINGS], cwd=os.getcwd(), env=env, timeout=900)

    cli = [str(CONFIG), "--set", f"job.run_dir={run_dir}"]
    for item in SETTINGS + SLEEP:
        cli += ["--set", item]
    submitted = submit_cli(*cli, cwd=ROOT, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[2]
    try:
        for run in (0, 1):  # kill each run just after its first interval save
            _wait(f"run {run}'s first interval save", job_id, run_dir, lambda run=run: _saved_in_run(run_dir, run, 1))
            _kill_ranks(job_id)
            _wait(f"run {run + 1} started", job_id, run_dir, lambda run=run: len(_progress(run_dir)) > run + 1)
        _wait("the third run's first step", job_id, run_dir,
              lambda: len(_progress(run_dir)) > 2 and _progress(run_dir)[2].last(FIRST_STEP) is not None)
        first = int(_progress(run_dir)[2].last(FIRST_STEP).number("Iteration"))
        _wait("the third run's fifth step", job_id, run_dir, lambda: steps_done(run_dir) >= first + 5)
        asked = time.time()
        status = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.status", str(run_dir), "--json"],
                                capture_output=True, text=True, timeout=120)
        text_status = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.status", str(run_dir)],
                                     capture_output=True, text=True, timeout=120)
        _wait("the job's end", job_id, run_dir, lambda: squeue_state(job_id) is None)
        final = sacct_state(job_id)
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True)
        raise
    assert status.returncode == 0, status.stderr
    runs = _progress(run_dir)
    return SimpleNamespace(job_id=job_id, run_dir=run_dir, straight=straight, final=final, runs=runs,
                           status=json.loads(status.stdout), status_text=text_status.stdout, asked=asked,
                           log=log_text(run_dir, job_id))


def test_each_start_logs_its_interval_and_inputs_and_the_interval_follows_the_history(killed_twice):
    k = killed_twice
    assert k.final == "COMPLETED", job_story(k.run_dir, k.job_id)
    assert len(k.runs) == 3 and [r.last(ENDING_JOB) is None for r in k.runs] == [True, True, False]
    lines = [line for line in k.log.splitlines() if 'checkpoint.save_interval = "auto":' in line and " steps = " in line]
    assert len(lines) == 3, "\n".join(lines) or job_story(k.run_dir, k.job_id)
    first, second, third = lines
    assert "[cluster] node_mtbf_hours = 0.5 over 1 node" in first and "default: no save recorded yet" in first
    for later, kills in ((second, 1), (third, 2)):
        assert f"history: {kills} in " in later and "history, median of the last" in later, later
    chosen = [int(r.last(SAVE_INTERVAL_EVENT).number("Interval")) for r in k.runs]
    mtbf = [r.last(SAVE_INTERVAL_EVENT).number("Unwarned MTBF hours") for r in k.runs]
    assert chosen[0] == 100  # the prior and the default save cost: the bound
    assert chosen[1] < 100 and chosen[2] < 100 and len(set(chosen)) >= 2, chosen  # as the history grows
    assert mtbf[0] > mtbf[1] > mtbf[2], mtbf  # each kill shortens the estimate


def test_the_resumed_job_reproduces_a_straight_run_bit_for_bit(killed_twice):
    got, want = losses(killed_twice.run_dir), losses(killed_twice.straight)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want


def test_bridge_report_shows_the_intervals_used_and_the_best_in_hindsight(killed_twice):
    k = killed_twice
    report = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(k.run_dir), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    interval = json.loads(report.stdout)["save_interval"]
    chosen = [int(r.last(SAVE_INTERVAL_EVENT).number("Interval")) for r in k.runs]
    assert interval["used"] == chosen and interval["unwarned_interruptions"] == 2
    assert interval["best_interval"] is not None and interval["best_lost_s"] >= 0 and interval["best_goodput"] > 0
    text = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(k.run_dir), "--plot",
                           str(k.run_dir / "report.png")], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert f"save interval (steps) per run: {', '.join(f'{n} (auto)' for n in chosen)}" in text.stdout
    assert f"best save interval in hindsight: {interval['best_interval']} steps" in text.stdout
    assert (k.run_dir / "report.png").stat().st_size > 0


def test_bridge_status_shows_the_job_eta_after_the_second_requeue_within_20_percent(killed_twice):
    k = killed_twice
    eta = k.status["eta"]
    assert eta is not None and eta["seconds"] is not None, k.status
    assert "job ETA (to train_iters, across requeues)" in k.status_text and "allocation left" in k.status_text
    finished = k.runs[-1].last(ENDING_JOB).time  # the progress log's stamp: 1 s resolution
    actual = finished - k.asked
    print(f"job ETA {eta['seconds']:.1f} s ({eta['note']}); actual {actual:.1f} s")
    assert actual > 15, (actual, eta)
    assert abs(eta["seconds"] - actual) <= 0.2 * actual, (eta, actual)
