"""Background checkpoint saves (``checkpoint.async_save = true``) on CPU.

Every run is a real 2-rank job over gloo (tests/warm_ranks.py's ranks, or torchrun's where a test
finds a rank's worker under it) on the tiny GPT of tests/data/tiny.toml; the shards
are written by each rank's persistent checkpoint worker (nvidia-resiliency-ext's AsyncCallsQueue),
and the checkpoints are the real files that a resume loads. The reference is a straight 40-step run
with synchronous saves: a save must not change what training computes, so every resumed run must
reproduce its losses bit for bit.

* SIGKILL of the whole job (ranks, checkpoint workers, their helpers) at seeded random instants while
  saves are being written, ten times: the last finalized checkpoint always verifies and loads, the
  tracker names it, and the run finished from it reproduces the straight run.
* A checkpoint worker killed: that save fails on every rank and is reported, the tracker keeps naming
  the previous checkpoint, a new worker takes over and the next save succeeds; training goes on.
* A full disk: each failed save is reported, and after ``checkpoint.async_save_max_failures`` failures
  in a row the run stops with an error naming the cause; the last checkpoint stays intact.

About 150 s on 2 cores.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time
from typing import List

import pytest
import torch
from bridge_test_helpers import (
    assert_bitwise_equal,
    assert_no_process_left,
    free_port,
    kill_tree,
    model_params,
    tiny_checkpoints,
    tiny_job,
    tiny_run_dir,
    worker_of_rank,
)
from warm_ranks import run_job, run_ranks, start_ranks

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.progress_log import CHECKPOINT_SAVE_FAILED, parse_events
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.checkpoint.checkpointing import find_latest_checkpoint, iteration_dir, verify_checkpoint
from bridge_hpc.training.config import CheckpointConfig
from bridge_hpc.training.engine.metrics import read_metrics

ITERS = 40
ASYNC = ("checkpoint.async_save=true", "logger.log_progress=true")
#: A run takes 10-20 s here; one still going after this is hanging.
RUN_TIMEOUT_S = 150


def _argv(job: str, *overrides: str) -> List[str]:
    argv = [job]
    for item in overrides:
        argv += ["--set", item]
    return argv


def _start(job: str, *overrides: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """torchrun's ranks: a test that looks for a rank's checkpoint worker under torchrun's PID."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "bridge_hpc.rank", job]
    for item in overrides:
        cmd += ["--set", item]
    stderr = subprocess.STDOUT if stdout == subprocess.PIPE else stdout
    return subprocess.Popen(cmd, cwd=os.path.dirname(job), stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True)




