"""Straggler detection (``[nvrx_straggler]``, Bridge's ``nvrx_straggler`` section).

Two backends behind one interface and one report shape:

* ``"nvrx"``: nvidia-resiliency-ext's ``straggler.Detector`` (CUPTI kernel timings), used when CUDA is
  available AND the installed package has the straggler module (``nvidia_resiliency_ext.straggler``
  up to 0.4, ``nvidia_resiliency_ext.attribution.straggler`` later; the same ``Detector`` API).
* ``"steptime"``: ours, for CPU and for packages without the module: every rank times its steps;
  every ``interval`` steps the ranks all_gather their recent mean step time (one small collective)
  and every rank computes the same report: relative score = fastest rank's mean / this rank's mean,
  individual score = the median of this rank's earlier means (its last
  :data:`INDIVIDUAL_BASELINE_REPORTS` reports) / its current mean, at most 1.0 (1.0 = no slower than
  usual). Not the best earlier mean: with short report windows the luckiest window would set the
  baseline, and every later report of a healthy rank would look slow against it. While some rank is
  slow relative to the rest, only such ranks are flagged by their individual scores too: the others
  got slower by waiting for them in collectives (gloo's waits cost process CPU time as well).
  ``interval`` comes from ``report_time_interval`` (seconds) divided by the measured step time,
  agreed by all ranks after ``warmup_steps`` steps (or is given directly).
  A rank counts as a straggler only once it has been below a threshold in
  :data:`STEPTIME_CONFIRM_REPORTS` consecutive reports: process CPU time on shared cores has
  one-window spikes (a page-cache write-back, a garbage collection, a logging thread), and stopping a
  job costs a requeue, while a real straggler stays slow. Below a threshold once, a rank is logged as
  suspected. The individual score also waits for :data:`STEPTIME_MIN_BASELINE_REPORTS` earlier
  reports: a median of one or two windows is no baseline.

Where the loop calls it::

    det = StragglerDetector(cfg.nvrx_straggler)     # None or enabled = false: every call is a no-op
    det.setup()                                     # after init_process_group (collective)
    while ...:
        det.step_start()                            # around the whole training step
        ...step...
        det.step_end()
        if det.check(iteration):                    # every rank, every iteration (collective on
            reason = "straggler"                    #   report iterations); True only with
            save checkpoint and leave the loop      #   stop_if_detected and a flagged rank,
                                                    #   the same answer on every rank
    det.shutdown()

``det.last_report`` (a :class:`StragglerReport`) holds the latest report on every rank
(with ``nvrx``: complete on rank 0 only, as nvrx gathers there). Its ``rank_to_node`` names Slurm
nodes (``SLURMD_NODENAME``), so ``flagged_nodes`` is what a requeue can exclude.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import logging
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Set

from bridge_hpc.training.config import NVRxStragglerDetectionConfig

logger = logging.getLogger("bridge_hpc.straggler")


@dataclass
class StragglerReport:
    """Scores are in (0, 1]: 0.5 = half as fast as the reference. Keys of ``stragglers`` follow
    nvidia-resiliency-ext's ``Report.identify_stragglers`` (sets of ranks here)."""

    iteration: int
    backend: str
    gpu_relative_perf_scores: Dict[int, float]
    gpu_individual_perf_scores: Dict[int, float]
    rank_to_node: Dict[int, str]
    mean_step_time_s: Dict[int, float] = field(default_factory=dict)  # steptime backend only
    stragglers: Dict[str, Set[int]] = field(default_factory=dict)
    suspected_ranks: List[int] = field(default_factory=list)  # steptime: below a threshold, not yet confirmed

    @property
    def flagged_ranks(self) -> List[int]:
        """Ranks below either threshold."""
        out: Set[int] = set()
        for ranks in self.stragglers.values():
            out |= set(ranks)
        return sorted(out)

    @property
    def flagged_nodes(self) -> List[str]:
        """The nodes of :attr:`flagged_ranks` (what a requeue should avoid)."""
        return sorted({self.rank_to_node[r] for r in self.flagged_ranks if r in self.rank_to_node})

    def to_dict(self) -> Dict[str, Any]:
        return {
            "iteration": self.iteration, "backend": self.backend,
            "gpu_relative_perf_scores": self.gpu_relative_perf_scores,
            "gpu_individual_perf_scores": self.gpu_individual_perf_scores,
            "rank_to_node": self.rank_to_node, "mean_step_time_s": self.mean_step_time_s,
            "stragglers": {k: sorted(v) for k, v in self.stragglers.items()},
            "flagged_ranks": self.flagged_ranks, "suspected_ranks": self.suspected_ranks,
        }


#: How many earlier reports the steptime backend's individual score takes its median over.
INDIVIDUAL_BASELINE_REPORTS = 64

