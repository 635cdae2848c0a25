"""One report per argument of ``bridge-report``: a run folder (or a progress log) read into a :class:`RunReport`.

From a run folder :func:`read_run_report` reads, where its resolved.toml places them re-rooted to the
folder named (:mod:`bridge_hpc.report.run_paths`: a moved or copied folder is read, never its original):

- the progress log (``progress.txt`` in the checkpoint folder, found by :func:`find_progress_log`):
  the runs, where the time went, why each run ended;
- ``metrics.jsonl`` and the jobs' stdout logs (:mod:`bridge_hpc.report.curves`): the loss curves and
  tokens/s;
- resolved.toml's Slurm request: the device where the progress log does not name it.

Best effort on damage: lines that cannot be read (not UTF-8, cut short, not a record) are passed over
and counted, a resolved.toml that cannot be read is passed over, and each is said in one line of
``RunReport.notes``. Without a progress log (``logger.log_progress`` off, or a run that never started)
the report comes from metrics.jsonl alone: steps, losses and tokens/s, with the runs, where the time
went and goodput unknown ("?"). Only an argument that leaves nothing to report raises ConfigError.
A progress log given by itself (a Megatron-LM or Bridge checkpoint folder's) gives the runs only.
Login-node code: no torch, no matplotlib.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.progress_log import read_progress
from bridge_hpc.contracts.save_interval import Hindsight, hindsight, history_of_runs
from bridge_hpc.report.curves import TrainingCurves, read_curves
from bridge_hpc.report.goodput import Report, build_report, metrics_only_report
from bridge_hpc.report.run_paths import RunPaths, read_run_paths


@dataclass
class RunReport:
    """What ``bridge-report`` shows of one argument: ``label`` names it in tables and legends."""

    target: str
    label: str
    progress_log: Optional[str]  # None: no progress log; the report comes from metrics.jsonl alone
    report: Report
    curves: Optional[TrainingCurves]  # None: no metrics.jsonl (a progress log given by itself)
    #: one line each: what was passed over or read elsewhere than expected (printed on stderr)
    notes: List[str] = field(default_factory=list)
    #: the save interval(s) used, the time lost to saves and unwarned interruptions, and the interval that
    #: would have lost the least in hindsight (None without a progress log)
    save_interval: Optional[Hindsight] = None
    #: the interval resolved.toml records ("auto", a number, or None), for runs that recorded none
    configured_interval: Optional[object] = None
    #: resolved.toml's ``[model]`` ({} without it): what the figures count (an MoE model's active experts)
    model: dict = field(default_factory=dict)


class NoProgressLog(ConfigError):
    """A run folder without its progress log (the message says where it looked and why there may be none)."""


def _log_progress_hint(paths: RunPaths) -> str:
    """Why a run folder may have no progress log: the job setting that turns it on, as resolved.toml
    records it (the default is the version's that ran the job, so it is not guessed here)."""
    where = f"this run's {run_folder.RESOLVED_CONFIG}"
    if paths.log_progress is False:
        return f"progress logging (logger.log_progress) is off in {where}"
    if paths.log_progress is True:
        return (f"logger.log_progress is on in {where}: no run has started yet, or its progress log was removed "
                "or lies elsewhere")
    if paths.recorded:
        return f"progress logging is logger.log_progress, which {where} does not set (the default then applied)"
    return "progress logging is the job setting logger.log_progress"


def find_progress_log(target: str, paths: Optional[RunPaths] = None) -> str:
    """The progress log for a file or a run directory.

    In a run directory: in the checkpoint folder its resolved.toml records (``[checkpoint] save``,
    re-rooted to ``target`` where the folder was moved or copied: ``paths``), else the default checkpoint
    folder, else ``progress.txt`` in the folder itself or the only one found below it (a checkpoint
    folder of Megatron-LM or Bridge). Raises ConfigError naming the path when there is no such file or
    directory or when there are several logs, :class:`NoProgressLog` when there is none.
    """
    if not os.path.exists(target):
        raise ConfigError("no such file or directory", path=target)
    if not os.path.isdir(target):
        return target
    paths = paths or read_run_paths(target)
    candidates = [paths.progress_log, paths.folder.progress_log(), os.path.join(target, run_folder.PROGRESS_FILE)]
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
    looked = ", ".join(dict.fromkeys(os.path.dirname(c) for c in candidates))
    raise NoProgressLog(f"no {run_folder.PROGRESS_FILE} (looked in {looked} and below); {_log_progress_hint(paths)}",
                        path=target)


def _lines(numbers: Sequence[int], total: int) -> str:
    """``3 of 40 lines (4, 17, 40)``: the first few numbers only."""
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return f"{len(numbers)} of {total} line{'s' if total != 1 else ''} ({shown})"


def read_run_report(target: str, label: Optional[str] = None, device_fallback: Optional[str] = None,
                    paths: Optional[RunPaths] = None) -> RunReport:
    """Read one argument of ``bridge-report`` (best effort, see the module docstring).

    ``device_fallback``: the device where the progress log does not name it ("cpu" or "gpu"; by default
    the run folder's Slurm request); ``paths``: the run folder's paths, if read already. Raises
    ConfigError naming the file when the argument leaves nothing to report.
    """
    if not os.path.exists(target):
        raise ConfigError("no such file or directory", path=target)
    notes: List[str] = []
    if os.path.isdir(target):
        paths = paths or read_run_paths(target)
        notes += paths.notes()
        device_fallback = device_fallback or paths.requested_device
    else:
        paths = None

    log_path: Optional[str] = None
    unusable = ConfigError("")  # why the progress log gives no runs, naming the file
    runs = []
    try:
        log_path = find_progress_log(target, paths)
    except NoProgressLog as err:
        unusable = err
    if log_path is not None:
        try:
            read = read_progress(log_path)
        except OSError as err:
            unusable = ConfigError(f"cannot read: {err.strerror or err}", path=log_path)
        else:
            runs = read.runs
            if not runs:
                unusable = ConfigError("no 'Starting job' line: not a progress log, or no run has started",
                                       path=log_path)
            elif read.skipped:
                notes.append(f"{log_path}: skipped {_lines(read.skipped, read.lines)} that could not be read "
                             "(damaged, cut short, or of no run)")

    curves: Optional[TrainingCurves] = None
    if paths is not None:
        job_ids = list(dict.fromkeys(run.job_id for run in runs))
        try:
            curves = read_curves(paths.metrics, [paths.folder.stdout(job_id) for job_id in job_ids])
        except ConfigError as err:
            notes.append(f"{err.format()}: passed over")
        if curves is not None and curves.skipped:
            notes.append(f"{curves.metrics_path}: skipped {_lines(curves.skipped, curves.lines)} that are not "
                         "complete JSON records")
        if curves is not None and curves.unread_logs:
            notes.append(f"validation losses: could not read {', '.join(curves.unread_logs)}")

    if runs:
        report = build_report(runs, curves, device_fallback)
    elif curves is not None and curves.steps:
        notes.append(f"{unusable.format()}; reported from {curves.metrics_path} alone: the runs, where the time "
                     "went and goodput are unknown")
        report = metrics_only_report(curves, device_fallback)
        log_path = None
    else:
        if paths is not None:
            metrics = paths.metrics
            why = ("no such file" if not os.path.isfile(metrics) else "cannot be read" if curves is None
                   else "no record with a loss")
            unusable.message += f"; nothing else to report ({metrics}: {why})"
        raise ConfigError(unusable.message, path=unusable.path)
    configured, model = None, {}
    if paths is not None:
        table = paths.recorded.get("checkpoint")
        configured = table.get("save_interval") if isinstance(table, dict) else None
        model = paths.recorded.get("model") if isinstance(paths.recorded.get("model"), dict) else {}
    return RunReport(target, label or target, log_path, report, curves, notes,
                     hindsight(history_of_runs(runs)) if runs else None, configured, model)


def labels_for(targets: Sequence[str]) -> List[str]:
    """Short names for legends and tables: a run folder's last path component (a file's path as given),
    or every path as given where two names would read the same."""
    names = [os.path.normpath(t) if os.path.isfile(t) else os.path.basename(os.path.normpath(t)) or t
             for t in targets]
    return names if len(set(names)) == len(names) else [os.path.normpath(t) for t in targets]
