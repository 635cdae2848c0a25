"""Per-run rows and goodput totals from a progress log, as a table, JSON or a plot.

Where the time went, per run (start = process start when the log records it, else the
``Starting job`` line; end = ``Ending job``, the fault time before a ``Restart``, or the last line):

- start-up: process start to first step done, less the checkpoint load (counted on its own);
- checkpoint save / load: ``Save seconds`` / ``Load seconds``;
- lost work: steps done after the last checkpoint, redone by the next run, priced at the step time
  estimated from the iterations between saves (or, when a run ended without saying how many steps it
  lost, the time from its last checkpoint to its end);
- training: the rest of the run.

Between runs, the time from one run's end to the next one's start is an *in-job restart* (allocated,
lost) when fault tolerance restarted training inside the allocation (a ``Restart`` line), and a gap
between allocations (queue wait; not allocated, reported apart) otherwise.
Goodput = training / allocated, allocated = the runs plus in-job restarts.

Megatron's own logs record none of these overheads: they show as "?" and goodput is an upper bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from bridge_hpc.report.progress import (
    ENDING_JOB,
    FIRST_STEP,
    LOADED_CHECKPOINT,
    RESTART,
    SAVE_EVENTS,
    Run,
    format_time,
)

UNKNOWN = "?"


@dataclass
class RunRow:
    """One run's figures; None means the log does not record it (shown as "?")."""

    job_id: str
    restart: Optional[int]
    world_size: int
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
    points: List[Tuple[float, int]] = field(default_factory=list)  # (time, iteration) for the plot

    @property
    def steps(self) -> int:
        return self.last_iteration - self.first_iteration

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def training_s(self) -> float:
        lost = sum(x or 0.0 for x in (self.startup_s, self.load_s, self.save_s, self.lost_s))
        return max(self.duration_s - lost, 0.0)


@dataclass
class Report:
    """The rows and the totals (see :func:`build_report` for the keys)."""

    rows: List[RunRow]
    totals: Dict[str, object]


# --------------------------------------------------------------------------------------------------
# Building


def _step_samples(run: Run) -> Tuple[float, int]:
    """(training seconds, steps) between the first step and each save of a run, saves excluded.

    A save line is written after the save, so the interval before it holds the steps plus the save.
    """
    marks = run.of(FIRST_STEP, *SAVE_EVENTS)
    seconds, steps = 0.0, 0
    for before, after in zip(marks, marks[1:]):
        di = (_iteration(after) or 0) - (_iteration(before) or 0)
        dt = after.time - before.time - (after.number("Save seconds") or 0.0)
        if di > 0 and dt > 0:
            seconds, steps = seconds + dt, steps + di
    return seconds, steps


def _iteration(event) -> Optional[int]:
    value = event.number("Iteration")
    return None if value is None else int(value)


