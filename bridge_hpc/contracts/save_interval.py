"""The checkpoint interval chosen for goodput (``[checkpoint] save_interval = "auto"``): the rule, the
run's history it reads from ``progress.txt``, and the interval that would have been best in hindsight.

Defined once, here, for every side: the ranks choose the interval with it on each start
(``bridge_hpc.training.checkpoint.auto_interval``), ``bridge-report`` shows the hindsight interval and
``bridge-status`` the job's ETA from the same history, and ``benchmarks/save_interval.py`` simulates
the same rule function. Stdlib only.

**The rule** (Young 1974, Daly 2006, first order): with ``C`` the seconds a save blocks training and
``M`` the mean time between *unwarned* interruptions (runs that end with no exit save: node failures,
out-of-memory kills, hangs, SIGKILL), the interval that minimises the time lost to saves plus the work
lost at interruptions is ``sqrt(2 C M)`` seconds, in steps ``sqrt(2 C M) / step seconds``, clipped to
the bounds. Warned preemptions are covered by the exit save and cost no steps: they do not count.

**The inputs**, each with where it came from:

- save cost: the median ``Save seconds`` of the last :data:`RECENT_SAVES` interval saves the progress
  log records (exit saves, the last save of a run with an ``Ending job`` line, are left out: they are
  synchronous and would overstate an asynchronous interval save; without ``async_save`` they are used
  when no interval save is recorded), else :data:`DEFAULT_SAVE_COST_S`. The log has 0.1 s resolution:
  a recorded ``0.0`` counts as :data:`SAVE_COST_FLOOR_S`.
- mean time between unwarned interruptions: allocated hours of every run so far (process start to
  its end) over the runs that trained and ended without an exit save (no ``Ending job`` line, or one
  with reason ``error`` or ``fault``), the prior -- ``[cluster] node_mtbf_hours`` over the job's
  nodes, else :data:`DEFAULT_MTBF_S` -- counted as one more interruption (:func:`mtbf_estimate`).
  From :data:`REFINE_AFTER` interruptions on, the interval is refined on the runs' own lost work
  (:func:`refine`).
- step seconds: training time between the first step and the saves of the runs so far over their
  steps, else measured by the run itself over its first steps.

The interval is a choice no resume depends on: a checkpoint is the same whatever step it is taken at,
and a run resumes bit-exactly whatever interval each allocation used.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from bridge_hpc.contracts.progress_log import (
    ENDING_JOB,
    FIRST_STEP,
    ITERATION,
    LOST_SECONDS,
    REASON,
    RESTART,
    SAVE_EVENTS,
    SAVE_INTERVAL,
    SAVE_SECONDS,
    SECONDS_SINCE_PROCESS_START,
    Run,
    read_progress,
)

#: ``[checkpoint] save_interval``'s value that asks for this rule.
AUTO = "auto"
#: Interval saves whose blocking seconds make the save cost (the median of these).
RECENT_SAVES = 5
#: The save cost before any save was recorded: a synchronous save of a few GB.
DEFAULT_SAVE_COST_S = 5.0
#: The progress log writes ``Save seconds`` to 0.1 s: a recorded 0.0 is below 0.05 s.
SAVE_COST_FLOOR_S = 0.05
#: The mean time between unwarned interruptions with neither history nor a ``[cluster]`` prior.
DEFAULT_MTBF_S = 24 * 3600.0
#: ``Ending job`` reasons that come without an exit save (a rank's failure; ft_launcher's restart).
UNWARNED_END_REASONS = ("error", "fault")
#: Unwarned interruptions from which the rule's interval is refined on the history's own lost work
#: (:func:`refine`); fewer would fit the luck of a few.
REFINE_AFTER = 20
#: The factors of the Young/Daly interval the refinement tries: 1/2 to 4, 8 per doubling.
REFINE_FACTORS = tuple(2 ** (k / 8) for k in range(-8, 17))
#: Steps a run times before it decides, where no earlier run measured the step time.
STEPS_TO_TIME = 3
#: The progress log's event recording an ``auto`` interval (one per decision) and its fields.
SAVE_INTERVAL_EVENT = SAVE_INTERVAL
INTERVAL = "Interval"
SAVE_COST = "Save cost"
SAVE_COST_FROM = "Save cost from"
MTBF_HOURS = "Unwarned MTBF hours"
MTBF_FROM = "MTBF from"
STEP_SECONDS = "Step seconds"


# --------------------------------------------------------------------------------------------------
# The rule


def young_daly_seconds(save_cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 C M)``: the seconds of training between saves that minimise save time plus lost work."""
    return math.sqrt(2.0 * max(save_cost_s, 0.0) * max(mtbf_s, 0.0))


