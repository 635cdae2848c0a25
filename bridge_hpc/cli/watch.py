"""The live view's data: a job's Slurm runs and its run folder, polled until Slurm is done with it.

``bridge-status --follow`` and ``bridge-submit --wait`` both call :func:`watch`; what they show and
how is :mod:`bridge_hpc.report.live`. This module joins the three sources, which only the command
side may read together: the job config the ranks run (the run folder's resolved.toml, loaded by
``load_job_config`` as the ranks load it: ``train.train_iters`` and where metrics.jsonl is), Slurm
(:mod:`bridge_hpc.slurm.query`) and the metrics file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.launch.jobconfig import load_job_config
from bridge_hpc.report.live import LiveDisplay, LiveStatus, MetricsTail, add_training_figures
from bridge_hpc.slurm.query import job_finished, job_runs, job_times

#: Seconds between two polls of Slurm and the metrics file.
POLL_S = 2.0


class LiveReader:
    """Builds a :class:`LiveStatus` for one job of a run folder, poll after poll."""

    def __init__(self, run_dir: Path, job_id: str):
        self.job_id = job_id
        self.train_iters: Optional[int] = None
        folder = RunFolder(str(run_dir))
        metrics = Path(folder.metrics)
        if Path(folder.resolved_config).is_file():
            try:
                training = load_job_config(folder.resolved_config).training
            except ConfigError:
                training = None  # the folder's config no longer loads here: show what Slurm and the files say
            if training is not None:
                self.train_iters = training.train.train_iters
                if training.logger.metrics_file:
                    metrics = Path(training.logger.metrics_file)
        self._metrics = MetricsTail(metrics)

    def poll(self) -> LiveStatus:
        runs = job_runs(self.job_id)
        state = runs[-1].state if runs else "UNKNOWN"
        status = LiveStatus(job_id=self.job_id, state=state, restarts=max(0, len(runs) - 1),
                            train_iters=self.train_iters, reason=runs[-1].reason if runs else "",
                            finished=job_finished(state))
        self._metrics.poll()
        add_training_figures(status, list(self._metrics.records))
        if state == "RUNNING":
            times = job_times(self.job_id)
            if times is not None:
                status.allocation_left_s = max(0.0, times.end - time.time())
        return status


def watch(run_dir: Path, job_id: str, style: str, stream: TextIO = sys.stdout) -> LiveStatus:
    """Show the job live until Slurm is done with it (a requeue is not done); return the last status."""
    reader = LiveReader(run_dir, job_id)
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