def _sum(events, key) -> Optional[float]:
    values = [e.number(key) for e in events]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_rows(runs: Sequence[Run]) -> List[RunRow]:
    pooled = [_step_samples(r) for r in runs]
    total_s, total_steps = sum(s for s, _ in pooled), sum(n for _, n in pooled)
    global_step_s = total_s / total_steps if total_steps else None

    rows: List[RunRow] = []
    last_saved_iteration = 0
    for i, (run, (sec, n)) in enumerate(zip(runs, pooled)):
        step_s = sec / n if n else global_step_s
        saves, loads = run.of(*SAVE_EVENTS), run.of(LOADED_CHECKPOINT)
        first_step, ending, restart = run.last(FIRST_STEP), run.last(ENDING_JOB), run.last(RESTART)

        start = run.start.time - (run.start.number("Seconds since process start") or 0.0)
        if ending is not None:
            end, reason = ending.time, ending.fields.get("Reason")
        elif restart is not None:
            end, reason = restart.time - (restart.number("Lost seconds") or 0.0), restart.fields.get("Cause")
        else:
            end, reason = max([run.start.time] + [e.time for e in run.events]), None

        loaded_it = _iteration(loads[-1]) if loads else None
        first_it = last_saved_iteration if loaded_it is None else loaded_it  # Megatron resumes from the latest
        marks = [(e.time, _iteration(e)) for e in run.of(FIRST_STEP, *SAVE_EVENTS) if _iteration(e) is not None]
        ended_it = _iteration(ending) if ending else None
        last_it = max([it for _, it in marks] + [first_it]) if ended_it is None else ended_it

        # no load in a run whose log records loads (ours): 0 s, not unknown
        load_s = _sum(loads, "Load seconds") if loads or run.restart_count is None else 0.0
        startup_s = None
        if first_step is not None and first_step.number("Start-up seconds") is not None:
            startup_s = max(first_step.number("Start-up seconds") - (load_s or 0.0), 0.0)

        lost_steps: Optional[int] = None
        lost_s: Optional[float] = None
        if ending is not None and ending.number("Steps lost") is not None:
            lost_steps = int(ending.number("Steps lost"))
            lost_s = lost_steps * step_s if step_s is not None else None
        elif restart is not None:  # died without counting: everything since the last checkpoint
            since = saves or ([first_step] if first_step else [])
            if since:
                lost_s = max(end - since[-1].time, 0.0)
                lost_steps = round(lost_s / step_s) if step_s else None

        points = [(start, first_it)] + marks
        if end > points[-1][0]:
            points.append((end, last_it))

        rows.append(RunRow(
            job_id=run.job_id,
            restart=run.restart_count,
            world_size=run.world_size,
            start=start,
            end=end,
            end_known=ending is not None or restart is not None,
            reason=reason,
            first_iteration=first_it,
            last_iteration=last_it,
            job_throughput=saves[-1].number("Job throughput") if saves else None,
            cumulative_throughput=saves[-1].number("Cumulative throughput") if saves else None,
            startup_s=startup_s,
            saves=len(saves),
            save_s=_sum(saves, "Save seconds"),
            loads=len(loads) if loads or run.restart_count is not None else None,  # Megatron: unrecorded
            load_s=load_s,
            lost_steps=lost_steps,
            lost_s=lost_s,
            step_s=step_s,
            in_job_restart=i > 0 and runs[i - 1].last(RESTART) is not None,
            points=points,
        ))
        saved = [it for it in map(_iteration, saves) if it is not None]
        if saved:
            last_saved_iteration = saved[-1]
    return rows


def build_report(runs: Sequence[Run]) -> Report:
    rows = build_rows(runs)
    restart_s = between_s = 0.0
    for prev, row in zip(rows, rows[1:]):
        gap = max(row.start - prev.end, 0.0)
        if row.in_job_restart:
            restart_s += gap
        else:
            between_s += gap
    allocated = sum(r.duration_s for r in rows) + restart_s
    training = sum(r.training_s for r in rows)
    lost = {
        "start-up": sum(r.startup_s or 0.0 for r in rows),
        "checkpoint save": sum(r.save_s or 0.0 for r in rows),
        "checkpoint load": sum(r.load_s or 0.0 for r in rows),
        "lost work": sum(r.lost_s or 0.0 for r in rows),
        "in-job restart": restart_s,
    }
    cumulative = next((r.cumulative_throughput for r in reversed(rows) if r.cumulative_throughput is not None), None)
    totals: Dict[str, object] = {
        "runs": len(rows),
        "jobs": len({r.job_id for r in rows}),
        "steps": sum(r.steps for r in rows),
        "lost_steps": None if all(r.lost_steps is None for r in rows) else sum(r.lost_steps or 0 for r in rows),
        "cumulative_throughput": cumulative,
        "wall_s": (rows[-1].end - rows[0].start) if rows else 0.0,
        "allocated_s": allocated,
        "training_s": training,
        "goodput": training / allocated if allocated > 0 else None,
        "lost_s": lost,
        "between_allocations_s": between_s,
        # False when some overhead was not recorded (Megatron logs): goodput is then an upper bound.
        "complete": all(r.end_known and r.startup_s is not None for r in rows),
    }
    return Report(rows, totals)


# --------------------------------------------------------------------------------------------------
# Output

