"""Ask Slurm about jobs: sacct for history (every requeued run of a job), squeue for live jobs.

Login-node code; the one place that parses these tools' output.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import List, Optional

TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"}


@dataclass
class JobRun:
    """One run of a job: a requeued job has several under the same id."""

    job_id: str
    state: str
    exit_code: str
    start: str
    end: str
    elapsed: str
    nodes: str
    reason: str = ""


def _run(cmd: List[str]) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def job_runs(job_id: str) -> List[JobRun]:
    """Every run of a job, oldest first (``sacct --duplicates`` keeps the requeued ones)."""
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates",
                "-o", "JobID,State,ExitCode,Start,End,Elapsed,NodeList"])
    runs = []
    for line in (out or "").splitlines():
        fields = line.split("|")
        if len(fields) >= 7:
            runs.append(JobRun(fields[0], fields[1].split()[0], fields[2], fields[3], fields[4], fields[5], fields[6]))
    live = live_state(job_id)
    if live and (not runs or runs[-1].state in TERMINAL_STATES and live[0] not in TERMINAL_STATES):
        # sacct may lag behind the controller right after a requeue
        runs.append(JobRun(job_id, live[0], "", "", "", "", "", live[1]))
    elif live and runs:
        runs[-1].reason = live[1]
    return runs


def live_state(job_id: str) -> Optional[tuple]:
    """(state, reason) from squeue while the controller still knows the job, else None."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    if not out or not out.strip():
        return None
    state, _, reason = out.strip().splitlines()[0].partition("|")
    return state, reason


def job_end_time(job_id: str, environ: Optional[dict] = None) -> Optional[float]:
    """The job's real end time (epoch seconds), or None when Slurm cannot tell (no limit, no Slurm).

    Newer Slurm exports SLURM_JOB_END_TIME; 22.05 does not, so ask squeue (``%e``, local time),
    then scontrol. Read again after a requeue or an ``scontrol update TimeLimit``: it can move.
    """
    import os
    import re
    import time as _time

    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(environ["SLURM_JOB_END_TIME"])
    text = (_run(["squeue", "-h", "-j", job_id, "-o", "%e"]) or "").strip()
    if not re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$", text):
        show = _run(["scontrol", "show", "job", job_id]) or ""
        m = re.search(r"\bEndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", show)
        text = m.group(1) if m else ""
    if not text:
        return None
    return _time.mktime(_time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
