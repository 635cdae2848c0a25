"""tests/warm_ranks.py, which most tests' plain 2-rank runs go through: its ranks train as torchrun's do,
bit for bit, and a rank that outlives its time is killed by its PID and said so."""

from __future__ import annotations

import os
import subprocess
import sys

from bridge_test_helpers import free_port, tiny_job, tiny_run_dir
from warm_ranks import run_job, run_ranks

from bridge_hpc.training.engine.metrics import read_metrics

SETTINGS = ["train.train_iters=6", "checkpoint.save_interval=3", "train.eval_interval=0"]


def _metrics(job: str) -> dict:
    return {s: (r["loss"], r["grad_norm"]) for s, r in read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl")).items()}


def test_warm_ranks_train_as_torchruns_bit_for_bit(tmp_path):
    warm, cold = tiny_job(tmp_path / "warm"), tiny_job(tmp_path / "cold")
    done = run_job(warm, SETTINGS, cwd=os.path.dirname(warm))
    assert done.returncodes == [0, 0] and "exiting at iteration 6" in done.stdout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "bridge_hpc.rank", cold]
    for item in SETTINGS:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=os.path.dirname(cold), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(_metrics(warm)) == [1, 2, 3, 4, 5, 6] and _metrics(warm) == _metrics(cold)


def test_a_rank_past_its_time_is_killed_and_said_so(tmp_path):
    job = tiny_job(tmp_path / "slow")
    # each micro-batch sleeps (tests/data/faulty_forward_step.py): the run cannot end in 2 s
    forward = os.path.join(os.path.dirname(__file__), "data", "faulty_forward_step.py")
    done = run_ranks([job, "--set", f'job.forward_step="{forward}:forward_step"', "--set", "train.train_iters=1000"],
                     cwd=os.path.dirname(job), timeout=2, env=dict(os.environ, TEST_STEP_SLEEP="1"))
    assert done.returncodes == [-9, -9], done.returncodes
