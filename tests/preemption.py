"""Driving real jobs through preemptions on the local cluster, and checking they lost nothing.

Shared by tests/test_preemption_slurm.py and benchmarks/preemption.py. Every run is the demo's
tiny GPT (configs/local-tiny.toml) with 2 ranks; the reference is the same config trained in one go
by torchrun, so any difference in losses or parameters is the interruption's fault.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bridge_hpc.slurm.query import TERMINAL_STATES

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "local-tiny.toml"
#: A forward step with faults and delays chosen by environment variables (see its docstring)
FAULTY_FORWARD_STEP = ROOT / "tests" / "data" / "faulty_forward_step.py"


def overrides(run_dir: Path, train_iters: int, extra: List[str] = ()) -> List[str]:
    base = [f"job.run_dir={run_dir}", f"train.train_iters={train_iters}", "logger.log_interval=10",
            "train.eval_interval=50", "checkpoint.save_interval=25", "checkpoint.most_recent_k=3"]
    return base + list(extra)


def reference_run(run_dir: Path, train_iters: int) -> Path:
    """The uninterrupted run: torchrun, 2 ranks, same config."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
            "-m", "bridge_hpc.training.run", str(CONFIG)]
    for item in overrides(run_dir, train_iters):
        args += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def submit(run_dir: Path, train_iters: int, extra: List[str] = ()) -> str:
    args = [sys.executable, "-m", "bridge_hpc.cli.submit", str(CONFIG)]
    for item in overrides(run_dir, train_iters, extra):
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[2]


def squeue_state(job_id: str) -> Optional[tuple]:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True).stdout.strip()
    return tuple(out.split("|", 1)) if out else None


def sacct_runs(job_id: str) -> List[str]:
    """The state of every run of the job (a requeued job has one line per run), oldest first."""
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                         capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def release_when_held(job_id: str) -> None:
    """Slurm holds a requeued job ~120 s (Reason=BeginTime); a test has no time for that."""
    from bridge_hpc.local_slurm.cluster import release_requeued

    state = squeue_state(job_id)
    if state and state[0] == "PENDING" and "BeginTime" in state[1]:
        release_requeued(job_id)


def drive(job_id: str, timeout: float = 900, on_tick: Optional[Callable[[], None]] = None) -> str:
    """Release requeue holds until the job is done; returns its final state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = squeue_state(job_id)
        if state is None:
            runs = sacct_runs(job_id)
            if runs and runs[-1] in TERMINAL_STATES:
                return runs[-1]
        else:
            release_when_held(job_id)
        if on_tick:
            on_tick()
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise TimeoutError(f"job {job_id} did not finish in {timeout} s")


def wait_running_past(job_id: str, run_dir: Path, step: int, timeout: float = 300) -> None:
    """Until the job runs and has logged ``step`` (releasing a requeue hold on the way)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = squeue_state(job_id)
        if state is None:
            raise AssertionError(f"job {job_id} ended before step {step}: {sacct_runs(job_id)}")
        release_when_held(job_id)
        if state[0] == "RUNNING" and steps_done(run_dir) >= step:
            return
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not reach step {step}")


def losses(run_dir: Path) -> Dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: Dict[int, float] = {}
    for r in records:
        assert r["step"] not in out, f"step {r['step']} logged twice"
        out[r["step"]] = r["loss"]
    return out


def log_text(run_dir: Path, job_id: str) -> str:
    parts = []
    for suffix in ("out", "err"):
        path = run_dir / "logs" / f"{job_id}_0_log.{suffix}"
        if path.exists():
            parts.append(path.read_text())
    return "\n".join(parts)
