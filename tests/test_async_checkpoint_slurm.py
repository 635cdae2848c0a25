"""A stop signal while a background checkpoint save is being written, end to end on the local cluster.

The demo's 2-rank job (configs/local-tiny.toml) saves every step with ``checkpoint.async_save``: a
save's write takes longer than a step here, so one is always in flight when the exit is decided.
``scancel --signal=USR1`` then must make every rank finish that save, write the exit save, ask for
the requeue, and the requeued run must resume from the exit save and end with the same losses and
parameters, bit for bit, as an uninterrupted run (with synchronous saves: saving must not change what
training computes). About 70 s on 2 cores.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from bridge_test_helpers import (
    assert_bitwise_equal,
    drive,
    log_text,
    losses,
    model_params,
    reference_run,
    sacct_runs,
    submit,
    wait_running_past,
)

from bridge_hpc.contracts.progress_log import parse_progress

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITERS = 100


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("reference") / "run", ITERS)


def test_usr1_during_an_async_save_finishes_it_saves_and_requeues(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(run_dir, ITERS, ["checkpoint.async_save=true", "checkpoint.save_interval=1"])
    wait_running_past(job_id, run_dir, 30)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED"
    log = log_text(run_dir, job_id)
    assert sacct_runs(job_id)[-1] == "COMPLETED", log[-4000:]

    # The save in flight when the exit was decided finished first, then the exit save, then the requeue.
    in_flight = re.search(r"stopping at iteration (\d+): the asynchronous checkpoint save of iteration (\d+) "
                          r"is still being written; finishing it before the exit save", log)
    assert in_flight, log[-4000:]
    stopped, writing = int(in_flight[1]), int(in_flight[2])
    assert writing < stopped
    after = log[in_flight.end():]
    order = [after.find(f"saved checkpoint at iteration {writing} "), after.find(f"saved checkpoint at iteration {stopped} "),
             after.find(f"exiting at iteration {stopped}: signal received"),
             after.find(f"work left at iteration {stopped}: asked the batch script to requeue the job")]
    assert -1 not in order and order == sorted(order), log[-4000:]

    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 2 == len(sacct_runs(job_id))
    first_end = runs[0].last("Ending job")
    assert (first_end.fields["Reason"], first_end.fields["Iteration"], first_end.fields["Steps lost"]) == (
        "signal", str(stopped), "0")
    saved = [int(e.fields["Iteration"]) for e in runs[0].of("Saved checkpoint")]
    assert saved[-2:] == [writing, stopped]  # finalized in that order, each line once its save is durable
    assert runs[1].last("Loaded checkpoint").fields["Iteration"] == str(stopped)
    assert runs[1].last("Ending job").fields["Reason"] == "done"

    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert got == want  # bitwise: floats compared exactly
    final = f"iter_{ITERS:07d}"
    assert_bitwise_equal(model_params(str(run_dir / "checkpoints" / final), str(tmp_path)),
                         model_params(str(reference / "checkpoints" / final), str(tmp_path)))