def interval_steps(save_cost_s: float, mtbf_s: float, step_s: float, lo: int = 1, hi: Optional[int] = None) -> int:
    """The rule in steps, rounded, within ``[lo, hi]`` (``hi`` None: no upper bound)."""
    steps = max(1, round(young_daly_seconds(save_cost_s, mtbf_s) / max(step_s, 1e-9)))
    steps = max(steps, lo)
    return min(steps, hi) if hi is not None else steps


# --------------------------------------------------------------------------------------------------
# The history


@dataclass
class RunSpan:
    """One run (allocation, or attempt inside one) as the interval rule sees it."""

    start: float  # process start (epoch)
    end: float  # its end: the Ending job line, the fault before a Restart line, else its last line
    trained: bool  # it logged a first step
    first_step: Optional[float]  # when its first step was done
    unwarned: bool  # trained, and ended with no exit save
    reason: Optional[str] = None  # its Ending job reason (None: none recorded)
    interval: Optional[int] = None  # the interval it used, where an ``auto`` decision recorded it
    saves: List[Tuple[float, int]] = field(default_factory=list)  # (time, iteration) of its saves

    @property
    def duration_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def training_span_s(self) -> float:
        """First step to end: the time an interruption could cost work in."""
        return max(self.end - self.first_step, 0.0) if self.first_step is not None else 0.0


@dataclass
class History:
    """What the progress log says about a run folder's runs, for the rule."""

    runs: List[RunSpan] = field(default_factory=list)
    interval_save_costs: List[float] = field(default_factory=list)  # oldest first
    exit_save_costs: List[float] = field(default_factory=list)
    step_s: Optional[float] = None

    @property
    def allocated_s(self) -> float:
        return sum(r.duration_s for r in self.runs)

    @property
    def unwarned(self) -> int:
        return sum(1 for r in self.runs if r.unwarned)

    @property
    def queue_waits_s(self) -> List[float]:
        """Gaps between one run's end and the next one's start (requeues: the queue and Slurm's start)."""
        return [max(b.start - a.end, 0.0) for a, b in zip(self.runs, self.runs[1:])]


def step_samples(run: Run) -> Tuple[float, int]:
    """(training seconds, steps) between the first step and each save of a run, saves excluded.

    A save line is written after the save, so the interval before it holds the steps plus the save."""
    marks = run.of(FIRST_STEP, *SAVE_EVENTS)
    seconds, steps = 0.0, 0
    for before, after in zip(marks, marks[1:]):
        di = (after.number(ITERATION) or 0) - (before.number(ITERATION) or 0)
        dt = after.time - before.time - (after.number(SAVE_SECONDS) or 0.0)
        if di > 0 and dt > 0:
            seconds, steps = seconds + dt, steps + int(di)
    return seconds, steps


def run_end(run: Run) -> float:
    """A run's end: its ``Ending job`` line, the fault before its ``Restart`` line, else its last line."""
    ending, restart = run.last(ENDING_JOB), run.last(RESTART)
    if ending is not None:
        return ending.time
    if restart is not None:
        return restart.time - (restart.number(LOST_SECONDS) or 0.0)
    return max([run.start.time] + [e.time for e in run.events])


