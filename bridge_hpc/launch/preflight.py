"""The run folder's checks before a submit writes anything, and what ``bridge-submit --dry-run`` runs.

A real submit creates the run folder (or says why it cannot), refuses one that holds a different job
(its resolved.toml) and one whose earlier job Slurm has not finished, then writes and submits. The dry
run runs the same checks but those that need Slurm, leaves no trace (a folder it had to create to see
that it can is removed again) and says which checks it could not run. No submitit here: a dry run
does not import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import List, Optional

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.jobfile.jobconfig import JobConfig, parse_toml
from bridge_hpc.training.checkpoint.architecture import check_resumed_adapters

#: What submitting needs on PATH: sbatch, and srun, which submitit looks for before it submits.
SLURM_TOOLS = ("sbatch", "srun")


def run_dir_error(cfg: JobConfig, err: OSError) -> ConfigError:
    what = "it exists and is not a folder" if isinstance(err, FileExistsError) else (err.strerror or str(err))
    where = f" ({err.filename})" if err.filename and str(err.filename) != cfg.job.run_dir else ""
    return cfg.error("job.run_dir", f"cannot create or write the run folder {cfg.job.run_dir}: {what}{where}; "
                     "expected a folder this user can create and write")


def check_resume(cfg: JobConfig) -> None:
    """What the ranks refuse before they resume, refused here before anything is queued: the checkpoint
    the job would resume from (``checkpoint.load``, else ``checkpoint.save``) holding adapters of another
    base (``checkpoint.pretrained_checkpoint``), type or shape (``peft.<key>``), or a full model under a
    PEFT job, or the reverse (``peft``). One ConfigError naming the job file, the key, the checkpoint's
    peft_base.json and both values (:func:`bridge_hpc.training.checkpoint.architecture.check_resumed_adapters`)."""
    if cfg.training is None:
        return
    try:
        check_resumed_adapters(cfg.training.checkpoint, cfg.training.peft)
    except ConfigError as err:
        raise cfg.error(err.key or "checkpoint.load", err.path and f"{err.path}: {err.message}" or err.message) from None


def make_run_dir(cfg: JobConfig) -> List[Path]:
    """Create the run folder (and its parents) or say, naming ``job.run_dir``, why it cannot be:
    a parent that is a file (``/etc/passwd/x``), a read-only file system, ``/proc``, no permission.
    Returns the folders it created, outermost first; when it refuses, it leaves none of them."""
    path = Path(cfg.job.run_dir)
    created: List[Path] = []
    try:
        missing = path
        while not os.path.lexists(missing) and missing != missing.parent:
            created.insert(0, missing)
            missing = missing.parent
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_folders(created)  # the parents made before a name the file system refuses, say
        raise run_dir_error(cfg, err) from None
    if not os.access(path, os.W_OK | os.X_OK):
        remove_folders(created)
        raise cfg.error("job.run_dir", f"cannot write the run folder {path}: "
                        f"{'read-only file system' if _read_only(path) else 'permission denied'}; "
                        "expected a folder this user can write")
    return created


def remove_folders(created: List[Path]) -> None:
    """Remove the (still empty) folders :func:`make_run_dir` created, innermost first."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def holds_same_job(cfg: JobConfig, resolved: str, force: bool = False) -> bool:
    """Whether the run folder's resolved.toml is ``resolved`` (the same job, submitted again to continue
    it). A folder that holds a *different* job is refused (ConfigError naming ``job.run_dir``) unless
    ``force``; a folder without a resolved.toml holds no job (False)."""
    path = Path(cfg.run_folder.resolved_config)
    try:
        if not path.exists():
            return False
        try:
            same_job = _parse_resolved(path.read_text()) == _parse_resolved(resolved)
        except ValueError:  # UnicodeDecodeError too
            same_job = False
    except OSError as err:
        raise run_dir_error(cfg, err) from None
    if not same_job and not force:
        raise cfg.error(
            "job.run_dir",
            f"run folder {cfg.job.run_dir} already holds a different job (see its resolved.toml); "
            "choose another job.run_dir, or pass --force to submit anyway (the old files are kept)",
        )
    return same_job


def _parse_resolved(text: str) -> dict:
    """A resolved.toml's content for comparison (ValueError when it is not TOML)."""
    try:
        return parse_toml(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def dry_run(cfg: JobConfig, resolved: str, force: bool = False) -> str:
    """``bridge-submit --dry-run``'s run-folder checks: those of a real submit that need no Slurm (the
    folder can be created and written, it holds no different job unless ``force``), with nothing left
    behind. Returns one line saying which checks needed Slurm and were not run."""
    check_resume(cfg)
    created = make_run_dir(cfg)
    try:
        holds_same_job(cfg, resolved, force)
    finally:
        remove_folders(created)
    skipped = ["whether sbatch accepts the job (its partition, account, qos and limits)"]
    job_ids = [] if force else submitted_job_ids(cfg.run_dir)
    if job_ids:
        shown = ", ".join(job_ids[-3:]) + (f" and {len(job_ids) - 3} earlier" if len(job_ids) > 3 else "")
        skipped.append(f"whether the run folder's job{'s' if len(job_ids) > 1 else ''} {shown} "
                       f"{'are' if len(job_ids) > 1 else 'is'} still pending or running (squeue)")
    line = f"note: not checked by --dry-run, as they need Slurm: {'; '.join(skipped)}"
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        line += f"; {' and '.join(missing)} not found on PATH here"
    return line


def submitted_job_ids(run_dir: Path, skipped: Optional[List[int]] = None) -> List[str]:
    """Job ids submitted into a run folder, oldest first (from its jobs.jsonl; [] without one).

    Only Slurm job ids come back (digits, or an array task's ``<job>_<task>``: ``is_job_id``), as they are
    handed to squeue, sacct and scontrol. A line that is not UTF-8 JSON with such an id under ``job_id``
    (a torn or edited line, ``--help``) is passed over: its 1-based number is appended to ``skipped``
    where the caller passes a list, so that it can say how many."""
    from bridge_hpc.slurm.query import is_job_id

    path = Path(run_folder.RunFolder(str(run_dir)).jobs_log)
    try:
        data = path.read_bytes()
    except OSError:
        return []
    ids = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            job_id = json.loads(line.decode("utf-8"))["job_id"]
        except (ValueError, KeyError, TypeError, IndexError):  # UnicodeDecodeError is a ValueError
            job_id = None
        if isinstance(job_id, int) and not isinstance(job_id, bool):
            job_id = str(job_id)
        if is_job_id(job_id):
            ids.append(job_id)
        elif skipped is not None:
            skipped.append(number)
    return ids
