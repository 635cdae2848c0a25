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


@dataclass
class JobTimes:
    """When the current run of a job started, when Slurm will end it, and its time limit (epoch s).

    Preemption with a grace time moves ``end`` forward to now + GraceTime; a time-out does not: so a
    run whose end came before ``start + limit`` was preempted, whatever signal announced it.
    """

    start: float
    end: float
    limit_s: Optional[float]

    @property
    def shortened(self) -> bool:
        return self.limit_s is not None and self.end < self.start + self.limit_s - 5.0


def parse_slurm_duration(text: str) -> Optional[float]:
    """Slurm's ``[D-]HH:MM:SS`` / ``MM:SS`` / ``MM`` durations in seconds; None for UNLIMITED."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NOT_SET", "INVALID"):
        return None
    days, _, rest = text.rpartition("-")
    fields = [int(f) for f in rest.split(":")]
    if len(fields) == 1:  # a bare number is minutes
        hours, minutes, seconds = 0, fields[0], 0
    elif len(fields) == 2:
        hours, minutes, seconds = 0, fields[0], fields[1]
    else:
        hours, minutes, seconds = fields
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _parse_stamp(text: str) -> Optional[float]:
    import time as _time

    try:
        return _time.mktime(_time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def job_times(job_id: str) -> Optional[JobTimes]:
    """The job's times from squeue (Slurm 22.05 exports no SLURM_JOB_END_TIME), or None when Slurm
    cannot tell (no Slurm, job unknown, no time limit). Read again when it matters: an admin's
    ``scontrol update TimeLimit`` or a preemption moves the end."""
    out = (_run(["squeue", "-h", "-j", job_id, "-o", "%S|%e|%l"]) or "").strip()
    fields = out.splitlines()[0].split("|") if out else []
    if len(fields) != 3:
        return None
    start, end = _parse_stamp(fields[0]), _parse_stamp(fields[1])
    if start is None or end is None:
        return None
    return JobTimes(start=start, end=end, limit_s=parse_slurm_duration(fields[2]))
