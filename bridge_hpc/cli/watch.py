"""The live view's data: a job's Slurm runs and its run folder, polled until Slurm is done with it.

``bridge-status --follow`` and ``bridge-submit --wait`` both call :func:`watch`; what they show and
how is :mod:`bridge_hpc.report.live`. This module joins the three sources, which only the command
side may read together: what the run folder's resolved.toml records (``train.train_iters`` and where
metrics.jsonl is, re-rooted to the folder named where it was moved or copied:
:mod:`bridge_hpc.report.run_paths`), Slurm (:mod:`bridge_hpc.slurm.query`) and the metrics file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from bridge_hpc.contracts.save_interval import read_history
from bridge_hpc.report.live import LiveDisplay, LiveStatus, MetricsTail, add_training_figures, job_eta
from bridge_hpc.report.run_paths import RunPaths, read_run_paths
from bridge_hpc.slurm.query import job_finished, job_runs, job_times

#: Seconds between two polls of Slurm and the metrics file.
POLL_S = 2.0


class LiveReader:
    """Builds a :class:`LiveStatus` for one job of a run folder, poll after poll."""

    def __init__(self, run_dir: Path, job_id: str, paths: Optional[RunPaths] = None):
        self.job_id = job_id
        # a resolved.toml that cannot be read gives no step count and the default metrics.jsonl: the view
        # shows what Slurm and the files say (the caller prints ``paths.notes()``)
        self.paths = paths or read_run_paths(str(run_dir))
        self.train_iters: Optional[int] = self.paths.train_iters
        self._metrics = MetricsTail(Path(self.paths.metrics))

    def poll(self) -> LiveStatus:
        runs = job_runs(self.job_id)
        state = runs[-1].state if runs else "UNKNOWN"
        status = LiveStatus(job_id=self.job_id, state=state, restarts=max(0, len(runs) - 1),
                            train_iters=self.train_iters, reason=runs[-1].reason if runs else "",
                            finished=job_finished(state))
        self._metrics.poll()
        add_training_figures(status, list(self._metrics.records))
        limit_s = None
        if state == "RUNNING":
            times = job_times(self.job_id)
            if times is not None:
                status.allocation_left_s = max(0.0, times.end - time.time())
                limit_s = times.limit_s
        if not status.finished:
            add_job_eta(status, self.paths, limit_s)
        return status


def add_job_eta(status: LiveStatus, paths: RunPaths, time_limit_s: Optional[float] = None) -> None:
    """The job's ETA across requeues (:func:`bridge_hpc.report.live.job_eta`) from the run folder's
    progress log, in place of the training time alone."""
    try:
        history = read_history(paths.progress_log, last_run_live=status.state == "RUNNING")
    except OSError:
        history = None
    if history is None or not history.runs:
        if status.eta_s is not None:
            status.eta_note = "training time only: no progress.txt yet, so requeues are not counted"
        else:
            status.eta_note = "not yet: no step of this job timed yet"
        return
    prior, prior_from = paths.interval_prior
    eta = job_eta(history, status.step, status.train_iters, status.step_s, running=status.state == "RUNNING",
                  allocation_left_s=status.allocation_left_s, time_limit_s=time_limit_s, prior_mtbf_s=prior,
                  prior_from=prior_from)
    status.eta_s, status.eta_note = eta.seconds, eta.note


def watch(run_dir: Path, job_id: str, style: str, stream: TextIO = sys.stdout,
          paths: Optional[RunPaths] = None) -> LiveStatus:
    """Show the job live until Slurm is done with it (a requeue is not done); return the last status.
    ``paths``: the run folder's, where the caller has read them already."""
    reader = LiveReader(run_dir, job_id, paths)
    display = LiveDisplay(run_dir, style, stream)
    try:
        while True:
            status = reader.poll()
            if status.state != "UNKNOWN":  # UNKNOWN: accounting has not seen the job yet
                display.show(status)
            if status.finished:
                return status
            time.sleep(POLL_S)
    finally:
        display.close()
