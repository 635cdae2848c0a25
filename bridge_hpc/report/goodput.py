"""Per-run rows and goodput totals from a progress log (the table, JSON and plot are made from these).

Where the time went, per run (start = process start when the log records it, else the
``Starting job`` line; end = ``Ending job``, the fault time before a ``Restart``, or the last line):

- start-up: process start to first step done, less the checkpoint load (counted on its own);
- checkpoint save / load: ``Save seconds`` / ``Load seconds``;
- lost work: steps done after the last checkpoint, redone by the next run, priced at the step time
  estimated from the iterations between saves (or, when a run ended without saying how many steps it
  lost, the time from its last checkpoint to its end);
- training: the rest of the run. A run that trained no step has no training time: a bridge_hpc run
  (which logs its first step) failed or was stopped before its first, so the rest of its span is
  start-up; a run of a Megatron log (which records saves, not steps) that saved nothing lost it all.

Between runs, the time from one run's end to the next one's start is an *in-job restart* (allocated,
lost) when fault tolerance restarted training inside the allocation (a ``Restart`` line), and a gap
between allocations (queue wait; not allocated, reported apart) otherwise.
Goodput = training / allocated, allocated = the runs plus in-job restarts; 0 when no run trained a
step, whatever the allocated time (even none). The log's stamps have
1-second resolution, so a measured overhead can exceed its run's span by a fraction of a second: each
run's overheads are clipped to its span (load, start-up, save, then lost work), so that training and
the overheads add up to the allocated time exactly.

Devices: the ``Device`` of the ``Starting job`` line, shortened ("NVIDIA H100 80GB HBM3" -> "H100");
where the log does not say, the caller's fallback (the run folder's Slurm request: "cpu" or "gpu");
without one, "gpu" for a Megatron log (Megatron runs on GPUs) and "?" for a bridge_hpc log.
Tokens/s per run come from the run folder's metrics.jsonl (:mod:`bridge_hpc.report.curves`): the
optimizer steps of the run, less its first (compilation and warm-up, counted in start-up).

Megatron's own logs record none of these overheads: they show as "?" and goodput is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from bridge_hpc.contracts.progress_log import (
    CAUSE,
    CUMULATIVE_THROUGHPUT,
    ENDING_JOB,
    FIRST_STEP,
    ITERATION,
    JOB_THROUGHPUT,
    LOAD_SECONDS,
    LOADED_CHECKPOINT,
    LOST_SECONDS,
    REASON,
    RESTART,
    SAVE_EVENTS,
    SAVE_SECONDS,
    SECONDS_SINCE_PROCESS_START,
    STARTUP_SECONDS,
    STEPS_LOST,
    Run,
)
from bridge_hpc.contracts.save_interval import step_samples as _step_samples
from bridge_hpc.report.curves import TrainingCurves

UNKNOWN = "?"
CPU, GPU = "cpu", "gpu"
#: Words of a device name that say who made it or what line it belongs to, not which device it is.
_VENDOR_WORDS = {"nvidia", "amd", "intel", "tesla", "geforce", "quadro", "instinct", "radeon"}

#: The lost-time categories, in the order the table and the goodput bar show them.
LOST_KINDS = ("start-up", "checkpoint save", "checkpoint load", "lost work", "in-job restart")


@dataclass
class RunRow:
    """One run's figures; None means the log does not record it (shown as "?")."""

    job_id: str
    restart: Optional[int]
    world_size: int
    device: str  # "cpu", "H100", "gpu" (kind unknown) or "?"
    start: float
    end: float
    end_known: bool
    reason: Optional[str]  # None: the log does not say
    first_iteration: int
    last_iteration: int
    job_throughput: Optional[float]  # TFLOP/s/GPU of the run's last save line
    cumulative_throughput: Optional[float]
    startup_s: Optional[float]
    saves: int
    save_s: Optional[float]
    loads: Optional[int]
    load_s: Optional[float]
    lost_steps: Optional[int]
    lost_s: Optional[float]
    step_s: Optional[float]  # estimated seconds per training step
    in_job_restart: bool  # started by fault tolerance inside the previous run's allocation
    tokens_per_s: Optional[float] = None  # training steps only (metrics.jsonl); None: not recorded
    points: List[Tuple[float, int]] = field(default_factory=list)  # (time, iteration) for the plot

    @property
    def steps(self) -> int:
        return self.last_iteration - self.first_iteration

    @property
    def devices(self) -> str:
        """Ranks and what they run on: ``2 cpu``, ``8 H100``."""
        return f"{self.world_size} {self.device}"

    @property
    def has_gpus(self) -> bool:
        """False only where the ranks are known to run on CPUs (TFLOP/s/GPU does not apply there)."""
        return self.device != CPU

    @property
    def label(self) -> str:
        """``job/restart``: which run of which job."""
        return f"{self.job_id}/{UNKNOWN if self.restart is None else self.restart}"

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def training_s(self) -> float:
        """The run's time less its overheads; none at all for a run that trained no step."""
        if self.steps <= 0:
            return 0.0
        lost = sum(x or 0.0 for x in (self.startup_s, self.load_s, self.save_s, self.lost_s))
        return max(self.duration_s - lost, 0.0)