def history_of_runs(runs: Sequence[Run], last_run_live: bool = False) -> History:
    """The history of parsed runs. ``last_run_live``: the last run is still running (bridge-status), so its
    missing ``Ending job`` line is no interruption."""
    history = History()
    seconds, steps = 0.0, 0
    for i, run in enumerate(runs):
        first = run.last(FIRST_STEP)
        ending = run.last(ENDING_JOB)
        live = last_run_live and i == len(runs) - 1
        unwarned = first is not None and not live and (
            ending is None or ending.fields.get(REASON) in UNWARNED_END_REASONS)
        span = RunSpan(start=run.start.time - (run.start.number(SECONDS_SINCE_PROCESS_START) or 0.0),
                       end=run_end(run), trained=first is not None, first_step=first.time if first else None,
                       unwarned=unwarned, reason=ending.fields.get(REASON) if ending is not None else None)
        decided = run.last(SAVE_INTERVAL_EVENT)
        if decided is not None and decided.number(INTERVAL) is not None:
            span.interval = int(decided.number(INTERVAL))
        exit_iteration = ending.number(ITERATION) if ending is not None else None
        for event in run.of(*SAVE_EVENTS):
            cost = event.number(SAVE_SECONDS)
            iteration = event.number(ITERATION)
            if iteration is not None:
                span.saves.append((event.time, int(iteration)))
            if cost is None:
                continue
            cost = max(cost, SAVE_COST_FLOOR_S)
            if exit_iteration is not None and iteration == exit_iteration:
                history.exit_save_costs.append(cost)
            else:
                history.interval_save_costs.append(cost)
        history.runs.append(span)
        sec, n = step_samples(run)
        seconds, steps = seconds + sec, steps + n
    history.step_s = seconds / steps if steps else None
    return history


def read_history(progress_path: str, last_run_live: bool = False) -> History:
    """The history a progress log records (an empty one where there is no log yet)."""
    if not os.path.exists(progress_path):
        return History()
    return history_of_runs(read_progress(progress_path).runs, last_run_live)


# --------------------------------------------------------------------------------------------------
# The choice


@dataclass
class Choice:
    """An interval and what it came from (``interval`` None: the step time is not known yet)."""

    interval: Optional[int]
    save_cost_s: float
    save_cost_from: str
    mtbf_s: float
    mtbf_from: str
    step_s: Optional[float]
    step_from: str
    seconds: float  # the rule's interval in seconds, before rounding and bounds
    refined: str = ""  # how :func:`refine` moved it ("" where it did not run)

    def describe(self) -> str:
        """The one log line of a rank start."""
        steps = "not yet (timing the first steps)" if self.interval is None else f"{self.interval} steps"
        step = "unknown" if self.step_s is None else f"{self.step_s:.3g} s ({self.step_from})"
        return (f"checkpoint.save_interval = \"auto\": {steps} = sqrt(2 x save cost x unwarned MTBF)"
                f"{self.refined} = {self.seconds:.0f} s of training; save cost {self.save_cost_s:.3g} s ({self.save_cost_from}), "
                f"mean time between unwarned interruptions {format_hours(self.mtbf_s)} ({self.mtbf_from}), "
                f"step {step}")

    def with_step(self, step_s: float, source: str, lo: int = 1, hi: Optional[int] = None) -> "Choice":
        steps = max(1, round(self.seconds / max(step_s, 1e-9)))
        steps = min(max(steps, lo), hi) if hi is not None else max(steps, lo)
        return Choice(steps, self.save_cost_s, self.save_cost_from, self.mtbf_s, self.mtbf_from, step_s, source,
                      self.seconds, self.refined)

    def progress_fields(self, iteration: int) -> List[Tuple[str, str]]:
        """The fields of the progress log's :data:`SAVE_INTERVAL_EVENT` line."""
        return [(ITERATION, str(iteration)), (INTERVAL, str(self.interval)),
                (SAVE_COST, f"{self.save_cost_s:.3g}"), (SAVE_COST_FROM, self.save_cost_from),
                (MTBF_HOURS, f"{self.mtbf_s / 3600:.4g}"), (MTBF_FROM, self.mtbf_from),
                (STEP_SECONDS, f"{self.step_s:.4g}" if self.step_s is not None else "?")]


