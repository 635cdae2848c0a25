"""The demo job, for real: bridge-submit configs/local-tiny.toml on the local cluster, the training
entry on every rank (torch.distributed over gloo, megatron-core GPT on CPU), checkpoints written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_hpc.contracts.progress_log import parse_progress

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def run_demo(tmp_path: Path, *overrides: str, expect_ok: bool = True) -> tuple:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "bridge_hpc.cli.submit", str(ROOT / "configs" / "local-tiny.toml"), "--wait",
            "--set", f"job.run_dir={run_dir}", "--set", "train.train_iters=6", "--set", "checkpoint.save_interval=3",
            "--set", "logger.log_interval=1", "--set", "train.eval_interval=3"]
    for item in overrides:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    job_id = result.stdout.split()[2] if result.stdout.startswith("Submitted job") else None
    log = ""
    if job_id:
        for suffix in ("out", "err"):
            path = run_dir / "logs" / f"{job_id}_0_log.{suffix}"
            log += path.read_text() if path.exists() else ""
    assert (result.returncode == 0) == expect_ok, result.stdout + result.stderr + log
    return run_dir, job_id, log


def check_trained(run_dir: Path, log: str) -> None:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(s["loss"], float) and s["loss"] > 0 for s in steps)
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (run_dir / "checkpoints" / "iter_0000006").is_dir()
    # both ranks joined (the progress log's world size) and both wrote their shard of the checkpoint
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert [r.world_size for r in runs] == [2], log
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "iter_0000006").glob("*.distcp"))
    assert {name.split("_")[2] for name in shards} == {"0", "1"}, shards


def test_demo_two_ranks_one_node(slurm_cluster, tmp_path: Path):
    run_dir, _, log = run_demo(tmp_path)
    check_trained(run_dir, log)


def test_demo_two_nodes_one_rank_each(slurm_cluster_2nodes, tmp_path: Path):
    run_dir, job_id, log = run_demo(tmp_path, "slurm.nodes=2", "slurm.ntasks_per_node=1")
    check_trained(run_dir, log)
    nodes = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "NodeList"], capture_output=True, text=True)
    assert nodes.stdout.strip() in ("n[1-2]", "n1,n2")


def test_bad_input_found_on_the_ranks_ends_the_job_without_retries(slurm_cluster, tmp_path: Path):
    # a module name of the right form passes the login node (which cannot import user code); the
    # ranks cannot import it: one message per rank naming the key, exit status 2, and no requeue
    # (the same input would fail the same way on every retry)
    run_dir, job_id, log = run_demo(tmp_path, "job.forward_step='no_such_module:forward_step'", expect_ok=False)
    errors = [line for line in log.splitlines() if ": error: " in line and "resolved.toml" in line]
    assert sorted(e[:3] for e in errors) == ["0: ", "1: "], log  # srun --label: one line from each rank
    assert all("key 'job.forward_step'" in e and "No module named 'no_such_module'" in e for e in errors), log
    assert "Traceback" not in log and "requeueing" not in log.replace("not requeueing", ""), log
    assert "rejected the job's input (status 2" in log, log
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates", "-o", "State,ExitCode"],
                         capture_output=True, text=True).stdout.split()
    assert out == ["FAILED|2:0"], out
    assert not (run_dir / "metrics.jsonl").exists()