COLUMNS = [  # (header, RunRow attribute, format)
    ("job", "job_id", "s"), ("restart", "restart", "d"), ("GPUs", "world_size", "d"),
    ("start", "start", "t"), ("end", "end", "t"), ("reason", "reason", "s"), ("steps", "steps", "d"),
    ("TFLOP/s/GPU", "job_throughput", ".1f"), ("start-up s", "startup_s", ".1f"), ("saves", "saves", "d"),
    ("save s", "save_s", ".1f"), ("loads", "loads", "d"), ("load s", "load_s", ".1f"),
    ("lost steps", "lost_steps", "d"), ("lost s", "lost_s", ".1f"),
]


def format_value(value, fmt: str) -> str:
    if value is None:
        return UNKNOWN
    if fmt == "t":
        return format_time(value)
    return format(value, fmt)


def _table(header: List[str], body: List[List[str]], right: List[bool]) -> List[str]:
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    out = []
    for row in [header] + body:
        cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        out.append("  ".join(cells).rstrip())
    return out


def format_table(report: Report) -> str:
    header = [h for h, _, _ in COLUMNS]
    body = [[format_value(getattr(row, attr), fmt) for _, attr, fmt in COLUMNS] for row in report.rows]
    right = [fmt not in ("s", "t") for _, _, fmt in COLUMNS]
    lines = _table(header, body, right)

    t = report.totals
    allocated = t["allocated_s"] or 0.0
    lines += [
        "",
        f"runs {t['runs']} (jobs {t['jobs']}), steps {t['steps']}, lost steps {format_value(t['lost_steps'], 'd')}, "
        f"cumulative throughput {format_value(t['cumulative_throughput'], '.1f')} TFLOP/s/GPU",
    ]
    training = "training" if t["complete"] else "training or unrecorded"
    share = [[training, t["training_s"]]] + [[k, v] for k, v in t["lost_s"].items()]
    rows = [[name, f"{sec:.1f}", f"{100 * sec / allocated:.1f}%" if allocated else UNKNOWN] for name, sec in share]
    rows.append(["allocated", f"{allocated:.1f}", "100.0%" if allocated else UNKNOWN])
    lines += _table(["time", "seconds", "share"], rows, [False, True, True])
    goodput = format_value(None if t["goodput"] is None else 100 * t["goodput"], ".1f")
    lines += [
        f"goodput {goodput}%" + ("" if t["complete"] else
                                 " (upper bound: the log does not record every start-up, load, save or loss)"),
        f"between allocations (queue wait, not allocated) {t['between_allocations_s']:.1f} s",
    ]
    return "\n".join(lines) + "\n"


def to_json(report: Report) -> Dict[str, object]:
    runs = []
    for row in report.rows:
        data = asdict(row)
        data.update(steps=row.steps, duration_s=row.duration_s, training_s=row.training_s,
                    start=format_time(row.start), end=format_time(row.end),
                    start_epoch=row.start, end_epoch=row.end)
        runs.append(data)
    return {"runs": runs, "totals": report.totals}


def plot(report: Report, path: str) -> None:
    """Iteration vs wall time (restarts marked) and job throughput per run, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only --plot needs matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [2, 1]})
    t0 = report.rows[0].start if report.rows else 0.0
    labels = []
    for i, row in enumerate(report.rows):
        label = f"{row.job_id}/{UNKNOWN if row.restart is None else row.restart}"
        labels.append(label)
        xs = [(t - t0) / 3600 for t, _ in row.points]
        top.plot(xs, [it for _, it in row.points], marker=".", label=label)
        if i:
            top.axvline(xs[0], color="grey", linestyle="--", linewidth=0.8)
        top.annotate(row.reason or UNKNOWN, (xs[-1], row.points[-1][1]), fontsize=8,
                     textcoords="offset points", xytext=(2, 4))
    top.set_xlabel("wall time since first start (h)")
    top.set_ylabel("iteration")
    top.set_title("progress (dashed: restarts)")
    if labels:
        top.legend(fontsize=8, title="job/restart")
    bottom.bar(range(len(labels)), [r.job_throughput or 0.0 for r in report.rows])
    bottom.set_xticks(range(len(labels)), labels, fontsize=8)
    bottom.set_ylabel("TFLOP/s/GPU")
    bottom.set_title("job throughput per run")
    fig.tight_layout()
    fig.savefig(path, format="png")
