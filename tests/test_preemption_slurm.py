"""Preemptible by design, end to end on the real local cluster.

Each test interrupts a real 2-rank job (preemption by a higher-priority partition, scancel signals,
the time limit, exit_duration/exit_interval), lets it requeue itself, and then checks against an
uninterrupted run of the same config: the same steps, the same losses bit for bit, the same final
parameters; no step lost or repeated; the progress log and bridge-report account for every run.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import (
    FAULTY_FORWARD_STEP,
    assert_bitwise_equal,
    drive,
    log_text,
    losses,
    model_params,
    reference_run,
    sacct_runs,
    squeue_state,
    steps_done,
    submit,
    wait_running_past,
)

from bridge_hpc.contracts.progress_log import parse_progress

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITERS = 300  # a few seconds of training on 2 CPU ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reference") / "run", ITERS)


def check_exact(run_dir: Path, reference: Path, job_id: str, scratch: Path, iters: int = ITERS) -> list:
    """Everything an interrupted job must equal; returns its runs from the progress log."""
    log = log_text(run_dir, job_id)
    assert sacct_runs(job_id)[-1] == "COMPLETED", log[-4000:]
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, iters + 1)), log[-4000:]
    assert got == want  # bitwise: floats compared exactly
    final = f"iter_{iters:07d}"
    assert_bitwise_equal(model_params(str(run_dir / "checkpoints" / final), str(scratch)),
                         model_params(str(reference / "checkpoints" / final), str(scratch)))
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    # every run ended with a checkpoint of its last step, and the next one loaded exactly that step
    for before, after in zip(runs, runs[1:]):
        end = before.last("Ending job")
        assert end is not None and end.fields["Steps lost"] == "0", end
        assert after.last("Loaded checkpoint").fields["Iteration"] == end.fields["Iteration"]
    assert runs[-1].last("Ending job").fields["Reason"] == "done"
    # Slurm's runs of this job and the progress log's runs are the same ones, and the report shows them
    assert len(runs) == len(sacct_runs(job_id))
    report = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir), "--json"],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["runs"]
    assert [r["restart"] for r in rows] == list(range(len(runs)))
    assert [r["reason"] for r in rows] == [run.last("Ending job").fields["Reason"] for run in runs]
    return runs


def test_preempted_twice_by_the_urgent_partition(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS)
    for at_step in (60, 180):
        wait_running_past(job_id, run_dir, at_step)
        # An urgent job needs a CPU the preemptible job holds: Slurm preempts it (SIGTERM, grace time).
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-n", "1", "-t", "00:01:00",
                                 "-o", str(tmp_path / "urgent-%j.out"), "--wrap", "sleep 1"],
                                capture_output=True, text=True, check=True).stdout.strip()
        deadline = time.time() + 120
        while squeue_state(urgent) is not None and time.time() < deadline:
            time.sleep(0.5)
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, reference, job_id, tmp_path)
    assert [r.last("Ending job").fields["Reason"] for r in runs] == ["signal", "signal", "done"]
    assert "requeueing" in log_text(run_dir, job_id)


def test_scancel_usr1_at_a_random_moment(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS)
    # A random step of training and a random moment inside it (a sleep of fixed range could outlast
    # the training itself once steps and the exit got faster).
    wait_running_past(job_id, run_dir, random.randint(1, ITERS - 50))
    time.sleep(random.uniform(0.0, 0.05))
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, reference, job_id, tmp_path)
    assert len(runs) == 2 and runs[0].last("Ending job").fields["Reason"] == "signal"
    assert runs[1].restart_count == 1  # SLURM_RESTART_COUNT reached the ranks


#: The job that saves every step: short, as each of its steps writes a checkpoint.
SAVING_ITERS = 80


@pytest.fixture(scope="module")
def saving_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("saving-reference") / "run", SAVING_ITERS)


def test_signal_during_checkpoint_saves_and_a_second_sigterm(slurm_cluster, saving_reference, tmp_path):
    """Saving every step, a signal very likely lands inside a save; a SIGTERM right behind it must
    neither be lost nor corrupt the save in progress."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, SAVING_ITERS, ["checkpoint.save_interval=1"])
    wait_running_past(job_id, run_dir, 20)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    time.sleep(0.05)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, saving_reference, job_id, tmp_path, SAVING_ITERS)
    assert len(runs) == 2


