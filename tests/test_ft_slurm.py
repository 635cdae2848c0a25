"""Fault tolerance end to end on the local cluster: the real 2-rank GPT loop under ft_launcher.

Two jobs of configs/local-tiny-fault-tolerance.toml, submitted with bridge-submit, each with one fault on
rank 1: ft's simulated ``rank_hung`` (its rank monitor must kill it after the step timeout) and a rank
that kills itself at step 45 (``TEST_KILL`` of tests/data/faulty_forward_step.py; the launcher sees it
die). The second job also makes every checkpoint save longer than the step timeout
(``TEST_SAVE_DELAY`` of tests/data/faulty_forward_step.py), which must not be taken
for a hang. Both must restart in the same job (one Slurm run, no requeue), resume from their last
checkpoint, finish, and log the same losses bit for bit as an uninterrupted torchrun of the same config;
the progress log and bridge-report must show the restart with its cause and lost time.

A third job computes its timeouts (``calc_ft_timeouts``) and is requeued by ``exit_interval``; in its
second Slurm run a user's forward step (tests/data/faulty_forward_step.py) hangs on rank 1. The rank
monitor must catch it by the timeout computed in the first run, far below the loose configured one;
with no in-job restarts allowed, the job must leave through the requeue path and still finish exactly.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import FAULTY_FORWARD_STEP, drive, job_story, log_text, losses, reference_run, sacct_runs, submit_cli

from bridge_hpc.contracts.progress_log import RESTART, parse_progress

pytest.importorskip("nvidia_resiliency_ext.fault_tolerance")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "local-tiny-fault-tolerance.toml"
ITERS = 120
STEP_TIMEOUT = 3.0
CHECK = 0.5  # ft.workload_check_interval
MARGIN = 5.0  # generous: detection is judged on a shared, loaded 2-core machine (CI), where a process can stall for seconds
SAVE_DELAY = 4.0  # > STEP_TIMEOUT: the slow-save job
KILL_STEP = 45  # the killed job's rank 1 dies at this step, after the checkpoint of step 40
HUNG_STEP_SLEEP = 0.05  # the hung job's forward passes take at least this: its 120 steps outlast the fault's 5 s delay
LOOSE_STEP_TIMEOUT = 60.0  # the requeue job's configured step timeout, before any is computed
#: The requeue job's floor under computed timeouts: its steps take ~50 ms, so every computed timeout
#: is this floor, far below the loose one; with room for a first step or a checkpoint load on a
#: 2-core machine that also runs the reference (2 s was seen to kill a healthy run there).
COMPUTED_FLOOR = 6.0


def ft_overrides(run_dir: Path, extra=()) -> list:
    return [f"job.run_dir={run_dir}", f"train.train_iters={ITERS}", "logger.log_interval=10",
            "train.eval_interval=50", "checkpoint.most_recent_k=3", "ft.max_restarts=2",
            f"ft.step_timeout={STEP_TIMEOUT}", "ft.setup_timeout=90", "ft.checkpointing_timeout=60",
            "ft.rank_out_of_section_timeout=30", f"ft.workload_check_interval={CHECK}", *extra]


def submit_ft(run_dir: Path, extra=(), env_extra=None) -> str:
    args = [str(CONFIG)]
    for item in ft_overrides(run_dir, extra):
        args += ["--set", item]
    env = dict(os.environ, **(env_extra or {}))
    proc = submit_cli(*args, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[2]


def _stamp(line: str):
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000 if m else None


class Job:
    def __init__(self, run_dir: Path, job_id: str, state: str, seconds: float):
        self.run_dir, self.job_id, self.state, self.seconds = run_dir, job_id, state, seconds
        self.log = log_text(run_dir, job_id)

    def fault_time(self) -> float:
        """When rank 1 failed: ft's simulated fault, or tests/data/faulty_forward_step.py's kill."""
        m = re.search(r"(?:SIMULATED FAULT \S+ rank 1 iteration|TEST KILL rank 1 step) \d+ at ([\d.]+)", self.log)
        assert m, self.log[-4000:]
        return float(m.group(1))

    def lines(self, pattern: str) -> list:
        return [m for m in (re.search(pattern, line) for line in self.log.splitlines()) if m]

    def detected(self) -> list:
        """Times of the launcher's decision to restart the workers (0.4.1's and 0.7.0's words)."""
        return [t for t in (_stamp(line) for line in self.log.splitlines()
                            if "will restart worker group" in line) if t is not None]


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Both FT jobs are submitted first (they queue on the 2-CPU node); the torchrun reference runs
    meanwhile on the login side."""
    base = tmp_path_factory.mktemp("ft")
    t0 = time.time()
    hung = submit_ft(base / "hung", ["ft.simulate_fault=true", "ft.simulated_fault_type='rank_hung'",
                                      "ft.simulated_fault_rank=1", "ft.simulated_fault_base_delay=5",
                                      # a checkpoint before the fault (it comes about 30 steps in) and a floor
                                      # under the step time (same numerics): the run outlasts the fault's delay
                                      # however fast the machine is (its 120 steps once took 4.6 s)
                                      "checkpoint.save_interval=10",
                                      f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                                      f"env.TEST_STEP_SLEEP='{HUNG_STEP_SLEEP}'"])
    # The killed rank dies at a step, not at a time after set-up (ft.simulated_fault_base_delay): the
    # checkpoint of step 40 comes before it on any machine (on a loaded one, set-up alone once took
    # longer than a 10 s delay, and the fault came before the first step).
    killed = submit_ft(base / "killed", ["checkpoint.save_interval=40",
                                          f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                                          f"env.TEST_SAVE_DELAY='{SAVE_DELAY}'", f"env.TEST_KILL='0:{KILL_STEP}:1'"])
    requeue = submit_ft(base / "requeue", [
        "ft.calc_ft_timeouts=true", f"ft.min_computed_timeout_s={COMPUTED_FLOOR}", f"ft.step_timeout={LOOSE_STEP_TIMEOUT}",
        "ft.max_restarts=0", "train.exit_interval=50", "checkpoint.save_interval=20",
        f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'", "env.TEST_HANG='1:57:1'"])
    # same model/data/optimizer; FT stays inactive without ft_launcher
    reference = reference_run(base / "reference", ITERS, config=CONFIG)
    out = {"reference": reference}
    for name, job_id in (("hung", hung), ("killed", killed), ("requeue", requeue)):
        state = drive(job_id, timeout=400)
        out[name] = Job(base / name, job_id, state, time.time() - t0)
    return out


def check_restarted_once_and_exact(job: Job, reference: Path) -> None:
    story = job_story(job.run_dir, job.job_id)
    assert job.state == "COMPLETED", story
    assert sacct_runs(job.job_id) == ["COMPLETED"], "restarted in place: one Slurm run, no requeue\n" + story
    assert "requeueing" not in job.log
    assert len(job.detected()) == 1, story  # one restart: the fault's, no false one
    got, want = losses(job.run_dir), losses(reference)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == want  # bitwise

    runs = parse_progress(str(job.run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 2 and [r.restart_count for r in runs] == [0, 1]
    restart = runs[0].last(RESTART)
    assert restart is not None and restart.fields["Cause"] == "fault"
    # from the failed run's last progress mark, or its start when the fault came before its first step
    lost = restart.number("Lost seconds")
    assert lost is not None and 0 < lost < 120, story
    saved = [int(e.fields["Iteration"]) for e in runs[0].of("Saved checkpoint")]
    loaded = runs[1].last("Loaded checkpoint")
    if saved:  # the last checkpoint
        assert loaded is not None and int(loaded.fields["Iteration"]) == saved[-1], story
    else:  # ft's delay counts from set-up: on a loaded machine the fault can come before the first save
        assert loaded is None and job.run_dir.name != "killed", story  # killed after step 40's save
    assert runs[1].last("Ending job").fields["Reason"] == "done"

    report = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(job.run_dir), "--json"],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["runs"]
    assert [r["restart"] for r in rows] == [0, 1]
    assert rows[0]["reason"] == "fault" and rows[1]["in_job_restart"] and rows[1]["reason"] == "done"


def test_rank_hung_is_detected_within_the_step_timeout(jobs):
    job = jobs["hung"]
    check_restarted_once_and_exact(job, jobs["reference"])
    latency = job.detected()[0] - job.fault_time()
    assert STEP_TIMEOUT - 0.1 <= latency <= STEP_TIMEOUT + CHECK + MARGIN, latency
    print(f"rank_hung: detected {latency:.2f} s after the fault (step timeout {STEP_TIMEOUT} s); "
          f"fixture done at {job.seconds:.0f} s")


def test_rank_killed_is_detected_and_slow_saves_are_not_hangs(jobs):
    job = jobs["killed"]
    check_restarted_once_and_exact(job, jobs["reference"])
    latency = job.detected()[0] - job.fault_time()
    assert 0 <= latency <= 1.0 + MARGIN, latency
    # every save took longer than the step timeout, and the first one came before the fault
    runs = parse_progress(str(job.run_dir / "checkpoints" / "progress.txt"))
    saves = [e for r in runs for e in r.of("Saved checkpoint")]
    assert saves and all(e.number("Save seconds") >= STEP_TIMEOUT for e in saves)
    assert runs[0].of("Saved checkpoint")
    print(f"rank_killed: detected {latency:.2f} s after the fault; {len(saves)} saves of >= {SAVE_DELAY} s; "
          f"fixture done at {job.seconds:.0f} s")


def test_computed_timeouts_survive_a_requeue_and_exhausted_restarts_requeue(jobs):
    job = jobs["requeue"]
    assert job.state == "COMPLETED", job.log[-4000:]
    # run 0 stops at exit_interval; run 1 hangs and, with ft.max_restarts = 0, fails and is requeued
    # by the batch script; run 2 stops at exit_interval again; run 3 finishes
    assert sacct_runs(job.job_id) == ["REQUEUED", "REQUEUED", "REQUEUED", "COMPLETED"], job.log[-4000:]
    assert "will restart worker group" not in job.log
    assert len(job.lines(r"requeueing .*ranks failed with status")) == 1

    # Each run's ranks log the timeouts in force when they connect to their monitors.
    starts = [ast.literal_eval(m.group(2)) for m in
              job.lines(r"\[rank 0\] bridge_hpc\.ft: fault tolerance: active \(sections API\), restart (\d+), "
                        r"timeouts (\{.*\})$")]
    assert len(starts) == 4, job.log[-4000:]
    assert starts[0]["section"]["step"] == LOOSE_STEP_TIMEOUT and not starts[0]["calculated_sections"]
    for later in starts[1:]:  # every run after the first starts with run 0's computed timeouts
        assert {"step", "checkpointing"} <= set(later["calculated_sections"]), later
    step_timeout = starts[1]["section"]["step"]
    assert COMPUTED_FLOOR <= step_timeout < LOOSE_STEP_TIMEOUT / 4, starts[1]

    # The monitor of the hung rank enforced exactly that timeout, and detection came within it
    hang = job.lines(r"TEST HANG rank 1 step 57 at ([\d.]+)")
    monitors = "\n".join(line for line in job.log.splitlines()
                          if re.search(r"has been open|out of section|requeueing|TEST HANG|Loaded", line))
    assert len(hang) == 1, monitors
    fired = job.lines(r"Section 'step' has been open for ([\d.]+) seconds\. Timeout is ([\d.]+) seconds")
    assert fired, job.log[-4000:]
    assert float(fired[0].group(2)) == pytest.approx(step_timeout, abs=0.01)
    assert step_timeout - 0.1 <= float(fired[0].group(1)) <= step_timeout + CHECK + MARGIN
    # start-up after a requeue loads a checkpoint: its own (computed) allowance from then on
    final = json.loads((job.run_dir / "checkpoints" / "ft_state.json").read_text())["current_timeouts"]["section"]
    assert {"setup", "step", "checkpointing"} <= set(final["calculated_sections"])

    got, want = losses(job.run_dir), losses(jobs["reference"])
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == want  # bitwise
    runs = parse_progress(str(job.run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 4
    assert [int(r.last("Loaded checkpoint").fields["Iteration"]) for r in runs[1:]] == [50, 50, 100]
    assert runs[-1].last("Ending job").fields["Reason"] == "done"
    print(f"requeue: computed step timeout {step_timeout:.1f} s (configured {LOOSE_STEP_TIMEOUT:.0f} s) "
          f"enforced after the requeue; hang caught after {float(fired[0].group(1)):.1f} s")
