"""A full disk during a checkpoint save, on the local cluster: the job ends within seconds with "no space
left on device" naming where, no rank hangs in a collective, and the checkpoint saved before is intact.

The checkpoint folder is a small tmpfs mounted by the test: the demo model's first checkpoint (about
1.6 MB) fits, the second does not, so the save at iteration 20 is the one that fails.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from bridge_test_helpers import drive, log_text, sacct_runs, submit

from bridge_hpc.contracts import run_folder
from bridge_hpc.slurm.query import job_runs, parse_slurm_duration
from bridge_hpc.training.checkpoint.checkpointing import iteration_dir, verify_checkpoint

pytestmark = [pytest.mark.slurm]

#: The job's time limit; a hang in a collective would hold the allocation until it, an exit within
#: seconds of the failed save ends the run in well under a minute of training and start-up.
TIME_LIMIT_S = 600
ENDS_WITHIN_S = 120



def test_a_full_disk_during_a_save_ends_the_job_with_the_cause_and_keeps_the_last_checkpoint(slurm_cluster, tmp_path,
                                                                                            small_disk):
    run_dir = tmp_path / "run"
    checkpoints = small_disk / "checkpoints"
    job_id = submit(run_dir, 40, [f"checkpoint.save={checkpoints}", "checkpoint.save_interval=10",
                                  "checkpoint.most_recent_k=2", "slurm.time=00:10:00", "slurm.retries_without_progress=0"])
    try:
        state = drive(job_id, timeout=TIME_LIMIT_S)
    finally:
        subprocess.run(["scancel", job_id], check=False)
    log = log_text(run_dir, job_id)
    assert state == "FAILED", f"{state}: {sacct_runs(job_id)}\n{log[-4000:]}"
    assert sacct_runs(job_id) == ["FAILED"], "a full disk must not be retried without progress here"
    assert "no space left on device" in log.lower(), log[-4000:]
    assert str(checkpoints) in log, "the message names where the save failed"
    elapsed = parse_slurm_duration(job_runs(job_id)[-1].elapsed)
    assert elapsed is not None and elapsed < ENDS_WITHIN_S, f"the run took {elapsed} s (time limit {TIME_LIMIT_S} s)"

    # The checkpoint before the failed save is intact, named by the tracker, and verifies.
    tracker = (checkpoints / run_folder.TRACKER_FILE).read_text().strip()
    assert tracker == "10"
    assert verify_checkpoint(iteration_dir(str(checkpoints), 10), world_size=2) is None
    assert not os.path.exists(iteration_dir(str(checkpoints), 20)), "the failed save must not look complete"
