"""Write a run folder and submit its script through submitit, which then tracks the job.

submitit normally renders its own script around a pickled function; bridge_hpc renders the script
from its templates instead and hands submitit the text (``TemplateExecutor``), so that ``job.state``,
``job.stdout()`` and ``job.cancel()`` work on our jobs as on any submitit job.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import submitit
import toml

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.launch.jobconfig import JobConfig, check_secrets_present, dump_resolved
from bridge_hpc.contracts import run_folder
from bridge_hpc.launch.render import render_script


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


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_run_dir(cfg: JobConfig, script: str, resolved: str, force: bool = False) -> None:
    """Check, then write, the script and the resolved config.

    The same job submitted again (to continue after a cancel, or from its own resolved.toml)
    reuses the folder and resumes from its checkpoints. A folder that holds a *different* job is left
    untouched unless ``force``; then, as whenever a file would change, the old one is kept as
    ``<name>.<n>``: nothing a user has is ever overwritten.
    """
    folder = cfg.run_folder
    files = {"resolved": Path(folder.resolved_config), "script": Path(folder.job_script)}
    same_job = False
    if files["resolved"].exists():
        try:
            same_job = toml.loads(files["resolved"].read_text()) == toml.loads(resolved)
        except toml.TomlDecodeError:
            same_job = False
        if not same_job and not force:
            raise ConfigError(
                f"run folder {cfg.job.run_dir} already holds a different job (see its resolved.toml); "
                "choose another job.run_dir, or pass --force to submit anyway (the old files are kept)",
                path=str(cfg.path), key="job.run_dir",
            )
    for key, text in (("resolved", resolved), ("script", script)):
        path = files[key]
        if path.exists():
            if key == "resolved" and same_job:
                continue
            if path.read_text() == text:
                continue
            n = 1
            while path.with_name(f"{path.name}.{n}").exists():
                n += 1
            path.rename(path.with_name(f"{path.name}.{n}"))
        _atomic_write(path, text)
    Path(folder.logs).mkdir(parents=True, exist_ok=True)


def submit(cfg: JobConfig, force: bool = False) -> Submission:
    """Render, write the run folder, submit. Raises ConfigError before anything is written."""
    check_secrets_present(cfg)
    script = render_script(cfg)
    resolved = dump_resolved(cfg)
    prepare_run_dir(cfg, script, resolved, force=force)
    folder = cfg.run_folder
    executor = TemplateExecutor(folder=Path(folder.logs), script=script, num_tasks=cfg.num_tasks)
    job = executor.submit_script()
    record = {"job_id": job.job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": str(cfg.path)}
    with open(folder.jobs_log, "a") as f:
        f.write(json.dumps(record) + "\n")
    return Submission(
        job_id=job.job_id, run_dir=cfg.run_dir, script_path=Path(folder.job_script),
        resolved_path=Path(folder.resolved_config), stdout=Path(str(job.paths.stdout)), job=job,
    )


def submitted_job_ids(run_dir: Path) -> List[str]:
    """Job ids submitted into a run folder, oldest first (from its jobs.jsonl)."""
    path = Path(run_folder.RunFolder(str(run_dir)).jobs_log)
    if not path.exists():
        return []
    ids = []
    for line in path.read_text().splitlines():
        try:
            ids.append(str(json.loads(line)["job_id"]))
        except (ValueError, KeyError):
            continue
    return ids
