"""Every file and folder of a run folder, named once.

Three kinds of process read and write a run folder: ``bridge-submit`` on the login node, the batch
script, and the ranks. Each name below is the only spelling of that file in the project: Python code
imports it and the templates receive it from the render context. Stdlib only, importable everywhere.

Layout (``RUN`` = ``[job] run_dir``; the checkpoint folder is ``[checkpoint] save``, by default
``RUN/checkpoints``; ``resolved.toml`` holds every path absolute, so readers look paths up there
instead of resolving them again)::

    RUN/job.sbatch              the rendered script, as submitted
    RUN/resolved.toml           the job config with profiles, overrides and absolute paths applied
    RUN/jobs.jsonl              one JSON line per submission
    RUN/metrics.jsonl           one JSON line per training step (rank 0)
    RUN/tensorboard/            TensorBoard event files, one per run of the job (last rank; ``[logger] tensorboard_dir``)
    RUN/dataset_cache/          megatron-core's dataset index cache (``[dataset] path_to_cache``; rank 0 builds)
    RUN/logger_runs.json        the W&B run id, MLflow run id and Comet experiment key every run of the job continues
    RUN/wandb/                  W&B's files (``[logger] wandb_save_dir``; offline runs: wandb/offline-run-*)
    RUN/mlruns/                 the MLflow file store (unless ``[logger] mlflow_tracking_uri``)
    RUN/comet/                  Comet's offline archives (without an API key)
    RUN/logs/<job>_0_log.out    Slurm's stdout / stderr (submitit's names, so submitit finds them)
    RUN/logs/requeue-request.<job>            rank 0 asks the batch script to requeue (requeue.py)
    RUN/logs/.failures-without-progress.<job> the batch script's crash-loop counter
    CKPT/latest_checkpointed_iteration.txt    the checkpoint tracker (Megatron's name)
    CKPT/progress.txt           Megatron's progress log plus bridge_hpc's goodput events
    CKPT/ft_state.json          computed fault-tolerance timeouts
    CKPT/ft_progress_mark       time of the last finished step (in-job restart accounting)
    CKPT/.lock                  held by rank 0 while a job trains into this folder
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

JOB_SCRIPT = "job.sbatch"
RESOLVED_CONFIG = "resolved.toml"
JOBS_LOG = "jobs.jsonl"
METRICS_FILE = "metrics.jsonl"
#: ``[logger] tensorboard_dir`` unless the job sets it ("" turns TensorBoard off); ``tensorboard --logdir runs/``
#: then shows every run folder under ``runs/``.
TENSORBOARD_DIR = "tensorboard"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
DATASET_CACHE_DIR = "dataset_cache"
#: Written last into a checkpoint folder (format 2): every other file of the folder with its size.
#: Its presence marks the folder complete; the sizes let a load find a truncated or missing file
#: before any rank reads it. (Read without torch too: a PEFT run's base digest is taken from it.)
CHECKPOINT_MANIFEST_FILE = "manifest.json"
#: In each checkpoint folder, the configuration the run that saved it had (rank 0); the loader reads the
#: optimizer layout from it, bridge-submit the model a pretrained base was written with.
CHECKPOINT_RUN_CONFIG_FILE = "run_config.json"
#: The W&B, MLflow and Comet runs a job continues across requeues and restarts (the last rank writes it,
#: :mod:`bridge_hpc.training.utils.log_backends`); beside it their files, unless the job sets a place.
LOGGER_RUNS_FILE = "logger_runs.json"
WANDB_DIR = "wandb"
MLFLOW_DIR = "mlruns"
COMET_DIR = "comet"

REQUEUE_REQUEST_PREFIX = "requeue-request."
FAILURES_PREFIX = ".failures-without-progress."

TRACKER_FILE = "latest_checkpointed_iteration.txt"
PROGRESS_FILE = "progress.txt"
FT_STATE_FILE = "ft_state.json"
FT_PROGRESS_MARK = "ft_progress_mark"
CHECKPOINT_LOCK = ".lock"

#: Slurm's output pattern without its suffix: submitit's ``%j_%t_log`` (task 0 of the batch step).
LOG_STEM = "{job}_0_log"
#: What a folder holding Slurm's log files may not contain: sbatch reads ``%`` (``%j`` is the job id)
#: and ``\`` (which turns every pattern off, and is dropped) in ``--output``/``--error`` as patterns, so
#: the logs would land elsewhere than the folder named.
LOG_PATTERN_CHARS = re.compile(r"[%\\]")
#: ``%j`` for a job, ``%A_%a`` for an array task (Slurm's own patterns).
JOB_PATTERN = "%j"
ARRAY_JOB_PATTERN = "%A_%a"


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder. ``checkpoint_dir`` is ``[checkpoint] save`` when the job sets it."""

    root: str
    checkpoint_dir_override: Optional[str] = None

    def _at(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def job_script(self) -> str:
        return self._at(JOB_SCRIPT)

    @property
    def resolved_config(self) -> str:
        return self._at(RESOLVED_CONFIG)

    @property
    def jobs_log(self) -> str:
        return self._at(JOBS_LOG)

    @property
    def metrics(self) -> str:
        return self._at(METRICS_FILE)

    @property
    def tensorboard(self) -> str:
        """The default ``[logger] tensorboard_dir``; resolved.toml records where a job put it."""
        return self._at(TENSORBOARD_DIR)

    @property
    def logs(self) -> str:
        return self._at(LOGS_DIR)

    @property
    def dataset_cache(self) -> str:
        return self._at(DATASET_CACHE_DIR)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint_dir_override or self._at(CHECKPOINTS_DIR)

    def log_pattern(self, array: bool = False) -> str:
        """The ``#SBATCH --output`` pattern without ``.out``/``.err``."""
        return os.path.join(self.logs, LOG_STEM.format(job=ARRAY_JOB_PATTERN if array else JOB_PATTERN))

    def stdout(self, job_id: str) -> str:
        return os.path.join(self.logs, LOG_STEM.format(job=job_id) + ".out")

    def stderr(self, job_id: str) -> str:
        return os.path.join(self.logs, LOG_STEM.format(job=job_id) + ".err")

    def requeue_request(self, job_id: str) -> str:
        return os.path.join(self.logs, REQUEUE_REQUEST_PREFIX + job_id)

    def failures_without_progress(self, job_id: str) -> str:
        return os.path.join(self.logs, FAILURES_PREFIX + job_id)

    def tracker(self) -> str:
        return checkpoint_file(self.checkpoint_dir, TRACKER_FILE)

    def progress_log(self) -> str:
        return checkpoint_file(self.checkpoint_dir, PROGRESS_FILE)


#: The name of one complete checkpoint's folder (Megatron's), and its pattern.
ITERATION_DIR = "iter_{:07d}"
ITERATION_DIR_RE = re.compile(r"^iter_(\d{7})$")


def iteration_dir(checkpoint_dir: str, iteration: int) -> str:
    """The folder of one complete checkpoint: ``iter_0000020``."""
    return os.path.join(checkpoint_dir, ITERATION_DIR.format(iteration))


def checkpoint_file(checkpoint_dir: str, name: str) -> str:
    """A file of the checkpoint folder (``TRACKER_FILE``, ``PROGRESS_FILE``, ``FT_STATE_FILE``, ...)."""
    return os.path.join(checkpoint_dir, name)


def read_tracker(checkpoint_dir: str) -> Tuple[Optional[int], Optional[str]]:
    """The iteration the checkpoint folder's tracker (:data:`TRACKER_FILE`) names, as ``(iteration,
    None)``, or ``(None, why it cannot be used)``: missing, unreadable, or not an iteration. The one
    reader of the file: the ranks' load order, the read-ahead, the benchmarks and the tests use it."""
    path = checkpoint_file(checkpoint_dir, TRACKER_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None, f"{TRACKER_FILE} is missing"
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{TRACKER_FILE} is unreadable ({err})"
    try:
        return int(text), None
    except ValueError:
        return None, f"{TRACKER_FILE} holds {text[:40]!r}, not an iteration"


def tracked_iteration(checkpoint_dir: str) -> Optional[int]:
    """:func:`read_tracker`'s iteration; None when the tracker cannot be used."""
    return read_tracker(checkpoint_dir)[0]