@dataclass
class Report:
    """The rows and the totals (see :func:`build_report` for the keys)."""

    rows: List[RunRow]
    totals: Dict[str, object]

    def goodput_segments(self) -> List[Tuple[str, Optional[float]]]:
        """(what, seconds) for the allocated time: training, then :data:`LOST_KINDS`; they add up to
        ``totals["allocated_s"]`` (all None where there is no progress log: :func:`metrics_only_report`)."""
        lost = self.totals["lost_s"]
        return [("training", self.totals["training_s"])] + [(kind, lost[kind]) for kind in LOST_KINDS]


def device_kind(name: Optional[str]) -> Optional[str]:
    """A device name as a table cell: "NVIDIA H100 80GB HBM3" -> "H100", "NVIDIA A100-SXM4-80GB" ->
    "A100", "NVIDIA GeForce RTX 4090" -> "RTX 4090", "cpu" -> "cpu" (None stays None)."""
    if not name:
        return None
    words = [w for w in name.replace("-", " ").split() if w.lower() not in _VENDOR_WORDS]
    if not words:
        return name.split()[0]
    if words[0].lower() == CPU:
        return CPU
    # a family word without digits (RTX, Titan) needs the model number after it
    return " ".join(words[:2]) if len(words) > 1 and not any(c.isdigit() for c in words[0]) else words[0]


def _clip(duration: float, *overheads: Optional[float]) -> List[Optional[float]]:
    """Overheads clipped in order so that they fit in ``duration`` (None stays None)."""
    left, out = max(duration, 0.0), []
    for value in overheads:
        if value is None:
            out.append(None)
        else:
            value = min(max(value, 0.0), left)
            left -= value
            out.append(value)
    return out


# --------------------------------------------------------------------------------------------------
# Building


def _iteration(event) -> Optional[int]:
    value = event.number(ITERATION)
    return None if value is None else int(value)


