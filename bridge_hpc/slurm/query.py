"""Ask Slurm about jobs: sacct for history (every requeued run of a job), squeue for live jobs,
scontrol for why a running job is being stopped.

Both sides use it (``bridge-status``/``bridge-submit`` on the login node; rank 0 for its end time
and for the cause of a stop signal); it is the one place that parses these tools' output. A job id is
checked (:func:`is_job_id`) before it reaches any of these tools: a word read from a damaged file is
never passed as an option. Stdlib only.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

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


#: A Slurm job id: digits, or an array task's ``<job>_<task>``. Every id this module hands to squeue,
#: sacct or scontrol matches it: a word from a damaged file (``--help``, ``1,2``) is never an option there.
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")


def is_job_id(text: object) -> bool:
    """Whether ``text`` is a Slurm job id (a str of ASCII digits, optionally ``_<task>``)."""
    return isinstance(text, str) and _JOB_ID.fullmatch(text) is not None


def _run(cmd: List[str]) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def job_runs(job_id: str) -> List[JobRun]:
    """Every run of a job, oldest first (``sacct --duplicates`` keeps the requeued ones); [] for a word
    that is not a job id (:func:`is_job_id`)."""
    if not is_job_id(job_id):
        return []
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
    """(state, reason) from squeue while the controller still knows the job, else None (and for a word
    that is not a job id)."""
    if not is_job_id(job_id):
        return None
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    if not out or not out.strip():
        return None
    state, _, reason = out.strip().splitlines()[0].partition("|")
    return state, reason


def job_finished(state: str) -> bool:
    """Whether a Slurm job state (``squeue %T``, ``sacct State``) is final: COMPLETED, FAILED,
    CANCELLED (``CANCELLED by 0``), TIMEOUT, ...; PENDING, RUNNING, REQUEUED, COMPLETING,
    SUSPENDED, ... are not."""
    word = (state.split() or [""])[0].rstrip("+")
    return word in TERMINAL_STATES or word in ("REVOKED", "SPECIAL_EXIT_DONE")


def unfinished_jobs(job_ids: Sequence[str]) -> Dict[str, str]:
    """``{job id: state}`` for those of ``job_ids`` that Slurm has not finished (pending, running,
    requeued, completing, suspended, ...), in the order of ``job_ids``, from one ``squeue`` call.
    A job the controller no longer knows is finished; so is every job when Slurm cannot be asked.
    An array job counts while any of its tasks does (``%F``: the array's id). Words that are not job
    ids are left out (one would make squeue refuse the whole list)."""
    wanted = list(dict.fromkeys(str(j) for j in job_ids if is_job_id(str(j))))
    if not wanted:
        return {}
    out = _run(["squeue", "-h", "-j", ",".join(wanted), "-o", "%F|%i|%T"]) or ""
    found: Dict[str, str] = {}
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or job_finished(fields[2]):
            continue
        array_id, job_id, state = fields
        for candidate in (job_id, array_id, job_id.split("_")[0]):
            if candidate in wanted:
                found.setdefault(candidate, state)
                break
    return {job_id: found[job_id] for job_id in wanted if job_id in found}  # in the order asked


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
    ``scontrol update TimeLimit`` or a preemption moves the end. None for a word that is not a job id."""
    if not is_job_id(job_id):
        return None
    out = (_run(["squeue", "-h", "-j", job_id, "-o", "%S|%e|%l"]) or "").strip()
    fields = out.splitlines()[0].split("|") if out else []
    if len(fields) != 3:
        return None
    start, end = _parse_stamp(fields[0]), _parse_stamp(fields[1])
    if start is None or end is None:
        return None
    return JobTimes(start=start, end=end, limit_s=parse_slurm_duration(fields[2]))


def scontrol_job(job_id: str) -> Dict[str, str]:
    """``scontrol show job -o`` as ``{field: value}`` ({} when Slurm cannot be asked, or for a word that
    is not a job id)."""
    if not is_job_id(str(job_id)):
        return {}
    out = _run(["scontrol", "show", "job", "-o", str(job_id)]) or ""
    fields: Dict[str, str] = {}
    for word in out.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def _accounted_state(job_id: str) -> str:
    """sacct's state of the job's current run ("" without accounting, or for a word that is not a job id):
    "CANCELLED by 0" -> CANCELLED."""
    if not is_job_id(str(job_id)):
        return ""
    lines = (_run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"]) or "").split("\n")
    lines = [line.split()[0] for line in lines if line.strip()]
    return lines[-1] if lines else ""


def stop_cause(job_id: Optional[str], restart_count: int) -> Optional[str]:
    """Why Slurm is stopping the current run of ``job_id`` (asked when a stop signal arrives):
    ``"cancelled"`` (``scancel``), ``"requeued"`` (``scontrol requeue``, a requeue by Slurm),
    ``"preempted"``, ``"time_limit"``, or None while the job runs on (a warning signal:
    ``--signal`` or ``scancel --signal``) or when Slurm cannot be asked.

    What tells them apart (seen on Slurm 22.05): a requeue has already raised ``Restarts`` above the
    run's ``SLURM_RESTART_COUNT``; a preemption sets ``PreemptTime``; a cancel and a time-out both
    leave the job COMPLETING, where accounting says which (``CANCELLED by <uid>`` / ``TIMEOUT``) and,
    without accounting, the end time does: a time-out ends at start + limit, a cancel before."""
    if not job_id:
        return None
    info = scontrol_job(job_id)
    if not info:
        return None
    try:
        if int(info.get("Restarts", "0")) > int(restart_count):
            return "requeued"
    except ValueError:
        pass
    if info.get("PreemptTime", "None") not in ("None", "", "(null)"):
        return "preempted"
    state = info.get("JobState", "")
    if state in ("RUNNING", "PENDING", "SUSPENDED", "CONFIGURING", "REQUEUED", ""):
        return None
    if state == "TIMEOUT":
        return "time_limit"
    if state == "PREEMPTED":
        return "preempted"
    if state == "CANCELLED":
        return "cancelled"
    accounted = _accounted_state(job_id)
    if accounted.startswith("CANCELLED"):
        return "cancelled"
    if accounted in ("TIMEOUT", "PREEMPTED", "REQUEUED"):
        return {"TIMEOUT": "time_limit", "PREEMPTED": "preempted", "REQUEUED": "requeued"}[accounted]
    start, end = _parse_stamp(info.get("StartTime", "")), _parse_stamp(info.get("EndTime", ""))
    limit = parse_slurm_duration(info.get("TimeLimit", ""))
    if start is not None and end is not None and limit is not None and end >= start + limit - 5.0:
        return "time_limit"
    return "cancelled"


#: ``python -m bridge_hpc.slurm.query stop-cause JOB RESTARTS``: the batch script asks this before it
#: requeues, so that a job the user cancelled is never requeued, whatever its ranks did.
STOP_CAUSE_COMMAND = "stop-cause"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print :func:`stop_cause` of a job (nothing while it runs on); exit 2 on a malformed command line.

    The batch script calls it from outside any container (where scontrol is known to exist): the
    ranks tell a cancel from a preemption themselves, but ranks that die on the cancel's SIGTERM
    without a clean exit would otherwise send the script down its retry-on-failure path."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != STOP_CAUSE_COMMAND or not args[2].isdigit():
        print(f"usage: python -m bridge_hpc.slurm.query {STOP_CAUSE_COMMAND} JOB_ID RESTART_COUNT", file=sys.stderr)
        return 2
    print(stop_cause(args[1], int(args[2])) or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