def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S):
    """Wait for a run; a hanging one is killed and fails the test. Returns (exit status, output)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"the run hung (killed after {timeout} s)")
    return proc.returncode, output


def _run(job: str, *overrides: str) -> str:
    return run_job(job, overrides, cwd=os.path.dirname(job), timeout=RUN_TIMEOUT_S).output



def _failed_saves(ckpts: str) -> list:
    return [e for e in parse_events(os.path.join(ckpts, run_folder.PROGRESS_FILE)) if e.name == CHECKPOINT_SAVE_FAILED]


def _saved(ckpts: str) -> List[int]:
    return [int(e.fields["Iteration"]) for e in parse_events(os.path.join(ckpts, run_folder.PROGRESS_FILE))
            if e.name == "Saved checkpoint"]


def _assert_same_training(job: str, straight: str, scratch) -> None:
    a = read_metrics(os.path.join(tiny_run_dir(straight), run_folder.METRICS_FILE))
    b = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    assert sorted(b) == list(range(1, ITERS + 1))
    for step in range(1, ITERS + 1):  # exact, not approximate
        assert (b[step]["loss"], b[step]["grad_norm"]) == (a[step]["loss"], a[step]["grad_norm"]), step
    final = f"iter_{ITERS:07d}"
    assert_bitwise_equal(model_params(os.path.join(tiny_checkpoints(straight), final), str(scratch)),
                         model_params(os.path.join(tiny_checkpoints(job), final), str(scratch)))


def test_async_save_max_failures_must_allow_one_save():
    CheckpointConfig(save="ckpt", async_save=True).finalize()
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(save="ckpt", async_save=True, async_save_max_failures=0).finalize()
    assert err.value.key == "checkpoint.async_save_max_failures"


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> str:
    """40 steps in one go, synchronous saves."""
    job = tiny_job(tmp_path_factory.mktemp("straight"))
    _run(job)
    return job


#: Kills of the run below, each at a random instant of a save's write (each costs a start of 2 ranks).
KILLS = 3


def test_sigkill_during_async_saves_leaves_the_last_finalized_checkpoint(straight, tmp_path):
    """Saving every step in the background, SIGKILL everything at a random instant of a save's write,
    after the attempt's first own save finalized (its worker is warm: the next saves overlap steps);
    check what a resume would load after each kill, then finish the run. The kill waits for a save to
    be in flight (its ``.tmp`` folder) and lands up to 0.1 s later: on a loaded 2-core machine a delay
    drawn from a fixed window after a finalization hit a save in flight only 7-8 times in 10."""
    job = tiny_job(tmp_path / "killed")
    ckpts = tiny_checkpoints(job)
    rng = random.Random(20261124)
    last, kills, in_flight = 0, 0, 0
    while kills < KILLS:
        ranks = start_ranks(_argv(job, *ASYNC, "checkpoint.save_interval=1"), cwd=os.path.dirname(job))
        deadline = time.time() + RUN_TIMEOUT_S
        while time.time() < deadline and ranks.poll() is None and (run_folder.tracked_iteration(ckpts) or 0) <= last:
            time.sleep(0.005)
        while time.time() < deadline and ranks.poll() is None and not glob.glob(os.path.join(ckpts, "iter_*.tmp")):
            time.sleep(0.005)
        if ranks.poll() is not None:  # it ran to the end: the kills are done
            done = ranks.wait()
            assert done.returncode == 0, done.output[-6000:]
            break
        time.sleep(rng.uniform(0.0, 0.1))
        in_flight += bool(glob.glob(os.path.join(ckpts, "iter_*.tmp")))
        ranks.kill()
        ranks.wait()
        kills += 1

        latest = find_latest_checkpoint(ckpts, world_size=2)
        assert latest is not None
        iteration = int(latest[-7:])
        assert iteration >= last and run_folder.tracked_iteration(ckpts) == iteration  # the tracker: the newest finalized
        assert verify_checkpoint(latest, world_size=2) is None
        common = torch.load(os.path.join(latest, checkpointing.COMMON_FILE), weights_only=False)
        assert common["iteration"] == iteration == common["train_state"]["step"]
        for rank in (0, 1):
            per_rank = torch.load(os.path.join(latest, f"rank_{rank:05d}.pt"), weights_only=False)
            assert per_rank["data"]["consumed_samples"] == 8 * iteration
        assert model_params(latest, str(tmp_path))  # the shards load
        last = iteration
    assert kills == KILLS and in_flight >= KILLS - 2, (kills, in_flight)  # the kills hit saves being written

    assert_no_process_left(os.path.dirname(job))

    _run(job, *ASYNC, "checkpoint.save_interval=1")
    _assert_same_training(job, straight, tmp_path)
    assert not [n for n in os.listdir(ckpts) if n.endswith((".tmp", ".del"))]
    assert run_folder.tracked_iteration(ckpts) == ITERS


def test_a_killed_checkpoint_worker_fails_that_save_and_training_goes_on(straight, tmp_path):
    job = tiny_job(tmp_path / "worker")
    ckpts = tiny_checkpoints(job)
    proc = _start(job, *ASYNC, "checkpoint.save_interval=8", "checkpoint.most_recent_k=-1")
    deadline = time.time() + RUN_TIMEOUT_S
    while run_folder.tracked_iteration(ckpts) != 8 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    worker = worker_of_rank(proc.pid, 1)
    assert worker is not None, "rank 1 has no checkpoint worker"
    os.kill(worker, signal.SIGKILL)
    status, output = _finish(proc)
    assert status == 0, output[-6000:]

    # Reported: the cause on stderr, the rule's decision, and a progress-log event.
    failures = _failed_saves(ckpts)
    assert len(failures) == 1, output[-4000:]
    failed = int(failures[0].fields["Iteration"])
    assert failed in (16, 24) and failures[0].fields["Action"] == "retry"
    assert "died (killed by SIGKILL)" in failures[0].fields["Reason"]
    assert (f"error: checkpoint save of iteration {failed} failed on rank 1: CheckpointWorkerDied: "
            f"the checkpoint worker of rank 1 (pid {worker}) died (killed by SIGKILL)") in output, output[-4000:]
    assert (f"error: asynchronous checkpoint save of iteration {failed} failed (1 in a row, "
            f"checkpoint.async_save_max_failures = 3): training goes on; the next save retries; "
            f"the last checkpoint is iteration {failed - 8}") in output
    assert "rank 1 started a new checkpoint worker" in output
    # Nothing of the failed save is left; every later save (with the new worker) made it.
    assert checkpointing.complete_iterations(ckpts) == [i for i in (8, 16, 24, 32, 40) if i != failed]
    assert _saved(ckpts) == [i for i in (8, 16, 24, 32, 40) if i != failed]
    assert not glob.glob(os.path.join(ckpts, "iter_*.tmp"))
    _assert_same_training(job, straight, tmp_path)
    assert_no_process_left(os.path.dirname(job))



def test_a_full_disk_fails_async_saves_until_the_run_stops(small_disk, tmp_path):
    job = tiny_job(tmp_path / "job")
    ckpts = os.path.join(small_disk, "checkpoints")
    done = run_ranks(_argv(job, *ASYNC, f'checkpoint.save="{ckpts}"', "checkpoint.save_interval=2",
                           "checkpoint.most_recent_k=-1", "checkpoint.async_save_max_failures=2"),
                     cwd=os.path.dirname(job), timeout=RUN_TIMEOUT_S)
    status, output = done.returncode, done.output
    assert status != 0 and -9 not in done.returncodes, output[-4000:]  # stopped by itself, not killed at the timeout

    # Each failure is reported with its cause; the second in a row stops the run with one clear line.
    failures = _failed_saves(ckpts)
    assert [(e.fields["Iteration"], e.fields["Failures in a row"], e.fields["Action"]) for e in failures] == [
        ("4", "1", "retry"), ("6", "2", "stop")], output[-4000:]
    for event, iteration in zip(failures, (4, 6)):
        assert "no space left on device" in event.fields["Reason"] and f"iter_{iteration:07d}" in event.fields["Reason"]
    assert ("error: rank failed: CheckpointSaveError: 2 checkpoint saves in a row failed "
            "(checkpoint.async_save_max_failures = 2); the last: checkpoint save of iteration 6 failed") in output
    ending = [e for e in parse_events(os.path.join(ckpts, run_folder.PROGRESS_FILE)) if e.name == "Ending job"]
    assert [e.fields["Reason"] for e in ending] == ["error"]
    # It trained on past the first failure and stopped when the second was known (the step after that
    # save started, or the one after: a save's outcome is checked after each step).
    metrics = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    assert max(metrics) == int(ending[0].fields["Iteration"]) in (7, 8)

    # The checkpoint before the failures is intact and tracked; the failed ones left nothing.
    assert run_folder.tracked_iteration(ckpts) == 2 and verify_checkpoint(iteration_dir(ckpts, 2), world_size=2) is None
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("iter_")) == ["iter_0000002"]
    assert_no_process_left(os.path.dirname(job))  # the failed rank left with os._exit