def _sum(events, key) -> Optional[float]:
    values = [e.number(key) for e in events]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_rows(runs: Sequence[Run], curves: Optional[TrainingCurves] = None,
               device_fallback: Optional[str] = None) -> List[RunRow]:
    pooled = [_step_samples(r) for r in runs]
    total_s, total_steps = sum(s for s, _ in pooled), sum(n for _, n in pooled)
    global_step_s = total_s / total_steps if total_steps else None

    rows: List[RunRow] = []
    last_saved_iteration = 0
    for i, (run, (sec, n)) in enumerate(zip(runs, pooled)):
        step_s = sec / n if n else global_step_s
        saves, loads = run.of(*SAVE_EVENTS), run.of(LOADED_CHECKPOINT)
        first_step, ending, restart = run.last(FIRST_STEP), run.last(ENDING_JOB), run.last(RESTART)

        start = run.start.time - (run.start.number(SECONDS_SINCE_PROCESS_START) or 0.0)
        if ending is not None:
            end, reason = ending.time, ending.fields.get(REASON)
        elif restart is not None:
            end, reason = restart.time - (restart.number(LOST_SECONDS) or 0.0), restart.fields.get(CAUSE)
        else:
            end, reason = max([run.start.time] + [e.time for e in run.events]), None

        loaded_it = _iteration(loads[-1]) if loads else None
        first_it = last_saved_iteration if loaded_it is None else loaded_it  # Megatron resumes from the latest
        marks = [(e.time, _iteration(e)) for e in run.of(FIRST_STEP, *SAVE_EVENTS) if _iteration(e) is not None]
        ended_it = _iteration(ending) if ending else None
        last_it = max([it for _, it in marks] + [first_it]) if ended_it is None else ended_it

        # no load in a run whose log records loads (ours): 0 s, not unknown
        load_s = _sum(loads, LOAD_SECONDS) if loads or run.restart_count is None else 0.0
        startup_s = None
        if first_step is not None and first_step.number(STARTUP_SECONDS) is not None:
            startup_s = max(first_step.number(STARTUP_SECONDS) - (load_s or 0.0), 0.0)

        lost_steps: Optional[int] = None
        lost_s: Optional[float] = None
        if ending is not None and ending.number(STEPS_LOST) is not None:
            lost_steps = int(ending.number(STEPS_LOST))
            lost_s = lost_steps * step_s if step_s is not None else None
        elif restart is not None:  # died without counting: everything since the last checkpoint
            since = saves or ([first_step] if first_step else [])
            if since:
                lost_s = max(end - since[-1].time, 0.0)
                lost_steps = round(lost_s / step_s) if step_s else None

        load_s, startup_s, save_s, lost_s = _clip(end - start, load_s, startup_s, _sum(saves, SAVE_SECONDS), lost_s)
        if last_it <= first_it:  # no step recorded: none of the run's time is training
            rest = max(end - start - sum(x or 0.0 for x in (load_s, startup_s, save_s, lost_s)), 0.0)
            if run.restart_count is not None:  # ours: no First step line, so it never got past start-up
                startup_s = (startup_s or 0.0) + rest
            else:  # Megatron's log records no steps, only saves: without one, whatever it did was lost
                lost_s = (lost_s or 0.0) + rest
        device = device_kind(run.device) or device_fallback or (GPU if run.restart_count is None else UNKNOWN)
        trained = range(first_it + 1, last_it + 1)
        # the first step of a run compiles and warms up (start-up): left out unless it is the only one
        tokens_per_s = curves.tokens_per_s_over(trained[1:] or trained) if curves is not None else None

        points = [(start, first_it)] + marks
        if end > points[-1][0]:
            points.append((end, last_it))

        rows.append(RunRow(
            job_id=run.job_id,
            restart=run.restart_count,
            world_size=run.world_size,
            device=device,
            start=start,
            end=end,
            end_known=ending is not None or restart is not None,
            reason=reason,
            first_iteration=first_it,
            last_iteration=last_it,
            job_throughput=saves[-1].number(JOB_THROUGHPUT) if saves else None,
            cumulative_throughput=saves[-1].number(CUMULATIVE_THROUGHPUT) if saves else None,
            startup_s=startup_s,
            saves=len(saves),
            save_s=save_s,
            loads=len(loads) if loads or run.restart_count is not None else None,  # Megatron: unrecorded
            load_s=load_s,
            lost_steps=lost_steps,
            lost_s=lost_s,
            step_s=step_s,
            in_job_restart=i > 0 and runs[i - 1].last(RESTART) is not None,
            tokens_per_s=tokens_per_s,
            points=points,
        ))
        saved = [it for it in map(_iteration, saves) if it is not None]
        if saved:
            last_saved_iteration = saved[-1]
    return rows