#: Consecutive reports below a threshold before the steptime backend flags a rank (see the module doc).
STEPTIME_CONFIRM_REPORTS = 2

#: Earlier reports the steptime backend's individual score needs before it can fall below 1.0.
STEPTIME_MIN_BASELINE_REPORTS = 3

#: Where nvidia-resiliency-ext keeps its straggler detector, newest layout first.
NVRX_STRAGGLER_MODULES = ("nvidia_resiliency_ext.attribution.straggler", "nvidia_resiliency_ext.straggler")


def nvrx_straggler_module():
    """The installed package's straggler module (``Detector``, ``Report``), or None."""
    for name in NVRX_STRAGGLER_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return importlib.import_module(name)
        except (ImportError, ValueError):  # a parent package missing, the CUPTI extension failing to load
            continue
    return None


def nvrx_straggler_available() -> bool:
    """CUDA present and the installed nvidia-resiliency-ext has a straggler ``Detector``."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    return nvrx_straggler_module() is not None


def node_name() -> str:
    """This process's Slurm node name (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class StragglerDetector:
    """See the module docstring. ``backend``: ``"auto"`` (nvrx where available, else steptime),
    ``"nvrx"`` or ``"steptime"``. ``interval_steps`` fixes the steptime report interval (tests).

    What the steptime backend times is what :meth:`step_start`/:meth:`step_end` bracket. A rank that
    waits in a collective for a straggler is as slow, by the wall clock, as the straggler; so bracket
    the rank's own compute (forward/backward before the gradient all-reduce), or, with torch DDP
    (whose all-reduce runs inside backward), bracket the whole step with ``clock="process"``: process
    CPU time leaves out the time blocked in gloo/NCCL waits (it then finds ranks whose compute costs
    more CPU time, e.g. a slower or throttled CPU, but not ranks slowed by other processes).
    """

    def __init__(
        self,
        cfg: Optional[NVRxStragglerDetectionConfig],
        *,
        backend: str = "auto",
        interval_steps: Optional[int] = None,
        warmup_steps: int = 5,
        group: Any = None,
        clock: str = "wall",
    ) -> None:
        if clock not in ("wall", "process"):
            raise ValueError("clock must be 'wall' or 'process'")
        cfg = cfg if cfg is not None else NVRxStragglerDetectionConfig()  # no section: its defaults, off
        self.cfg = cfg
        self._clock = time.perf_counter if clock == "wall" else time.process_time
        self.enabled = cfg.enabled
        self.requested_backend = backend
        self.backend: Optional[str] = None
        self.interval_steps = interval_steps
        self.warmup_steps = max(1, int(warmup_steps))
        self.group = group
        self.last_report: Optional[StragglerReport] = None
        self.stop_requested = False
        self._rank = 0
        self._world = 1
        self._t0: Optional[float] = None
        self._sum = 0.0
        self._count = 0
        self._steps = 0
        self._next_check: Optional[int] = None
        self._earlier_means: Deque[float] = collections.deque(maxlen=INDIVIDUAL_BASELINE_REPORTS)
        self._below: Dict[str, Dict[int, int]] = {}  # steptime: consecutive reports below each threshold
        self._rank_to_node: Dict[int, str] = {}
        self._section = None  # nvrx: the open detection_section context
        self._device = "cpu"
        self._nvrx = None  # nvrx: the package's straggler module

    # -- set-up ------------------------------------------------------------------------------------

    def setup(self) -> None:
        if not self.enabled:
            return
        import torch.distributed as dist

        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        backend = self.requested_backend
        if backend == "auto":
            backend = "nvrx" if nvrx_straggler_available() else "steptime"
        self.backend = backend
        if backend == "nvrx":
            straggler = self._nvrx = nvrx_straggler_module()
            if straggler is None:
                raise RuntimeError("straggler detection: backend 'nvrx' asked for, but the installed "
                                   "nvidia-resiliency-ext has no straggler module")
            scores = []
            if self.cfg.calc_relative_gpu_perf:
                scores.append("relative_perf_scores")
            if self.cfg.calc_individual_gpu_perf:
                scores.append("individual_perf_scores")
            straggler.Detector.initialize(
                scores_to_compute=scores, gather_on_rank0=True,
                profiling_interval=self.cfg.profiling_interval,
                report_time_interval=self.cfg.report_time_interval,
            )
        else:
            if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
                import torch

                self._device = f"cuda:{torch.cuda.current_device()}"
            if self.interval_steps:
                self._next_check = int(self.interval_steps)
        # Which node each rank runs on, by Slurm's node name (what a requeue can exclude; several
        # slurmd may share one host name), for both backends.
        me = node_name()
        if dist.is_initialized() and self._world > 1:
            names: List[Optional[str]] = [None] * self._world
            dist.all_gather_object(names, me, group=self.group)
            self._rank_to_node = {r: str(n) for r, n in enumerate(names)}
        else:
            self._rank_to_node = {0: me}
        logger.info("straggler detection: %s backend on rank %d", backend, self._rank)

    # -- per step ----------------------------------------------------------------------------------

    def step_start(self) -> None:
        if self.backend == "steptime":
            self._t0 = self._clock()
        elif self.backend == "nvrx":
            straggler = self._nvrx

            self._section = straggler.Detector.detection_section("step", profile_cuda=True)
            self._section.__enter__()

    def step_end(self) -> None:
        if self.backend == "steptime":
            if self._t0 is not None:
                self._sum += self._clock() - self._t0
                self._count += 1
                self._t0 = None
        elif self.backend == "nvrx" and self._section is not None:
            section, self._section = self._section, None
            section.__exit__(None, None, None)

    def restart_window(self) -> None:
        """Start the current report window afresh (steptime backend), after a checkpoint save or load.

        The steps that follow a save run slower for a while on some ranks (the process's CPU time then
        includes the kernel's write-back of the pages just written and the collection of the save's
        garbage), unevenly across ranks; judged, that window flagged healthy ranks and requeued healthy
        jobs. Every rank calls this at the same step (saves are collective), so the report schedule
        stays the same on every rank; the window after the save is one report interval, as usual."""
        if self.backend == "steptime" and self._next_check is not None:
            self._sum, self._count = 0.0, 0
            self._next_check = self._steps + int(self.interval_steps)

    @contextlib.contextmanager
    def step(self):
        self.step_start()
        try:
            yield
        finally:
            self.step_end()

    def check(self, iteration: int) -> bool:
        """Every rank, every iteration, after :meth:`step_end`. Returns True (on every rank) when the
        loop should checkpoint and stop: ``stop_if_detected`` and a report that flagged a rank."""
        if self.backend is None:
            return False
        self._steps += 1
        report = self._check_nvrx(iteration) if self.backend == "nvrx" else self._check_steptime(iteration)
        if report is None:
            return False
        self.last_report = report
        if self.cfg.enable_logging and self._rank == 0:
            self._log(report)
        stop = bool(self.cfg.stop_if_detected and report.flagged_ranks)
        if self.backend == "nvrx":  # the report is complete on rank 0 only: agree on the answer
            stop = self._broadcast_flag(stop)
        self.stop_requested = stop
        return stop

    def shutdown(self) -> None:
        if self.backend == "nvrx":
            straggler = self._nvrx

            straggler.Detector.shutdown()
        self.backend = None

    # -- steptime backend --------------------------------------------------------------------------

    def _check_steptime(self, iteration: int) -> Optional[StragglerReport]:
        if self._next_check is None:
            if self._steps < self.warmup_steps:
                return None
            # agree on the interval: report_time_interval / slowest mean step time
            mean = self._sum / max(1, self._count)
            slowest = self._all_reduce_max(mean)
            interval = self.cfg.report_time_interval
            self.interval_steps = max(1, int(round(interval / max(slowest, 1e-6))))
            self._next_check = self._steps + self.interval_steps
            if self._rank == 0:  # a run shorter than the interval gets no report: the log says what to expect
                logger.info("straggler detection: a report every %d steps (report_time_interval %.3g s over the "
                            "slowest rank's mean step of %.4f s, timed over the first %d steps)",
                            self.interval_steps, interval, slowest, self._steps)
            self._sum, self._count = 0.0, 0  # warm-up steps (compilation, caches) do not count
            return None
        if self._steps < self._next_check:
            return None
        self._next_check = self._steps + int(self.interval_steps)
        mean = self._sum / max(1, self._count)
        self._sum, self._count = 0.0, 0
        means = self._all_gather(mean)
        fastest = min(means)
        rel = {r: (fastest / m if m > 0 else 1.0) for r, m in enumerate(means)}
        if len(self._earlier_means) >= STEPTIME_MIN_BASELINE_REPORTS and mean > 0:
            indiv_mine = min(1.0, statistics.median(self._earlier_means) / mean)
        else:
            indiv_mine = 1.0
        self._earlier_means.append(mean)
        indiv = dict(enumerate(self._all_gather(indiv_mine)))
        rel_thr = self.cfg.gpu_relative_perf_threshold
        ind_thr = self.cfg.gpu_individual_perf_threshold
        slow_relative = {r for r, s in rel.items() if s < rel_thr}
        slow_individual = {r for r, s in indiv.items() if s < ind_thr}
        if slow_relative:  # the others' slow-down is their wait for these ranks (see the module doc)
            slow_individual &= slow_relative
        # every rank holds the same gathered values, so every rank confirms the same ranks
        confirmed = {"straggler_gpus_relative": self._confirm("relative", slow_relative),
                     "straggler_gpus_individual": self._confirm("individual", slow_individual)}
        stragglers: Dict[str, Set[int]] = {}
        if self.cfg.calc_relative_gpu_perf:
            stragglers["straggler_gpus_relative"] = confirmed["straggler_gpus_relative"]
        if self.cfg.calc_individual_gpu_perf:
            stragglers["straggler_gpus_individual"] = confirmed["straggler_gpus_individual"]
        flagged = set().union(*stragglers.values()) if stragglers else set()
        suspected = set()
        if self.cfg.calc_relative_gpu_perf:
            suspected |= slow_relative
        if self.cfg.calc_individual_gpu_perf:
            suspected |= slow_individual
        return StragglerReport(
            iteration=iteration, backend="steptime",
            gpu_relative_perf_scores=rel if self.cfg.calc_relative_gpu_perf else {},
            gpu_individual_perf_scores=indiv if self.cfg.calc_individual_gpu_perf else {},
            rank_to_node=dict(self._rank_to_node), mean_step_time_s=dict(enumerate(means)),
            stragglers=stragglers, suspected_ranks=sorted(suspected - flagged),
        )

    def _confirm(self, kind: str, below: Set[int]) -> Set[int]:
        """Count this report in each rank's run of reports below ``kind``'s threshold; the ranks whose
        run has reached :data:`STEPTIME_CONFIRM_REPORTS`."""
        runs = self._below.setdefault(kind, {})
        for rank in list(runs):
            if rank not in below:
                del runs[rank]
        for rank in below:
            runs[rank] = runs.get(rank, 0) + 1
        return {rank for rank, n in runs.items() if n >= STEPTIME_CONFIRM_REPORTS}

    def _all_gather(self, value: float) -> List[float]:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or self._world == 1:
            return [float(value)]
        mine = torch.tensor([float(value)], dtype=torch.float64, device=self._device)
        out = [torch.zeros_like(mine) for _ in range(self._world)]
        dist.all_gather(out, mine, group=self.group)
        return [float(t.item()) for t in out]

    def _all_reduce_max(self, value: float) -> float:
        return max(self._all_gather(value))

    # -- nvrx backend ------------------------------------------------------------------------------

    def _check_nvrx(self, iteration: int) -> Optional[StragglerReport]:
        straggler = self._nvrx

        report = straggler.Detector.generate_report_if_interval_elapsed()
        # The package agrees on "interval elapsed" across ranks, but with gather_on_rank0 only rank 0
        # gets a report: ask the shared flag, so every rank goes on to _broadcast_flag together.
        if not straggler.Detector.is_interval_elapsed():
            return None
        if self._rank != 0 or report is None:  # other ranks: an empty report
            return StragglerReport(iteration, "nvrx", {}, {}, {})
        found = report.identify_stragglers(
            gpu_rel_threshold=self.cfg.gpu_relative_perf_threshold,
            gpu_indiv_threshold=self.cfg.gpu_individual_perf_threshold,
        )
        return StragglerReport(
            iteration=iteration, backend="nvrx",
            gpu_relative_perf_scores=dict(report.gpu_relative_perf_scores),
            gpu_individual_perf_scores=dict(report.gpu_individual_perf_scores),
            rank_to_node=dict(self._rank_to_node) or dict(report.rank_to_node),
            stragglers={
                "straggler_gpus_relative": {s.rank for s in found.get("straggler_gpus_relative", ())},
                "straggler_gpus_individual": {s.rank for s in found.get("straggler_gpus_individual", ())},
            },
        )

    def _broadcast_flag(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or self._world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=f"cuda:{torch.cuda.current_device()}")
        dist.broadcast(t, 0, group=self.group)
        return bool(t.item())

    # -- logging -----------------------------------------------------------------------------------

    def _log(self, report: StragglerReport) -> None:
        n = self.cfg.num_gpu_perf_scores_to_print
        for name, scores in (("relative", report.gpu_relative_perf_scores),
                             ("individual", report.gpu_individual_perf_scores)):
            if not scores or n <= 0:
                continue
            ordered = sorted(scores.items(), key=lambda kv: kv[1])
            worst = ", ".join(f"rank {r}: {s:.2f}" for r, s in ordered[:n])
            best = ", ".join(f"rank {r}: {s:.2f}" for r, s in ordered[-n:][::-1])
            logger.info("straggler report @%d (%s) %s perf scores: worst [%s] best [%s]",
                        report.iteration, report.backend, name, worst, best)
        if report.suspected_ranks:
            logger.info("straggler report @%d: ranks %s below a threshold, flagged if the next report agrees",
                        report.iteration, report.suspected_ranks)
        if report.flagged_ranks:
            nodes = {r: report.rank_to_node.get(r, "?") for r in report.flagged_ranks}
            logger.warning("straggler report @%d: flagged ranks %s (nodes %s)",
                           report.iteration, report.flagged_ranks, nodes)
