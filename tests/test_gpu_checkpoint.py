"""Background checkpoint saves on one GPU (``checkpoint.async_save = true``); skipped without CUDA.

Each run is a real 1-rank torchrun job of the toolkit's loop on the tiny GPT of tests/data/tiny.toml,
on ``cuda`` (megatron-core DDP and optimizer, ``dist_checkpointing`` with the torch_dist strategy,
the persistent checkpoint worker copying to pinned host memory). The GPU twin of
tests/test_async_checkpoint.py:

* The first save of the process blocks training well under a second (the worker, its CUDA context
  and the write-results Manager are started at start-up, not in the first save; the steps are slowed
  so that the first save comes after the worker is ready); each save's blocking time is printed. The
  run ends: no process it started outlives it (an orphaned Manager once held the output open).
* SIGKILL of the whole job while a background save is being written leaves the last finalized
  checkpoint loadable (verified, tracker naming it), and the run resumed from it reproduces the
  losses of an uninterrupted run with synchronous saves bit for bit.
* SIGUSR1 (what ``scancel --signal=USR1`` delivers to a job step's tasks) while a save is being
  written: the rank finishes that save, writes the exit save and leaves; the resumed run reproduces
  the uninterrupted one bit for bit. The rank is started directly, as srun starts a task.
* A checkpoint worker killed: that save fails and is reported, the tracker keeps naming the previous
  checkpoint, a new worker takes over and training goes on to the same losses.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from typing import List, Optional

import pytest
import torch
from bridge_test_helpers import (
    FAULTY_FORWARD_STEP,
    assert_no_process_left,
    direct_rank_env,
    free_port,
    kill_tree,
    set_args,
    tiny_checkpoints,
    tiny_job,
    tiny_run_dir,
    worker_of_rank,
)

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import CHECKPOINT_SAVE_FAILED, parse_events, parse_progress
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.checkpoint.checkpointing import find_latest_checkpoint, verify_checkpoint
from bridge_hpc.training.engine.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ITERS = 40
ASYNC = ("checkpoint.async_save=true", "logger.log_progress=true")
RUN_TIMEOUT_S = 180
#: The first save's blocking part for a model this small: plan + snapshot + handoff, no process start.
FIRST_SAVE_LIMIT_S = 1.0
#: The first-save test's floor under the step time (tests/data/faulty_forward_step.py: Bridge's GPT step, the
#: same numerics, plus this sleep before each of a step's 4 micro-batches: 2 s a step): its first save, at
#: iteration 10, then comes after the checkpoint worker started at start-up is ready, as it does for a
#: model that takes more than seconds to reach its first save. The worker imports torch and megatron-core
#: first (3-12 s on the GPU hosts used; 12 s on an H200 host without a bytecode cache), and a save asked
#: for earlier waits for it.
STEP_SLEEP_S = 0.5
_WORKER_READY = "checkpoint worker ready"
_STARTED = re.compile(r"started asynchronous checkpoint save of iteration (\d+) \(([\d.]+)s blocking\)")


def _cmd(job: str, *overrides: str) -> List[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           "-m", "bridge_hpc.rank"]
    return cmd + set_args(job, overrides)


def _run(job: str, *overrides: str, env: Optional[dict] = None) -> str:
    try:
        proc = subprocess.run(_cmd(job, *overrides), cwd=os.path.dirname(job), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as hung:  # what the run said before it hung
        said = [out.decode(errors="replace") if isinstance(out, bytes) else out or "" for out in (hung.stdout, hung.stderr)]
        pytest.fail(f"the run did not end in {RUN_TIMEOUT_S} s:\n{said[0][-3000:]}\n{said[1][-6000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout




def _trained(job: str) -> dict:
    """Step -> (loss, grad norm) of the run's metrics.jsonl (a resumed run's records replace the
    killed run's for the steps it redid)."""
    records = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    return {step: (r["loss"], r["grad_norm"]) for step, r in records.items()}