def build_report(runs: Sequence[Run], curves: Optional[TrainingCurves] = None,
                 device_fallback: Optional[str] = None) -> Report:
    """Rows and totals of the runs of a progress log; ``curves`` (a run folder's metrics) add tokens/s and
    the final losses, ``device_fallback`` names the device where the log does not (see the module docstring)."""
    rows = build_rows(runs, curves, device_fallback)
    restart_s = between_s = 0.0
    for prev, row in zip(rows, rows[1:]):
        gap = max(row.start - prev.end, 0.0)
        if row.in_job_restart:
            restart_s += gap
        else:
            between_s += gap
    allocated = sum(r.duration_s for r in rows) + restart_s
    training = sum(r.training_s for r in rows)
    lost = dict(zip(LOST_KINDS, (
        sum(r.startup_s or 0.0 for r in rows),
        sum(r.save_s or 0.0 for r in rows),
        sum(r.load_s or 0.0 for r in rows),
        sum(r.lost_s or 0.0 for r in rows),
        restart_s,
    )))
    first_steps = {r.first_iteration + 1 for r in rows}
    tokens_per_s = None
    if curves is not None:
        tokens_per_s = curves.tokens_per_s_over(s for s in curves.steps if s not in first_steps)
        tokens_per_s = tokens_per_s if tokens_per_s is not None else curves.tokens_per_s_over(curves.steps)
    cumulative = next((r.cumulative_throughput for r in reversed(rows) if r.cumulative_throughput is not None), None)
    totals: Dict[str, object] = {
        "runs": len(rows),
        "jobs": len({r.job_id for r in rows}),
        "steps": sum(r.steps for r in rows),
        "lost_steps": None if all(r.lost_steps is None for r in rows) else sum(r.lost_steps or 0 for r in rows),
        "cumulative_throughput": cumulative,
        "devices": rows[-1].devices if rows else None,
        "tokens_per_s": tokens_per_s,
        "final_step": curves.final_step if curves else None,
        "final_loss": curves.final_loss if curves else None,
        "final_validation_loss": curves.final_validation_loss if curves else None,
        "wall_s": (rows[-1].end - rows[0].start) if rows else 0.0,
        "allocated_s": allocated,
        "training_s": training,
        # no step trained: 0, not "?" (nothing was trained, whatever the time; and never 100 %)
        "goodput": 0.0 if not any(r.steps > 0 for r in rows) else training / allocated if allocated > 0 else None,
        "lost_s": lost,
        "between_allocations_s": between_s,
        # False when some overhead was not recorded (Megatron logs): goodput is then an upper bound.
        "complete": all(r.end_known and r.startup_s is not None for r in rows),
    }
    return Report(rows, totals)


def metrics_only_report(curves: TrainingCurves, device: Optional[str] = None) -> Report:
    """The report of a run folder without a progress log: what its metrics.jsonl says (losses, the last
    step, tokens/s over the steps after the first, which compiles and warms up). Which runs there were,
    where the time went and goodput are not recorded anywhere else: None ("?"), never guessed; no rows."""
    tokens_per_s = curves.tokens_per_s_over(curves.steps[1:])
    tokens_per_s = tokens_per_s if tokens_per_s is not None else curves.tokens_per_s_over(curves.steps)
    totals: Dict[str, object] = {
        "runs": None,
        "jobs": None,
        "steps": None,
        "lost_steps": None,
        "cumulative_throughput": None,
        "devices": f"{UNKNOWN} {device}" if device else None,
        "tokens_per_s": tokens_per_s,
        "final_step": curves.final_step,
        "final_loss": curves.final_loss,
        "final_validation_loss": curves.final_validation_loss,
        "wall_s": None,
        "allocated_s": None,
        "training_s": None,
        "goodput": None,
        "lost_s": {kind: None for kind in LOST_KINDS},
        "between_allocations_s": None,
        "complete": False,
    }
    return Report([], totals)
