"""Where the readers of a run folder (``bridge-report``, ``bridge-status``) find its files, and what else
they take from its resolved.toml (the steps to train, the device asked of Slurm).

The folder named on the command line is the truth. ``resolved.toml`` records every path absolute, under
the ``job.run_dir`` the job was submitted with; a run folder that was moved or copied since still
records the old place, where another run's files may lie (or none). So every path it records under
its ``job.run_dir`` is *re-rooted*: read at the same place under the folder named
(``/old/run/checkpoints`` -> ``/new/run/checkpoints``); :meth:`RunPaths.notes` says so in one line.
A path recorded outside the old run folder (a checkpoint folder on scratch) is read where it is.

resolved.toml is read as TOML, not loaded as a job config: the paths need no validation, and a file
that no longer loads (a newer version's keys, a damaged file) must not hide the run's other files.
A resolved.toml that cannot be read at all is passed over, with a note: the default places remain.
Stdlib only (and ``toml`` before Python 3.11): login-node code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from bridge_hpc.contracts import run_folder, save_interval
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.report.goodput import CPU, GPU


def read_toml_text(text: str) -> Dict[str, Any]:
    """tomllib on Python >= 3.11, the ``toml`` package (an install requirement) before; ValueError
    (or RecursionError) when the text is not TOML."""
    try:
        import tomllib
    except ImportError:
        import toml

        return toml.loads(text)
    return tomllib.loads(text)


def same_folder(a: str, b: str) -> bool:
    """Whether two names mean one folder: the same absolute path, the same path once symbolic links are
    resolved, or the same directory on disk."""
    if os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b)):
        return True
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


@dataclass
class RunPaths:
    """The files of the run folder ``root`` as its resolved.toml places them, re-rooted to ``root``, and
    the few settings its readers need."""

    root: str
    #: resolved.toml as read; {} when there is none or it could not be read
    recorded: Dict[str, Any] = field(default_factory=dict)
    #: why resolved.toml was passed over (None: read, or there is none)
    problem: Optional[str] = None
    #: the ``job.run_dir`` resolved.toml records, where that is another folder than ``root``
    moved_from: Optional[str] = None

    @property
    def folder(self) -> RunFolder:
        return RunFolder(self.root)

    def reroot(self, path: str) -> str:
        """A path as resolved.toml records it, read under ``root``: one under the recorded
        ``job.run_dir`` moves with the folder; a relative one is taken from ``root``."""
        if not os.path.isabs(path):
            return os.path.join(self.root, path)
        if self.moved_from is None:
            return path
        relative = os.path.relpath(os.path.normpath(path), os.path.normpath(self.moved_from))
        if relative == os.curdir:
            return self.root
        if relative == os.pardir or relative.startswith(os.pardir + os.sep):
            return path  # recorded outside the run folder: read where it is
        return os.path.join(self.root, relative)

    def _recorded(self, section: str, key: str) -> Optional[str]:
        table = self.recorded.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        return self.reroot(value) if isinstance(value, str) and value.strip() else None

    @property
    def checkpoint_dir(self) -> str:
        """``[checkpoint] save``, else the run folder's default checkpoint folder."""
        return self._recorded("checkpoint", "save") or self.folder.checkpoint_dir

    @property
    def progress_log(self) -> str:
        return run_folder.checkpoint_file(self.checkpoint_dir, run_folder.PROGRESS_FILE)

    @property
    def metrics(self) -> str:
        """``[logger] metrics_file``, else the run folder's metrics.jsonl."""
        return self._recorded("logger", "metrics_file") or self.folder.metrics

    @property
    def log_progress(self) -> Optional[bool]:
        """``[logger] log_progress`` as resolved.toml sets it; None where it does not say."""
        table = self.recorded.get("logger")
        value = table.get("log_progress") if isinstance(table, dict) else None
        return value if isinstance(value, bool) else None

    @property
    def train_iters(self) -> Optional[int]:
        """``[train] train_iters``; None where resolved.toml does not record a number of steps."""
        table = self.recorded.get("train")
        value = table.get("train_iters") if isinstance(table, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def interval_prior(self) -> Tuple[Optional[float], str]:
        """The prior of ``save_interval = "auto"`` as the ranks take it: ``[cluster] node_mtbf_hours`` over
        ``[slurm] nodes`` in seconds, and its description; (None, "") where resolved.toml sets none."""
        cluster, slurm = self.recorded.get("cluster"), self.recorded.get("slurm")
        hours = cluster.get("node_mtbf_hours") if isinstance(cluster, dict) else None
        nodes = slurm.get("nodes", 1) if isinstance(slurm, dict) else 1
        if not isinstance(hours, (int, float)) or isinstance(hours, bool) or hours <= 0:
            return None, ""
        nodes = nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1
        return save_interval.prior_mtbf_s(hours, nodes), save_interval.prior_from(hours, nodes)

    @property
    def requested_device(self) -> Optional[str]:
        """"gpu" when the job asked Slurm for GPUs (``[slurm] gpus_per_node``, or a GPU option passed
        through ``[slurm] extra`` such as ``gres = "gpu:8"``), else "cpu" (ranks get what Slurm
        allocates); None without a readable resolved.toml."""
        if not self.recorded:
            return None
        slurm = self.recorded.get("slurm")
        slurm = slurm if isinstance(slurm, dict) else {}
        gpus = slurm.get("gpus_per_node", 0)
        if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0:
            return GPU
        extra = slurm.get("extra")
        asked = " ".join(f"{key}={value}" for key, value in extra.items()).lower() if isinstance(extra, dict) else ""
        return GPU if "gpu" in asked else CPU

    def outside(self) -> List[str]:
        """The files read that lie outside ``root``, as ``key path`` (a checkpoint folder on scratch)."""
        found = []
        for key, path in (("checkpoint.save", self.checkpoint_dir), ("logger.metrics_file", self.metrics)):
            relative = os.path.relpath(os.path.normpath(os.path.abspath(path)), os.path.abspath(self.root))
            if relative == os.pardir or relative.startswith(os.pardir + os.sep):
                found.append(f"{key} {path}")
        return found

    def notes(self) -> List[str]:
        """One line for each thing a reader should know: the folder was moved or copied (and its paths
        are read under ``root``), or its resolved.toml was passed over."""
        notes = []
        if self.problem:
            notes.append(f"{self.folder.resolved_config}: passed over ({self.problem}); the run folder's "
                         "default paths are read")
        if self.moved_from is not None:
            note = (f"{self.root}: its resolved.toml says the job ran in {self.moved_from}: this folder was moved "
                    f"or copied from there, and the paths recorded there are read under {self.root}")
            elsewhere = self.outside()
            if elsewhere:
                note += f"; outside it, {', '.join(elsewhere)} are read where they are"
            notes.append(note)
        return notes


def read_run_paths(root: str) -> RunPaths:
    """The paths of the run folder ``root`` (a folder that exists); never raises for a bad resolved.toml."""
    paths = RunPaths(root)
    resolved = paths.folder.resolved_config
    if not os.path.isfile(resolved):
        return paths
    try:
        with open(resolved, "rb") as f:
            data = f.read()
    except OSError as err:
        paths.problem = f"cannot read: {err.strerror or err}"
        return paths
    try:
        recorded = read_toml_text(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        paths.problem = f"not UTF-8 text at byte {err.start + 1}"
        return paths
    except (ValueError, RecursionError, TypeError) as err:  # tomllib's and toml's decode errors are ValueErrors
        paths.problem = f"not TOML: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        return paths
    paths.recorded = recorded
    job = recorded.get("job")
    run_dir = job.get("run_dir") if isinstance(job, dict) else None
    if isinstance(run_dir, str) and os.path.isabs(run_dir) and not same_folder(run_dir, root):
        paths.moved_from = run_dir
    return paths