def format_hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"


def mtbf_estimate(history: History, prior_mtbf_s: Optional[float] = None,
                  prior_from: str = "[cluster] prior") -> Tuple[float, str]:
    """The mean time between unwarned interruptions, and where it came from: the allocated time over the
    unwarned interruptions, the prior (``[cluster] node_mtbf_hours`` over the nodes, else
    :data:`DEFAULT_MTBF_S`) counted as one more interruption in that much time -- the posterior mean of
    a Poisson rate under a Gamma prior of one interruption. Without history it is the prior; the run's
    own history outweighs it as it grows (a job killed twice in its first minutes is not yet taken to
    fail every minute, one that failed 20 times in 10 h is)."""
    base, base_from = (prior_mtbf_s, prior_from) if prior_mtbf_s else (DEFAULT_MTBF_S, "default")
    allocated, unwarned = history.allocated_s, history.unwarned
    if not history.runs:
        return base, base_from
    mtbf = (allocated + base) / (unwarned + 1)
    return mtbf, (f"history: {unwarned} in {format_hours(allocated)} of allocation, with {format_hours(base)} "
                  f"({base_from}) as one more")


def choose(history: History, *, prior_mtbf_s: Optional[float] = None, prior_from: str = "[cluster] prior",
           async_save: bool = False, lo: int = 1, hi: Optional[int] = None) -> Choice:
    """The rule applied to a history (see the module docstring for the inputs and their order)."""
    recent = history.interval_save_costs[-RECENT_SAVES:]
    if recent:
        cost, cost_from = statistics.median(recent), f"history, median of the last {len(recent)} interval saves"
    elif history.exit_save_costs and not async_save:
        recent = history.exit_save_costs[-RECENT_SAVES:]
        cost, cost_from = statistics.median(recent), f"history, median of the last {len(recent)} exit saves"
    else:
        cost, cost_from = DEFAULT_SAVE_COST_S, "default: no save recorded yet"
    unwarned = history.unwarned
    mtbf, mtbf_from = mtbf_estimate(history, prior_mtbf_s, prior_from)
    seconds = young_daly_seconds(cost, mtbf)
    refined = ""
    if unwarned >= REFINE_AFTER:
        better = refine(history, seconds, cost)
        refined = f" x {better / seconds:.2f} (refined on the {unwarned} interruptions' lost work)"
        seconds = better
    choice = Choice(None, cost, cost_from, mtbf, mtbf_from, None, "unknown", seconds, refined)
    if history.step_s:
        choice = choice.with_step(history.step_s, "history", lo, hi)
    return choice


def refine(history: History, seconds: float, save_cost_s: float) -> float:
    """The interval, among :data:`REFINE_FACTORS` times ``seconds``, that would have cost the recorded runs
    the least: saves (``save_cost_s`` per interval of their training) plus, at each unwarned end, the
    training since the run's last save -- all of it where the run trained less than one interval (an
    interruption soon after a restart, as in a burst, loses the same whatever the interval), else half
    an interval on average. Young/Daly's sqrt(2 C M) assumes the second case only."""
    training = sum(r.training_span_s for r in history.runs if r.trained)
    spans = sorted(r.training_span_s for r in history.runs if r.unwarned)
    below = [0.0] + list(itertools.accumulate(spans))  # below[i]: the sum of the i shortest spans

    def lost(w: float) -> float:
        i = bisect.bisect_left(spans, w)
        return training / w * save_cost_s + below[i] + (len(spans) - i) * w / 2

    return min((seconds * f for f in REFINE_FACTORS), key=lost)


