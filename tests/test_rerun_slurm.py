"""Result validation end to end on the local cluster: the real 2-rank GPT loop, losses spoiled on purpose.

One job (configs/local-tiny.toml with ``[rerun_state_machine] rerun_mode = "validate_results"`` and
``check_for_spiky_loss``) trains with the test forward step (tests/data/faulty_forward_step.py,
``TEST_BAD_LOSS``) that spoils three losses:

* step TRANSIENT_SPIKE, rank 1: x1000 on the first attempt only. The re-run on the same batch gets the
  true loss: reported transient, training goes on with the re-run's result (the logged loss is normal);
* step SPIKE, rank 0: x1000 on every attempt. Reported deterministic, training goes on (the spiked loss
  is what the step logs);
* step NAN, rank 0: NaN on every attempt. Reported deterministic; the job stops with the checkpoint of
  step NAN - 1, ``Ending job`` reason ``nan_loss``, exit status 0 and no requeue.

The spiky check compares with the largest of the first 100 losses a rank validated: with 4 micro-batches
per rank and step (global batch 16) and the first step never validated, steps 2..26 fill that window, so
the spikes come after it. The spike on rank 1 before the NaN on rank 0 also guards the machine against
megatron-core's stale record of an earlier failure (bridge_hpc.training.resilience.rerun): with it, rank 1 would
call the NaN's re-run a transient spike and the job would train on.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from bridge_test_helpers import FAULTY_FORWARD_STEP, drive, log_text, losses, sacct_runs, submit

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import RESULT_VALIDATION, parse_progress

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITERS = 60  # not reached: the NaN stops the job
TRANSIENT_SPIKE, SPIKE, NAN = 28, 30, 33


def exit_codes(job_id: str) -> list:
    """Slurm's ``ExitCode`` (status:signal) of every run of the job."""
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates", "-o", "ExitCode"],
                         capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_a_nan_stops_the_job_with_the_step_before_saved_and_spikes_are_judged(slurm_cluster, tmp_path):
    run_dir = tmp_path / "rerun"
    job_id = submit(run_dir, ITERS, [
        'rerun_state_machine.rerun_mode="validate_results"', "rerun_state_machine.check_for_spiky_loss=true",
        "train.global_batch_size=16", 'logger.tensorboard_dir=""',
        f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
        f"env.TEST_BAD_LOSS='transient_spike:{TRANSIENT_SPIKE}:1:1000,spike:{SPIKE}:0:1000,nan:{NAN}:0'"])
    state = drive(job_id, timeout=300)
    log = log_text(run_dir, job_id)
    assert state == "COMPLETED", log[-4000:]
    assert sacct_runs(job_id) == ["COMPLETED"] and exit_codes(job_id) == ["0:0"], log[-4000:]  # no requeue
    assert "bridge_hpc: requeueing" not in log and "bridge_hpc: done" in log

    checkpoints = run_dir / "checkpoints"
    runs = parse_progress(str(checkpoints / run_folder.PROGRESS_FILE))
    assert len(runs) == 1
    validations = [(int(e.fields["Iteration"]), e.fields["Check"], e.fields["Diagnosis"], e.fields["Ranks"],
                    e.fields["Action"]) for e in runs[0].of(RESULT_VALIDATION)]
    assert validations == [(TRANSIENT_SPIKE, "spiky_loss", "transient", "1", "continue"),
                           (SPIKE, "spiky_loss", "deterministic", "1", "continue"),
                           (NAN, "nan_loss", "deterministic", "1", "stop")], log[-4000:]
    end = runs[0].last("Ending job").fields
    assert (end["Reason"], int(end["Iteration"]), end["Steps lost"]) == ("nan_loss", NAN - 1, "0")
    assert (checkpoints / run_folder.TRACKER_FILE).read_text().strip() == str(NAN - 1)
    assert f"exiting at iteration {NAN - 1}: NaN loss (recorded as nan_loss)" in log

    got = losses(run_dir)
    assert sorted(got) == list(range(1, NAN))  # the NaN step did not count
    # the transient spike was replaced by the re-run's loss; the deterministic one was kept (rank 0's half
    # of the global batch x1000: about 500 x)
    assert got[TRANSIENT_SPIKE] < 1.5 * got[TRANSIENT_SPIKE - 1], got
    assert got[SPIKE] > 100 * got[SPIKE - 1], got

    report = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir), "--json"],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert [r["reason"] for r in json.loads(report.stdout)["runs"]] == ["nan_loss"]
    text = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir)], capture_output=True,
                          text=True).stdout
    assert "nan_loss" in text
    print(f"rerun: transient spike at {TRANSIENT_SPIKE}, deterministic spike at {SPIKE}, NaN at {NAN}: "
          f"stopped at {NAN - 1}; losses {got[SPIKE - 1]:.3f} -> {got[SPIKE]:.1f} at the spike")
