"""Per-step metrics: ``metrics.jsonl`` on rank 0; TensorBoard, W&B, MLflow and Comet on the last rank.

The JSON-lines file is the run's record of truth: one object per step with the loss at full float
precision (``json`` writes Python floats round-trip exactly), so two runs can be compared bit for
bit. Resuming appends; records past the step a run resumed from (written by an attempt that died
before its next checkpoint) are dropped first, so the file always reads as one trajectory.

TensorBoard gets the same trajectory without rewriting anything. Every run of a job (a requeue, an
in-job restart) writes its own event file, and its writer is opened with ``purge_step`` = the first
step the run trains: the file then starts with a ``SessionLog.START`` event at that step, after which
TensorBoard's Python reader (``EventAccumulator``, ``--load_fast=false``) discards every earlier
file's events at that step or later. The Rust data server (``--load_fast=true``, the default where
installed) ignores that event but drops a time series' points from a step on when a point for that
step or an earlier one arrives; every per-step scalar is written again from the first step on, and
the once-per-run scalars (:data:`RUN_START_TAGS`) are written *at* that step, so both readers show
each step once, from the run that kept it. Events are flushed to the file at every checkpoint save, so
a run killed without warning leaves every event up to the checkpoint its successor resumes from (the
flush is no fsync: a crash of the node itself can still lose what its page cache held).

Tag names are Megatron's where Megatron logs the same quantity (``lm loss``, ``learning-rate``,
``grad-norm``, ``iteration-time``, ``save-checkpoint-time``, ...), Megatron Bridge's for throughput
(``throughput/tokens_per_sec``); the goodput events Megatron has no tag for are under ``goodput/``.
A step's scalars are one event (see :meth:`MetricsLogger._add`).

W&B, MLflow and Comet (``[logger]`` ``wandb_project``, ``mlflow_experiment``, ``comet_project``) get the same
scalars under the same tags at the same steps, through
:class:`~bridge_hpc.training.utils.log_backends.LogBackends`: a step goes out once its checkpoint is saved
(:meth:`MetricsLogger.log_checkpoint_saved`), so that no backend sees a step twice however often the job is
requeued (that module says why and how).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.metrics_file import STEP, VALIDATION_LOSS

#: metrics.jsonl key -> TensorBoard tag. Other keys (further losses of the loss function) keep their name;
#: so do the reports of ``train_utils.training_log`` on log steps, whose keys are Megatron Bridge's tags
#: (``memory/...``, ``throughput/...``, ``time/...``, ``l2_norm/grad/...``). Where the throughput report's
#: rolling ``throughput/tokens_per_sec`` is in a record it comes after ``tokens_per_s`` and is the value written.
TENSORBOARD_TAGS = {
    "params_norm": "params-norm",
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "tokens_per_s": "throughput/tokens_per_sec",
    "step_time_s": "iteration-time",
    "consumed_samples": "samples vs steps",
    "skipped": "skipped-iterations",
    "num_zeros_in_grad": "num-zeros",
    "decoupled_lr": "decoupled-learning-rate",
    "loss_scale": "loss-scale",
    "world_size": "world-size",
    "device_memory_used_gb": "mem-device-memory-used-gb",
    "batch_size": "batch-size",
    "skipped_train_samples": "skipped-train-samples",
    "max_attention_logit": "max-attention-logit",
}
#: Seconds one checkpoint save blocked training, at the saved step (Megatron's ``save-checkpoint`` timer).
SAVE_TAG = "save-checkpoint-time"
#: Once per run, at the first step the run trains (resume step + 1): seconds its checkpoint load took,
#: its restart count (0 for the job's first run; requeues and in-job restarts both count), the steps
#: earlier runs had trained past the checkpoint it resumed from (redone now), and seconds from its process
#: start to the end of that first step (launch, imports, rendezvous, model build, load, first step).
LOAD_TAG = "load-checkpoint-time"
RESTARTS_TAG = "goodput/restarts"
LOST_STEPS_TAG = "goodput/lost-steps"
STARTUP_TAG = "goodput/start-up-time"
RUN_START_TAGS = (LOAD_TAG, RESTARTS_TAG, LOST_STEPS_TAG, STARTUP_TAG)


def tensorboard_scalars(record: Dict[str, Any]) -> Dict[str, Any]:
    """A step record's numbers under their TensorBoard tags (:data:`TENSORBOARD_TAGS`, other keys as they
    are): what TensorBoard and the log backends get of it (not the step, an evaluation's loss, None or a flag)."""
    return {TENSORBOARD_TAGS.get(key, key): value for key, value in record.items()
            if key not in (STEP, VALIDATION_LOSS) and value is not None and not isinstance(value, bool)}


@dataclass
class RunStart:
    """What a run knows about itself when it starts training (each rank fills it locally).

    ``restart_count``: rank 0's counts (it reads the progress log, see ``pretrain.run_restart_count``);
    ``load_s``: the checkpoint load, None when nothing was loaded; ``started_at``: epoch seconds of the
    process start, or of the attempt's start for an in-process restart.
    """

    restart_count: int
    load_s: Optional[float]
    started_at: float


class MetricsLogger:
    """Writes each step's record to metrics.jsonl (rank 0) and TensorBoard and the log backends (the last rank).

    ``tensorboard_dir`` None or "" turns TensorBoard off. Per step, the TensorBoard rank only queues
    scalars, and only every ``tensorboard_log_interval`` steps: SummaryWriter's own thread writes them.
    ``backends``: the job's W&B / MLflow / Comet (a :class:`~bridge_hpc.training.utils.log_backends.LogBackends`,
    given on every rank; only the last rank opens it), None when all are off. ``tensorboard_queue_size``
    (``logger.tensorboard_queue_size``): events the writer holds before it writes them.
    """

    def __init__(self, path: Optional[str], rank: int, world_size: int, tensorboard_dir: Optional[str],
                 tensorboard_log_interval: int = 1, backends: Any = None, tensorboard_queue_size: int = 1000):
        self.path = path if rank == 0 else None
        self._rank, self._world_size = rank, world_size
        self._tensorboard_dir = tensorboard_dir or None
        self._tb_interval = tensorboard_log_interval
        self._queue_size = tensorboard_queue_size
        self._file = None
        #: The SummaryWriter (last rank, TensorBoard on, after :meth:`open`), else None.
        self.writer = None
        self._remote_configured = backends is not None
        #: The log backends (last rank, some on, after :meth:`open`), else None.
        self.backends = None
        self._backends_given = backends if rank == world_size - 1 else None
        self._startup_from: Optional[float] = None  # set until the run's first step is logged
        self._validation: Optional[tuple] = None  # (step, loss) of an evaluation, for that step's record

    @property
    def _writes_tensorboard(self) -> bool:
        return self._tensorboard_dir is not None and self._rank == self._world_size - 1

    @property
    def _scalars_on(self) -> bool:
        """This rank writes scalars somewhere: TensorBoard or a log backend."""
        return self.writer is not None or self.backends is not None

    def open(self, resume_step: int, run: RunStart) -> None:
        """Start this run's records after the checkpoint load (at ``resume_step``). Collective while
        TensorBoard is on and there are several ranks: every rank calls it once.

        Rank 0 drops metrics.jsonl records newer than ``resume_step`` and tells the TensorBoard rank
        how many there were and its restart count (one broadcast); the TensorBoard rank opens a new
        event file that purges earlier files from ``resume_step + 1`` on and records :class:`RunStart`.
        """
        lost_steps: Optional[int] = None
        if self.path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            lost_steps = _truncate_after(self.path, resume_step)
            self._file = open(self.path, "a", encoding="utf-8")
        if self._tensorboard_dir is None and not self._remote_configured:
            return
        restart_count = run.restart_count
        if self._world_size > 1:
            lost_steps, restart_count = _from_rank0((lost_steps, restart_count))
        first = resume_step + 1
        values = {RESTARTS_TAG: restart_count, LOAD_TAG: run.load_s, LOST_STEPS_TAG: lost_steps}
        values = {tag: value for tag, value in values.items() if value is not None}
        if self._backends_given is not None:
            self.backends = self._backends_given
            self.backends.open(resume_step, restart_count)
            self.backends.add(first, values)
            self._startup_from = run.started_at
        if not self._writes_tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # on by default: say how to get it, or how to turn it off
            raise ConfigError(f"TensorBoard is on ({self._tensorboard_dir}) but cannot be imported here ({err}); "
                              'install it (pip install tensorboard) or set logger.tensorboard_dir = ""',
                              key="logger.tensorboard_dir") from None
        self.writer = SummaryWriter(log_dir=self._tensorboard_dir, purge_step=first, max_queue=self._queue_size)
        self._add(values, first)
        self._startup_from = run.started_at

    def log(self, record: Dict[str, Any]) -> None:
        """One finished step (``record["step"]``): every key to metrics.jsonl, numbers to TensorBoard.

        An evaluation of the same step (:meth:`validation`) joins the record as :data:`VALIDATION_LOSS`:
        one record per step, so readers that key records by step see the step once."""
        if self._validation is not None and self._validation[0] == record[STEP]:
            record = {**record, VALIDATION_LOSS: self._validation[1]}
            self._validation = None
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if not self._scalars_on:
            return
        step = record[STEP]
        if self._startup_from is not None:
            self._scalars({STARTUP_TAG: time.time() - self._startup_from}, step)
            self._startup_from = None
        if step % self._tb_interval == 0:
            self._scalars(tensorboard_scalars(record), step)
        if self.backends is not None:
            self.backends.step_done(step)

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        """Extra scalars (e.g. validation loss) for TensorBoard and the log backends (not metrics.jsonl)."""
        if self._scalars_on:
            self._scalars(values, step)

    def _scalars(self, values: Dict[str, float], step: int) -> None:
        """``values`` at ``step`` to TensorBoard and to the log backends (which send them once the step's
        checkpoint is saved)."""
        if self.writer is not None:
            self._add(values, step)
        if self.backends is not None:
            self.backends.add(step, values)

    def validation(self, step: int, values: Dict[str, float], perplexity: bool = False) -> None:
        """An evaluation at ``step`` (``{loss name: value}``): to TensorBoard now (``<name> validation``,
        Megatron's tags; with ``perplexity``, ``logger.log_validation_ppl_to_tensorboard``, also
        ``<name> validation ppl``, exp of the loss capped at exp(20) as Megatron caps it), and its
        ``lm loss`` (else its first loss) into metrics.jsonl's record of ``step``, which :meth:`log`
        writes next."""
        if values:
            self._validation = (step, values.get("lm loss", next(iter(values.values()))))
        scalars = {f"{key} validation": value for key, value in values.items()}
        if perplexity:
            scalars.update({f"{key} validation ppl": math.exp(min(20.0, value)) for key, value in values.items()})
        self.log_scalars(scalars, step)

    def log_checkpoint_saved(self, step: int, save_s: float) -> None:
        """A checkpoint of ``step`` was saved in ``save_s`` seconds. The event file is flushed: whatever
        happens to this run's process, its events up to the checkpoint are in the file for the run that resumes.
        The log backends get every step up to ``step`` now: no later run trains them again."""
        if self.writer is not None:
            self._add({SAVE_TAG: save_s}, step)
            self.writer.flush()
        if self.backends is not None:
            self.backends.add(step, {SAVE_TAG: save_s})
            self.backends.commit(step)

    def _add(self, values: Dict[str, float], step: int) -> None:
        """Queue ``values`` as one event of ``step``: the scalars ``add_scalar`` would write (legacy
        ``simple_value``, which both TensorBoard readers show), in one record instead of one per tag, which
        halves the time this takes in the loop and the records the writer thread appends."""
        from tensorboard.compat.proto.summary_pb2 import Summary  # imported by SummaryWriter already

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()])
        self.writer.file_writer.add_summary(summary, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.backends is not None:
            self.backends.close()
            self.backends = None


def _from_rank0(values: Any) -> Any:
    """Rank 0's ``values`` on every rank (one broadcast; the process group is up when a run opens)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return values
    box = [values]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _truncate_after(path: str, step: int) -> Optional[int]:
    """Atomically rewrite ``path`` without records whose step is > ``step`` (and without a torn last line).

    Returns how many steps were dropped (steps an earlier run trained past the checkpoint resumed from),
    or None when that cannot be known: no file, though the run resumes from a checkpoint."""
    if not os.path.exists(path):
        return 0 if step == 0 else None
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    dropped = set()
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get(STEP, 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            dropped.add(record[STEP])
    if len(kept) == len(lines) and all(line.endswith("\n") for line in lines):
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(dropped)


def read_metrics(path: str) -> Dict[int, Dict[str, Any]]:
    """step -> last record for that step (a reader's view of a metrics file)."""
    out: Dict[int, Dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                out[record[STEP]] = record
    return out
