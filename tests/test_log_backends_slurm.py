"""Issue 27's "done when" for the logging backends, on the local cluster.

``test_preempted_twice_one_run_per_backend_each_step_once`` (~90 s): the demo job (2 CPU ranks) with W&B
offline, MLflow's local store and Comet offline, its W&B key an ``[env]`` ``from_shell`` secret, preempted
twice: ``scontrol requeue`` (SIGTERM to every process of the job, W&B's writer process included) and
``scancel --signal=USR1``. It must leave one run per backend whose steps and losses are metrics.jsonl's,
each step once, read back with each backend's own reader (:mod:`test_log_backends`), and no file of the run
folder may hold a secret.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from bridge_test_helpers import (
    CONFIG,
    ROOT,
    drive,
    job_story,
    log_text,
    overrides,
    sacct_runs,
    submit_cli,
    wait_running_past,
)
from test_log_backends import ALL_ON, assert_one_run_each_step_once, wandb_history

from bridge_hpc.contracts.progress_log import parse_progress
from bridge_hpc.contracts.run_folder import RunFolder

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITERS = 120
PREEMPT_AT = (40, 85)


def files_holding(folder: Path, secrets) -> list:
    """Every file under ``folder`` (links followed) that holds one of ``secrets``, as bytes anywhere."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            found += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return found


def test_preempted_twice_one_run_per_backend_each_step_once(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    secrets = {"WANDB_API_KEY": f"wandb-SECRET-{uuid.uuid4().hex}",
               "MLFLOW_TRACKING_TOKEN": f"mlflow-SECRET-{uuid.uuid4().hex}"}
    env = {k: v for k, v in os.environ.items() if k not in ("COMET_API_KEY", "SLURM_JOB_ID")}
    env.update(secrets)
    extra = ALL_ON + ['env.WANDB_MODE="offline"', 'env.WANDB_SILENT="true"',
                      'env.WANDB_API_KEY={ from_shell = "WANDB_API_KEY" }',
                      'env.MLFLOW_TRACKING_TOKEN={ from_shell = "MLFLOW_TRACKING_TOKEN" }']
    args = [str(CONFIG)]
    for item in overrides(run_dir, ITERS, extra):
        args += ["--set", item]
    proc = submit_cli(*args, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split()[2]

    wait_running_past(job_id, run_dir, PREEMPT_AT[0])
    subprocess.run(["scontrol", "requeue", job_id], check=True)  # SIGTERM to every process of the job
    wait_running_past(job_id, run_dir, PREEMPT_AT[1])
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED", job_story(run_dir, job_id)
    runs = parse_progress(RunFolder(str(run_dir)).progress_log())
    assert [r.last("Ending job").fields["Reason"] for r in runs] == ["signal", "signal", "done"], job_story(run_dir, job_id)
    assert len(sacct_runs(job_id)) == 3

    log = log_text(run_dir, job_id)
    assert "logging is off for the rest of this run" not in log, log[-4000:]
    assert_one_run_each_step_once(run_dir, list(range(1, ITERS + 1)))
    # one .wandb file per run of the job, or two where W&B's writer died of the SIGTERM and was replaced
    assert 3 <= len(wandb_history(run_dir)) <= 4

    assert files_holding(run_dir, secrets.values()) == []
    assert all(s not in (run_dir / "job.sbatch").read_text() for s in secrets.values())