def prior_mtbf_s(node_mtbf_hours: Optional[float], nodes: int) -> Optional[float]:
    """A job on ``nodes`` nodes is interrupted when any of them fails: the node MTBF over the nodes."""
    if not node_mtbf_hours:
        return None
    return node_mtbf_hours * 3600.0 / max(nodes, 1)


def prior_from(node_mtbf_hours: Optional[float], nodes: int) -> str:
    """How the log lines name the prior of :func:`prior_mtbf_s`."""
    return f"[cluster] node_mtbf_hours = {node_mtbf_hours:g} over {nodes} node{'s' if nodes > 1 else ''}"


# --------------------------------------------------------------------------------------------------
# Hindsight


@dataclass
class Hindsight:
    """The lost time of the runs so far against the interval (``bridge-report``)."""

    used: List[Optional[int]]  # each run's interval (None where not recorded)
    step_s: Optional[float]
    save_cost_s: Optional[float]
    unwarned: int
    lost_to_interruptions_s: float  # measured: work since the last save at each unwarned end
    lost_to_saves_s: float  # measured: Save seconds of the interval saves
    curve: List[Tuple[int, float]]  # (interval, modelled lost seconds) over the candidates
    best: Optional[int]
    best_lost_s: Optional[float]
    training_s: float  # useful training time (for the goodput the best interval would have given)

    def as_dict(self) -> dict:
        return {"used": self.used, "step_s": self.step_s, "save_cost_s": self.save_cost_s,
                "unwarned_interruptions": self.unwarned, "lost_to_interruptions_s": self.lost_to_interruptions_s,
                "lost_to_saves_s": self.lost_to_saves_s, "best_interval": self.best,
                "best_lost_s": self.best_lost_s, "curve": [list(p) for p in self.curve]}


#: The intervals the hindsight search tries: 1-2-5 steps per decade, up to 100,000 steps.
CANDIDATES = tuple(sorted({m * 10 ** e for e in range(6) for m in (1, 2, 5)} | {10 ** 6}))


def lost_with_interval(history: History, interval: int, step_s: float, save_cost_s: float) -> float:
    """Seconds that saves every ``interval`` steps plus the work lost at the recorded unwarned ends would
    have cost the recorded runs: each run saves at multiples of the interval from its first step, and an
    unwarned end loses the training since the run's last save (or its first step)."""
    every = interval * step_s
    lost = 0.0
    for run in history.runs:
        span = run.training_span_s
        if not run.trained or span <= 0:
            continue
        saves = int(span // (every + save_cost_s))
        lost += saves * save_cost_s
        if run.unwarned:
            lost += span - saves * (every + save_cost_s)
    return lost


def hindsight(history: History, candidates: Sequence[int] = CANDIDATES) -> Hindsight:
    measured_saves = sum(history.interval_save_costs)
    lost_interruptions = 0.0
    for run in history.runs:
        if run.unwarned and run.first_step is not None:
            last = max([run.first_step] + [t for t, _ in run.saves])
            lost_interruptions += max(run.end - last, 0.0)
    cost = statistics.median(history.interval_save_costs[-RECENT_SAVES:]) if history.interval_save_costs else (
        statistics.median(history.exit_save_costs[-RECENT_SAVES:]) if history.exit_save_costs else None)
    training = sum(r.training_span_s for r in history.runs) - measured_saves - lost_interruptions
    curve: List[Tuple[int, float]] = []
    best = best_lost = None
    if history.step_s and cost is not None:
        curve = [(n, lost_with_interval(history, n, history.step_s, cost)) for n in candidates]
        best, best_lost = min(curve, key=lambda p: (p[1], -p[0]))
    return Hindsight([r.interval for r in history.runs], history.step_s, cost, history.unwarned,
                     lost_interruptions, measured_saves, curve, best, best_lost, max(training, 0.0))
