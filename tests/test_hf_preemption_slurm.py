"""A fine-tuning job started from a Hugging Face folder on the local Slurm cluster, requeued mid-run:
the second run resumes from its own checkpoint (not the Hugging Face weights again), bit-exactly
against the same job run straight through."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bridge_test_helpers import (
    ROOT,
    direct_rank_env,
    drive,
    job_story,
    log_text,
    losses,
    submit_cli,
    wait_running_past,
)
from hf_models import SEQ, make_hf_model

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ITERS = 60

JOB = """
extends = "{root}/configs/clusters/local.toml"
[job]
entry = "finetune"
run_dir = "{run_dir}"
[slurm]
ntasks_per_node = 1
time = "00:10:00"
signal = "USR1@60"
[env]
OMP_NUM_THREADS = 1
[train]
train_iters = {iters}
global_batch_size = 4
micro_batch_size = 4
[optimizer]
lr = 0.001
[logger]
log_interval = 1
[model]
seq_length = {seq}
[dataset]
seq_length = {seq}
[checkpoint]
pretrained_checkpoint = "{hf}"
save_interval = 10
"""


def test_requeued_hf_finetune_resumes_from_its_own_checkpoint_exactly(slurm_cluster, tmp_path):
    hf = tmp_path / "qwen3"
    make_hf_model("qwen3", str(hf))
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    for name, run_dir in (("straight.toml", straight), ("requeued.toml", requeued)):
        (tmp_path / name).write_text(JOB.format(root=ROOT, run_dir=run_dir, iters=ITERS, seq=SEQ, hf=hf))
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.rank", "straight.toml"], cwd=tmp_path,
                          env=direct_rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    submitted = submit_cli(str(tmp_path / "requeued.toml"), cwd=tmp_path, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[2]
    wait_running_past(job_id, requeued, 25)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    assert drive(job_id) == "COMPLETED", job_story(requeued, job_id)
    log = log_text(requeued, job_id)
    assert log.count("loaded pretrained weights from Hugging Face folder") == 1, job_story(requeued, job_id)
    assert "Loaded checkpoint" in log or "loaded checkpoint" in log, job_story(requeued, job_id)
    a, b = losses(straight), losses(requeued)
    assert sorted(a) == sorted(b) == list(range(1, ITERS + 1))
    assert all(a[step] == b[step] for step in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