@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: 40 steps with synchronous saves, uninterrupted."""
    job = tiny_job(tmp_path_factory.mktemp("straight"))
    _run(job)
    return _trained(job)


def test_first_async_save_blocks_well_under_a_second(straight, tmp_path):
    job = tiny_job(tmp_path / "async")
    out = _run(job, *ASYNC, f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
               env={"TEST_STEP_SLEEP": str(STEP_SLEEP_S)})
    first = _STARTED.search(out)
    assert first and 0 <= out.find(_WORKER_READY) < first.start(), \
        f"the checkpoint worker was not ready before the first save ({STEP_SLEEP_S} s a step):\n{out[-3000:]}"
    started = [(int(it), float(s)) for it, s in _STARTED.findall(out)]
    print("async saves on GPU, blocking seconds by iteration:", started)
    assert [it for it, _ in started] == [10, 20, 30]  # 40 is the exit save: synchronous
    first_s = started[0][1]
    assert first_s < FIRST_SAVE_LIMIT_S, f"the first save of the process blocked {first_s:.2f}s"
    assert run_folder.tracked_iteration(tiny_checkpoints(job)) == ITERS
    assert _trained(job) == straight  # saving in the background changes nothing trained (exact)
    assert_no_process_left(os.path.dirname(job))


def test_sigkill_during_an_async_save_leaves_the_last_finalized_checkpoint(straight, tmp_path):
    job = tiny_job(tmp_path / "killed")
    ckpts = tiny_checkpoints(job)
    proc = subprocess.Popen(_cmd(job, *ASYNC, "checkpoint.save_interval=5"), cwd=os.path.dirname(job),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + RUN_TIMEOUT_S
        # Wait until one save finalized and the next is being written (its .tmp folder exists).
        while time.time() < deadline and proc.poll() is None:
            if (run_folder.tracked_iteration(ckpts) or 0) >= 5 and glob.glob(os.path.join(ckpts, "iter_*.tmp")):
                break
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before a save was in flight"
    finally:
        kill_tree(proc)
    latest = find_latest_checkpoint(ckpts, world_size=1)
    assert latest is not None and run_folder.tracked_iteration(ckpts) == int(latest[-7:])
    assert verify_checkpoint(latest, world_size=1) is None
    resumed_from = int(latest[-7:])

    _run(job, *ASYNC, "checkpoint.save_interval=5")
    assert resumed_from < ITERS
    assert _trained(job) == straight  # exact, the steps redone after the kill included
    assert run_folder.tracked_iteration(ckpts) == ITERS


def _start_rank(job: str, *overrides: str) -> subprocess.Popen:
    """The job's one rank started directly, as srun starts a job step's task: a signal reaches the
    rank itself, not a launcher."""
    env = direct_rank_env()
    cmd = [sys.executable, "-m", "bridge_hpc.rank", *set_args(job, overrides)]
    return subprocess.Popen(cmd, cwd=os.path.dirname(job), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    """The output of a run that must end with status 0; a hanging one is killed and fails the test."""
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"the run did not end in {RUN_TIMEOUT_S} s")
    assert proc.returncode == 0, output[-6000:]
    return output


def _steps_done(job: str) -> int:
    path = os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE)
    return max(read_metrics(path), default=0) if os.path.exists(path) else 0


#: A larger model of the tiny one's shape for the SIGUSR1 test: on a GPU the tiny model's background
#: write (a few MB) ends within the step that follows it, so no save would be in flight when a signal
#: lands. This one's model and optimizer state (~0.5 GB) takes far longer to write than a step takes.
LARGER = ("model.vocab_size=32768", "model.hidden_size=512", "model.num_layers=4", "model.num_attention_heads=8")


@pytest.fixture(scope="module")
def straight_larger(tmp_path_factory):
    """The reference for :data:`LARGER`: 40 steps with synchronous saves, uninterrupted."""
    job = tiny_job(tmp_path_factory.mktemp("straight-larger"))
    _run(job, *LARGER)
    return _trained(job)


def test_usr1_during_an_async_save_finishes_it_then_saves_and_exits(straight_larger, tmp_path):
    job = tiny_job(tmp_path / "usr1")
    ckpts = tiny_checkpoints(job)
    every_step = "checkpoint.save_interval=1"  # a save is always being written when the signal lands
    rank = _start_rank(job, *LARGER, *ASYNC, every_step)
    deadline = time.time() + RUN_TIMEOUT_S
    while _steps_done(job) < 15 and time.time() < deadline and rank.poll() is None:
        time.sleep(0.01)
    assert rank.poll() is None, "the run ended before the signal"
    os.kill(rank.pid, signal.SIGUSR1)
    out = _finish(rank)

    in_flight = re.search(r"stopping at iteration (\d+): the asynchronous checkpoint save of iteration (\d+) "
                          r"is still being written; finishing it before the exit save", out)
    assert in_flight, out[-4000:]
    stopped, writing = int(in_flight[1]), int(in_flight[2])
    assert writing < stopped < ITERS
    after = out[in_flight.end():]
    order = [after.find(f"saved checkpoint at iteration {writing} "), after.find(f"saved checkpoint at iteration {stopped} "),
             after.find(f"exiting at iteration {stopped}: signal received")]
    assert -1 not in order and order == sorted(order), out[-4000:]
    run = parse_progress(os.path.join(ckpts, run_folder.PROGRESS_FILE))[-1]
    end = run.last("Ending job")
    assert (end.fields["Reason"], end.fields["Iteration"], end.fields["Steps lost"]) == ("signal", str(stopped), "0")
    assert [int(e.fields["Iteration"]) for e in run.of("Saved checkpoint")][-2:] == [writing, stopped]
    assert run_folder.tracked_iteration(ckpts) == stopped
    assert_no_process_left(os.path.dirname(job))

    _finish(_start_rank(job, *LARGER, *ASYNC, every_step))  # the requeued run
    assert _trained(job) == straight_larger  # bitwise, the exit and the resume included
    assert run_folder.tracked_iteration(ckpts) == ITERS
    assert_no_process_left(os.path.dirname(job))


def test_a_killed_checkpoint_worker_fails_that_save_and_training_goes_on(straight, tmp_path):
    job = tiny_job(tmp_path / "worker")
    ckpts = tiny_checkpoints(job)
    rank = _start_rank(job, *ASYNC, "checkpoint.save_interval=8", "checkpoint.most_recent_k=-1")
    deadline = time.time() + RUN_TIMEOUT_S
    while run_folder.tracked_iteration(ckpts) != 8 and time.time() < deadline and rank.poll() is None:
        time.sleep(0.005)
    worker = worker_of_rank(rank.pid, 0)
    assert worker is not None, "the rank has no checkpoint worker"
    os.kill(worker, signal.SIGKILL)
    out = _finish(rank)

    failures = [e for e in parse_events(os.path.join(ckpts, run_folder.PROGRESS_FILE)) if e.name == CHECKPOINT_SAVE_FAILED]
    assert len(failures) == 1, out[-4000:]
    failed = int(failures[0].fields["Iteration"])
    assert failed in (16, 24) and failures[0].fields["Action"] == "retry"
    assert "died (killed by SIGKILL)" in failures[0].fields["Reason"]
    assert (f"error: asynchronous checkpoint save of iteration {failed} failed (1 in a row, "
            f"checkpoint.async_save_max_failures = 3): training goes on; the next save retries; "
            f"the last checkpoint is iteration {failed - 8}") in out, out[-4000:]
    assert "rank 0 started a new checkpoint worker" in out
    assert checkpointing.complete_iterations(ckpts) == [i for i in (8, 16, 24, 32, 40) if i != failed]
    assert not glob.glob(os.path.join(ckpts, "iter_*.tmp"))
    assert _trained(job) == straight
    assert_no_process_left(os.path.dirname(job))
