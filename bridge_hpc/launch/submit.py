"""Write a run folder and submit its script through submitit, which then tracks the job.

submitit normally renders its own script around a pickled function; bridge_hpc renders the script
from its templates instead and hands submitit the text (``TemplateExecutor``), so that ``job.state``,
``job.stdout()`` and ``job.cancel()`` work on our jobs as on any submitit job.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence

import submitit

from bridge_hpc.jobfile.jobconfig import JobConfig, check_secrets_present, dump_resolved
from bridge_hpc.launch.preflight import (
    SLURM_TOOLS,
    check_resume,
    holds_same_job,
    make_run_dir,
    remove_folders,
    run_dir_error,
    submitted_job_ids,
)
from bridge_hpc.launch.render import render_script
from bridge_hpc.slurm.query import unfinished_jobs


class TemplateExecutor(submitit.SlurmExecutor):
    """A submitit SlurmExecutor whose submission file is a script we rendered ourselves."""

    def __init__(self, folder: Path, script: str, num_tasks: int):
        super().__init__(folder=folder)
        self._script = script
        self._tasks = num_tasks

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return self._tasks

    def submit_script(self) -> submitit.Job:
        return self._submit_command("")


@dataclass
class Submission:
    job_id: Optional[str]
    run_dir: Path
    script_path: Path
    resolved_path: Path
    stdout: Path
    job: Optional[submitit.Job] = None
    warning: Optional[str] = None  # something the user should know about a job that was submitted


def _atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file, fsynced, renamed); an OSError names
    ``path``, not the temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


class SlurmNotFound(Exception):
    """Slurm's client tools are not on PATH: not bad input, a machine without Slurm."""


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the run folder itself (flock on the directory: no file of its own),
    so that two bridge-submit of one folder check and submit one after the other. Where the file
    system has no locks (some network file systems), go on without."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def check_not_busy(cfg: JobConfig) -> None:
    """Refuse a run folder that a job submitted from it is still using: one that Slurm has not
    finished (pending, running, requeued, completing, suspended). Two jobs of one folder would train
    into the same checkpoints and logs at once. Slurm is asked once, about the folder's jobs.jsonl."""
    live: Dict[str, str] = unfinished_jobs(submitted_job_ids(cfg.run_dir))
    if live:
        job_id, state = next(reversed(live.items()))
        others = f" (and {len(live) - 1} more)" if len(live) > 1 else ""
        raise cfg.error("job.run_dir", f"run folder {cfg.job.run_dir} is in use by job {job_id}{others}, which is "
                        f"{state}; wait for it to end or cancel it (scancel {job_id}), or pass --force to submit "
                        "anyway (both jobs would then use this folder)")


def prepare_run_dir(cfg: JobConfig, script: str, resolved: str, force: bool = False) -> None:
    """Check, then write, the script and the resolved config.

    The same job submitted again (to continue after a cancel, or from its own resolved.toml)
    reuses the folder and resumes from its checkpoints. A folder that holds a *different* job is left
    untouched unless ``force`` (:func:`~bridge_hpc.launch.preflight.holds_same_job`); then, as whenever
    a file would change, the old one is kept as ``<name>.<n>``: nothing a user has is ever overwritten.
    """
    folder = cfg.run_folder
    files = {"resolved": Path(folder.resolved_config), "script": Path(folder.job_script)}
    same_job = holds_same_job(cfg, resolved, force)
    try:
        for key, text in (("resolved", resolved), ("script", script)):
            path = files[key]
            if path.exists():
                if key == "resolved" and same_job:
                    continue
                if path.read_text(errors="replace") == text:
                    continue
                n = 1
                while path.with_name(f"{path.name}.{n}").exists():
                    n += 1
                path.rename(path.with_name(f"{path.name}.{n}"))
            _atomic_write(path, text)
        Path(folder.logs).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise run_dir_error(cfg, err) from None


def submit(cfg: JobConfig, force: bool = False) -> Submission:
    """Render, write the run folder, submit. Raises ConfigError before anything is submitted; when it
    refuses, nothing in the run folder has changed (at most the folder itself was created)."""
    check_secrets_present(cfg)
    script = render_script(cfg)
    resolved = dump_resolved(cfg)
    check_resume(cfg)
    created = make_run_dir(cfg)
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        remove_folders(created)  # leave no trace of a submit that cannot happen
        raise SlurmNotFound(f"{' and '.join(missing)} not found on PATH")
    with _locked(Path(cfg.job.run_dir)):
        if not force:
            check_not_busy(cfg)
        prepare_run_dir(cfg, script, resolved, force=force)
        folder = cfg.run_folder
        executor = TemplateExecutor(folder=Path(folder.logs), script=script, num_tasks=cfg.num_tasks)
        try:
            job = executor.submit_script()
        except OSError as err:
            # sbatch missing (FileNotFoundError naming it) is the caller's to explain; anything else
            # here is submitit writing its submission file into the run folder's logs/.
            if err.filename and str(err.filename).startswith(cfg.job.run_dir):
                raise run_dir_error(cfg, err) from None
            raise
        warning = None
        try:
            record_jobs(Path(folder.jobs_log), [job.job_id], str(cfg.path))
        except OSError as err:  # the job is submitted: say what is missing rather than fail
            warning = (f"job {job.job_id} was submitted, but {folder.jobs_log} could not be written "
                       f"({err.strerror or err}): bridge-status and the next bridge-submit will not know it")
    return Submission(
        job_id=job.job_id, run_dir=cfg.run_dir, script_path=Path(folder.job_script),
        resolved_path=Path(folder.resolved_config), stdout=Path(str(job.paths.stdout)), job=job, warning=warning,
    )


def record_jobs(jobs_log: Path, job_ids: Sequence[str], config: str) -> None:
    """Append submitted job ids to a folder's ``jobs.jsonl`` (what :func:`submitted_job_ids`, the next
    submission's busy check and bridge-status read); ``config`` names the job file they came from."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(jobs_log, "a") as f:
        f.write("".join(json.dumps({"job_id": str(j), "submitted": stamp, "config": config}) + "\n" for j in job_ids))