#: Each forward pass (2 a step) sleeps this long on top of its work in the exit_duration job: its
#: ITERS steps take more than 30 s however fast the machine, more than one run's duration below, and
#: the sleep, not the machine's load, sets most of a step's time (2 runs here, idle or loaded; a
#: 6-second duration without it took 5 runs idle and more under load).
DURATION_STEP_SLEEP = 0.05
#: The exit_duration job's runs: 30 s each, counted from the start of pretrain.
EXIT_DURATION_MINS = 0.5


def test_exit_interval_and_exit_duration_requeue_until_done(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "interval"
    job_id = submit(run_dir, ITERS, [f"train.exit_interval={ITERS // 2}"])
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, reference, job_id, tmp_path)
    assert [r.last("Ending job").fields["Reason"] for r in runs] == ["interval", "done"]

    run_dir = tmp_path / "duration"
    job_id = submit(run_dir, ITERS, [f"train.exit_duration_in_mins={EXIT_DURATION_MINS}",
                                     f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                                     f"env.TEST_STEP_SLEEP='{DURATION_STEP_SLEEP}'"])
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, reference, job_id, tmp_path)
    reasons = [r.last("Ending job").fields["Reason"] for r in runs]
    assert len(runs) >= 2 and set(reasons[:-1]) == {"duration"} and reasons[-1] == "done"


TIME_LIMIT_ITERS = 400
#: Each forward pass (2 micro-batches a step) sleeps this long on top of its work, so the job needs
#: more than 80 s of training however fast the machine: more than the first 2-minute allocation can
#: hold (its ranks stop 50 s before the end at the latest: the next step, a first save guessed at 30 s
#: and a 20 s margin). The warning signal (``@30``) may come up to 60 s early (Slurm's resolution), so
#: 30 s into a run at the soonest: after the first step on a loaded machine (a one-minute limit let it
#: come before the first step). Few steps, each slow: the straight reference run (no sleep) stays short.
TIME_LIMIT_STEP_SLEEP = 0.1


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("long-reference") / "run", TIME_LIMIT_ITERS)


def test_two_minute_time_limit_requeues_until_done(slurm_cluster, long_reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, TIME_LIMIT_ITERS,
                    ["slurm.time=00:02:00", "slurm.signal=USR1@30", "checkpoint.save_interval=100",
                     f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                     f"env.TEST_STEP_SLEEP='{TIME_LIMIT_STEP_SLEEP}'"])
    assert drive(job_id, timeout=1500) == "COMPLETED"
    runs = check_exact(run_dir, long_reference, job_id, tmp_path, TIME_LIMIT_ITERS)
    reasons = [r.last("Ending job").fields["Reason"] for r in runs]
    # every allocation but the last ended at its time limit (its warning signal, or the end time
    # read from Slurm, whichever came first), none by Slurm killing it
    assert len(runs) >= 2 and set(reasons[:-1]) == {"time_limit"} and reasons[-1] == "done"
    assert "TIMEOUT" not in sacct_runs(job_id)
    assert steps_done(run_dir) == TIME_LIMIT_ITERS


def test_plain_scancel_ends_the_job_for_good(slurm_cluster, tmp_path):
    """A user's cancel is not a preemption: the ranks ask Slurm why SIGTERM came, checkpoint (there is
    time: KillWait), leave no requeue request, and the job never comes back."""
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS)
    wait_running_past(job_id, run_dir, 30)
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.time() + 120
    while squeue_state(job_id) is not None and time.time() < deadline:
        time.sleep(0.5)
    assert squeue_state(job_id) is None, "the cancelled job is still known to the controller"
    time.sleep(5)  # a requeue by the batch script would show by now (the requeue is immediate)
    assert squeue_state(job_id) is None and sacct_runs(job_id) == ["CANCELLED"], sacct_runs(job_id)
    log = log_text(run_dir, job_id)
    assert "bridge_hpc: requeueing" not in log and "the job was cancelled" in log, log[-3000:]
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 1
    end = runs[0].last("Ending job")
    assert end is not None and end.fields["Reason"] == "cancelled", end
    assert end.fields["Steps lost"] == "0"  # it checkpointed the step it stopped at
    assert not list((run_dir / "logs").glob("requeue-request.*"))


def test_scontrol_requeue_resumes_exactly(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS)
    wait_running_past(job_id, run_dir, 80)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    assert drive(job_id) == "COMPLETED"
    runs = check_exact(run_dir, reference, job_id, tmp_path)
    assert len(runs) == 2 and runs[0].last("Ending job").fields["Reason"] == "signal"
