"""One report per argument of ``bridge-report``: a run folder (or a progress log) read into a :class:`RunReport`.

From a run folder :func:`read_run_report` reads:

- the progress log (``progress.txt`` in the checkpoint folder, found by :func:`find_progress_log`):
  the runs, where the time went, why each run ended;
- ``metrics.jsonl`` and the jobs' stdout logs (:mod:`bridge_hpc.report.curves`): the loss curves and
  tokens/s.

What the job config says (where metrics.jsonl is, whether the job asked Slurm for GPUs) is the caller's
to pass: ``bridge-report`` (:mod:`bridge_hpc.cli.report`) reads resolved.toml the way the ranks do,
which this side of the package does not import. A progress log given by itself (a Megatron-LM or
Bridge checkpoint folder's) gives the runs only. Login-node code: no torch, no matplotlib.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.report.curves import TrainingCurves, read_curves
from bridge_hpc.report.goodput import Report, build_report
from bridge_hpc.report.progress import parse_progress


@dataclass
class RunReport:
    """What ``bridge-report`` shows of one argument: ``label`` names it in tables and legends."""

    target: str
    label: str
    progress_log: str
    report: Report
    curves: Optional[TrainingCurves]  # None: no metrics.jsonl (a progress log given by itself)


def _read_toml(path: str) -> dict:
    """tomllib on Python >= 3.11, the ``toml`` package (an install requirement) before."""
    try:
        import tomllib

        with open(path, "rb") as f:
            return tomllib.load(f)
    except ImportError:
        import toml

        return toml.load(path)


def find_progress_log(target: str) -> str:
    """The progress log for a file or a run directory.

    In a run directory: where its resolved.toml says the job checkpointed (``[checkpoint] save``,
    absolute there), else the default checkpoint folder, else ``progress.txt`` in the folder itself
    or the only one found below it (a checkpoint folder of Megatron-LM or Bridge). Raises ConfigError
    naming the path when there is none (or several).
    """
    if not os.path.exists(target):
        raise ConfigError("no such file or directory", path=target)
    if os.path.isfile(target):
        return target
    folder = RunFolder(target)
    candidates = []
    if os.path.isfile(folder.resolved_config):
        try:
            save = (_read_toml(folder.resolved_config).get("checkpoint") or {}).get("save")
        except (ValueError, OSError, RecursionError) as err:  # tomllib's and toml's decode errors are ValueErrors
            raise ConfigError(f"cannot read: {err}", path=folder.resolved_config) from None
        if isinstance(save, str) and save:
            # absolute, since resolved.toml records it so (a relative one is taken from the run folder)
            candidates.append(RunFolder(target, os.path.join(target, save)).progress_log())
    candidates += [folder.progress_log(), os.path.join(target, run_folder.PROGRESS_FILE)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    found = sorted(
        os.path.join(root, run_folder.PROGRESS_FILE) for root, _, files in os.walk(target)
        if run_folder.PROGRESS_FILE in files
    )
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"several progress logs, name one: {', '.join(found)}", path=target)
    raise ConfigError(f"no {run_folder.PROGRESS_FILE} found (looked in {run_folder.CHECKPOINTS_DIR}/, "
                      f"{run_folder.RESOLVED_CONFIG}'s [checkpoint] save and below)", path=target)


def read_run_report(target: str, label: Optional[str] = None, metrics_path: Optional[str] = None,
                    device_fallback: Optional[str] = None) -> RunReport:
    """Read one argument of ``bridge-report``; raises ConfigError naming the file that is missing or bad.

    ``metrics_path``: the run's metrics.jsonl (default: the run folder's); ``device_fallback``: the
    device where the progress log does not name it ("cpu" or "gpu", from the job's Slurm request)."""
    path = find_progress_log(target)
    try:
        runs = parse_progress(path)
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=path) from None
    if not runs:
        raise ConfigError("no 'Starting job' line: not a progress log, or no run has started", path=path)

    curves: Optional[TrainingCurves] = None
    if os.path.isdir(target):
        folder = RunFolder(target)
        job_ids = list(dict.fromkeys(run.job_id for run in runs))
        curves = read_curves(metrics_path or folder.metrics, [folder.stdout(job_id) for job_id in job_ids])
    report = build_report(runs, curves, device_fallback)
    return RunReport(target, label or target, path, report, curves)


def labels_for(targets: Sequence[str]) -> List[str]:
    """Short names for legends and tables: a run folder's last path component (a file's path as given),
    or every path as given where two names would read the same."""
    names = [os.path.normpath(t) if os.path.isfile(t) else os.path.basename(os.path.normpath(t)) or t
             for t in targets]
    return names if len(set(names)) == len(names) else [os.path.normpath(t) for t in targets]
