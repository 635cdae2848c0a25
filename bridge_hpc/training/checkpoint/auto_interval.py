"""``[checkpoint] save_interval = "auto"`` on the ranks: each run chooses its interval on start.

Rank 0 reads the run folder's history (``progress.txt``: save costs, unwarned interruptions, step
time) and applies the rule (:mod:`bridge_hpc.contracts.save_interval`, the one definition the report
and the benchmark use too), before its own ``Starting job`` line; every rank gets the interval from
rank 0 (one broadcast), so they save at the same steps. Where no earlier run timed a step, the run
times its first :data:`~bridge_hpc.contracts.save_interval.STEPS_TO_TIME` steps and decides then, at
the same step on every rank. Rank 0 logs one line (the interval, the two inputs and where each came
from) and the progress log gets a ``Save interval`` line, which ``bridge-report`` reads.

The chosen interval replaces ``cfg.checkpoint.save_interval`` for the run; ``save_interval_auto``
keeps the request, so an in-job restart chooses again. Nothing is saved in a checkpoint about it: a
run resumes bit-exactly whatever interval each allocation used.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional

import torch

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts import save_interval as rule
from bridge_hpc.training.engine.collectives import comm_device

logger = logging.getLogger(__name__)

#: ``checkpointing_context`` key of the run's :class:`AutoInterval`.
CONTEXT_KEY = "auto_save_interval"


def _from_rank_0(value: int) -> int:
    """Rank 0's ``value`` on every rank (one broadcast; the value itself without a process group)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=comm_device())
    torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


class AutoInterval:
    """One run's choice: made at its start (:func:`start`) or after its first timed steps (:meth:`after_step`)."""

    def __init__(self, cfg, rank: int, choice: Optional[rule.Choice]):
        self.cfg = cfg
        self.rank = rank
        self.choice = choice  # rank 0's; None on the other ranks
        self.pending = cfg.checkpoint.save_interval is None
        self._timed_from: Optional[float] = None

    @property
    def bounds(self):
        ck = self.cfg.checkpoint
        return ck.save_interval_min or 1, ck.save_interval_max

    def record(self, progress, iteration: int) -> None:
        """Rank 0: the progress log's ``Save interval`` line, once the interval is known."""
        if progress is not None and self.choice is not None and self.choice.interval is not None:
            progress.save_interval(self.choice.progress_fields(iteration))

    def after_step(self, step: int, run_start_step: int, progress) -> None:
        """Collective while pending: time the run's first steps, then decide at the same step everywhere."""
        if not self.pending:
            return
        if step == run_start_step + 1:  # the first step compiles and warms up: time the ones after it
            self._timed_from = time.monotonic()
            return
        if step < run_start_step + 1 + rule.STEPS_TO_TIME:
            return
        interval = 0
        if self.rank == 0 and self.choice is not None:
            if self._timed_from is not None:
                step_s = (time.monotonic() - self._timed_from) / rule.STEPS_TO_TIME
                self.choice = self.choice.with_step(step_s, f"this run's steps {run_start_step + 2}-{step}",
                                                    *self.bounds)
                interval = self.choice.interval or 0
        interval = _from_rank_0(interval)
        self.pending = False
        self.cfg.checkpoint.save_interval = interval or None
        if self.rank == 0 and self.choice is not None:
            logger.info(self.choice.describe())
            self.record(progress, step)


def start(cfg, rank: int) -> Optional[AutoInterval]:
    """On each run's start, on every rank (collective), before rank 0 writes its ``Starting job`` line:
    the interval from the history, where it can be chosen yet (None: not ``"auto"``)."""
    ck = cfg.checkpoint
    if not ck.save_interval_auto:
        return None
    choice = None
    interval = 0
    if rank == 0:
        history = rule.History()
        if ck.save and cfg.logger.log_progress:
            history = rule.read_history(run_folder.checkpoint_file(ck.save, run_folder.PROGRESS_FILE))
        prior = rule.prior_mtbf_s(ck.node_mtbf_hours, ck.nodes)
        source = rule.prior_from(ck.node_mtbf_hours, ck.nodes) if prior else ""
        choice = rule.choose(history, prior_mtbf_s=prior, prior_from=source, async_save=ck.async_save,
                             lo=ck.save_interval_min or 1, hi=ck.save_interval_max)
        interval = choice.interval or 0
    interval = _from_rank_0(interval)
    ck.save_interval = interval or None
    auto = AutoInterval(cfg, rank, choice)
    if rank == 0 and choice is not None:
        logger.info(choice.describe())
    return auto


def after_step(checkpointing_context: Dict[str, Any], state) -> None:
    """The loop's hook (every rank, every step): decide a pending interval."""
    auto = checkpointing_context.get(CONTEXT_KEY)
    if auto is not None:
        auto.after_step(state.train_state.step, state.run_start_step, state.progress)
