"""``bridge-report --plot``: one figure of four panels, built by :func:`build_figure` and saved apart.

1. **loss** against step: training (every step, from metrics.jsonl) and validation; a dotted line and a
   label at the step each requeue, resubmission or in-job restart resumed from (the iteration of the
   checkpoint it loaded);
2. **progress**: iteration against wall time since the first start, in s, min or h by the span; queue
   waits between allocations shaded grey, in-job restarts (allocated, lost) shaded red;
3. **throughput** per run: tokens/s of the training steps, scaled by k or M; where the ranks run on GPUs,
   TFLOP/s/GPU (the progress log's job throughput) on a second axis;
4. **goodput**: the allocated time split into training and what was lost (:data:`LOST_KINDS`), stacked so
   the segments add up to the allocated time, with the queue wait as its own bar beside it. A run that
   trained no step has no training segment (:mod:`bridge_hpc.report.goodput`); an argument without a
   progress log has no bar and goodput "?".

Several arguments overlay in the same panels, one colour each. matplotlib is imported here only (an
optional dependency), and the figure is built without pyplot, so no display or global state is involved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

from bridge_hpc.report.goodput import LOST_KINDS, RunRow
from bridge_hpc.report.run_report import RunReport
from bridge_hpc.report.units import format_rate, rate_prefix, time_unit

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: The panels, in reading order (left to right, top to bottom).
PANELS = ("loss", "progress", "throughput", "goodput")
SEGMENT_COLORS: Dict[str, str] = dict(zip(("training",) + LOST_KINDS, (
    "tab:green", "tab:blue", "tab:purple", "tab:cyan", "tab:red", "tab:orange")))
QUEUE_WAIT = "queue wait (not allocated)"
QUEUE_COLOR = "0.8"
IN_JOB_RESTART = "in-job restart"
LOSS_LABEL = "loss (nats/token)"
ITERATION_LABEL = "iteration"
TFLOPS_LABEL = "TFLOP/s/GPU (job throughput)"


def resume_kind(previous: RunRow, row: RunRow) -> str:
    """How a run came after the previous one: inside its allocation (fault tolerance), as the same job
    requeued by Slurm, or as a new job submitted into the same folder."""
    if row.in_job_restart:
        return IN_JOB_RESTART
    return "requeue" if row.job_id == previous.job_id else "resubmission"


def build_figure(runs: Sequence[RunReport]) -> "Figure":
    """The report figure of one or several arguments (``bridge_hpc.cli.report.load_run_reports``); nothing
    is written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    interval = [run for run in runs if _has_interval_curve(run)]
    fig = Figure(figsize=(19, 8.5) if interval else (13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    if interval:  # a fifth panel: lost time against the save interval
        loss, progress, lost, throughput, goodput, spare = fig.subplots(2, 3).flat
        spare.remove()
        _interval_panel(lost, interval, [None] if len(runs) == 1 else [f"C{runs.index(r) % 10}" for r in interval])
    else:
        loss, progress, throughput, goodput = fig.subplots(2, 2).flat
    colors: List[Optional[str]] = [None] if len(runs) == 1 else [f"C{i % 10}" for i in range(len(runs))]
    _loss_panel(loss, runs, colors)
    _progress_panel(progress, runs, colors)
    _throughput_panel(throughput, runs, colors)
    _goodput_panel(goodput, runs)
    fig.suptitle("bridge-report: " + ", ".join(run.label for run in runs))
    return fig


def save_figure(fig: "Figure", path: str) -> None:
    """Write the figure as a PNG (OSError on an unwritable path)."""
    fig.savefig(path, format="png", dpi=100)


# --------------------------------------------------------------------------------------------------
# Panels


def _no_data(ax: "Axes", text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _legend(ax: "Axes", **kwargs) -> None:
    """A legend of the labelled artists, each label once."""
    handles, labels = ax.get_legend_handles_labels()
    seen: Dict[str, object] = {}
    for handle, label in zip(handles, labels):
        seen.setdefault(label, handle)
    if seen:
        ax.legend(list(seen.values()), list(seen), fontsize=8, **kwargs)


def _loss_panel(ax: "Axes", runs: Sequence[RunReport], colors: Sequence[Optional[str]]) -> None:
    several = len(runs) > 1
    drawn = False
    for run, color in zip(runs, colors):
        prefix = f"{run.label}: " if several else ""
        curves = run.curves
        if curves is not None and curves.steps:
            ax.plot(curves.steps, curves.losses, color=color or "tab:blue", linewidth=1, alpha=0.85,
                    label=prefix + "training")
            drawn = True
        if curves is not None and curves.validation:
            ax.plot(list(curves.validation), list(curves.validation.values()), color=color or "tab:orange",
                    linestyle="--", marker="o", markersize=4, label=prefix + "validation")
            drawn = True
        rows = run.report.rows
        for previous, row in zip(rows, rows[1:]):
            ax.axvline(row.first_iteration, color=color or "0.3", linestyle=":", linewidth=1.2)
            ax.text(row.first_iteration, 0.98, f" {resume_kind(previous, row)} {row.label}: step {row.first_iteration}",
                    transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="top", fontsize=7,
                    color=color or "0.3")
    if not drawn:
        _no_data(ax, "no metrics.jsonl: no loss curve")
    ax.set_xlabel("step")
    ax.set_ylabel(LOSS_LABEL)
    ax.set_title("loss (dotted: where a run resumed)")
    _legend(ax, loc="upper right")


def _progress_panel(ax: "Axes", runs: Sequence[RunReport], colors: Sequence[Optional[str]]) -> None:
    several = len(runs) > 1
    spans = [max(t for row in run.report.rows for t, _ in row.points + [(row.end, 0)]) - run.report.rows[0].start
             for run in runs if run.report.rows]
    if not spans:
        _no_data(ax, "no progress log: no runs")
    unit, seconds = time_unit(max(spans, default=0.0))
    for run, color in zip(runs, colors):
        rows = run.report.rows
        if not rows:
            continue
        t0 = rows[0].start
        for j, row in enumerate(rows):
            xs = [(t - t0) / seconds for t, _ in row.points]
            label = (run.label if j == 0 else None) if several else row.label
            ax.plot(xs, [it for _, it in row.points], marker=".", color=color or f"C{j % 10}", label=label)
            ax.annotate(row.reason or "?", (xs[-1], row.points[-1][1]), fontsize=7, textcoords="offset points",
                        xytext=(2, 4), color=color or f"C{j % 10}")
        for previous, row in zip(rows, rows[1:]):
            if row.start > previous.end:
                restart = row.in_job_restart
                shade = "tab:red" if restart else (color or QUEUE_COLOR)
                ax.axvspan((previous.end - t0) / seconds, (row.start - t0) / seconds, color=shade,
                           alpha=0.25 if restart or color else 0.6, label=IN_JOB_RESTART if restart else QUEUE_WAIT,
                           linewidth=0)
    ax.set_xlabel(f"wall time since first start ({unit})")
    ax.set_ylabel(ITERATION_LABEL)
    ax.set_title("progress (shaded: time between runs)")
    _legend(ax, loc="upper left", title=None if several else "job/restart")


def _throughput_panel(ax: "Axes", runs: Sequence[RunReport], colors: Sequence[Optional[str]]) -> None:
    several = len(runs) > 1
    bars = [(run, row, color) for run, color in zip(runs, colors) for row in run.report.rows]
    rates = [row.tokens_per_s for _, row, _ in bars]
    known = [r for r in rates if r is not None]
    prefix, factor = rate_prefix(max(known)) if known else ("", 1.0)
    gpus = any(row.has_gpus and row.job_throughput is not None for _, row, _ in bars)
    width = 0.4 if gpus else 0.6
    xs = [i - width / 2 if gpus else i for i in range(len(bars))]
    if known:
        drawn = ax.bar(xs, [(r or 0.0) / factor for r in rates], width=width,
                       color=[color or "tab:blue" for _, _, color in bars], label="tokens/s")
        ax.bar_label(drawn, labels=[format_rate(r) or "?" for r in rates], fontsize=7)
    elif bars:
        _no_data(ax, "no metrics.jsonl: no tokens/s")
    else:
        _no_data(ax, "no progress log: no runs")
    ax.set_xticks(range(len(bars)), [f"{run.label}\n{row.label}" if several else row.label for run, row, _ in bars],
                  fontsize=7)
    pad = max(0.0, (4 - len(bars)) / 2)  # a run or two: bars of the width of four, centred
    ax.set_xlim(-0.5 - pad, len(bars) - 0.5 + pad)
    ax.set_xlabel("run (job/restart)")
    ax.set_ylabel(f"training throughput ({prefix + ' ' if prefix else ''}tokens/s)")
    ax.set_title("throughput per run (training steps)")
    if gpus:
        twin = ax.twinx()
        flops = [row.job_throughput if row.has_gpus and row.job_throughput is not None else 0.0 for _, row, _ in bars]
        shown = twin.bar([i + width / 2 for i in range(len(bars))], flops, width=width, color="0.5", label="TFLOP/s/GPU")
        twin.bar_label(shown, labels=[f"{f:.1f}" for f in flops], fontsize=7)
        twin.set_ylabel(TFLOPS_LABEL)


def _goodput_panel(ax: "Axes", runs: Sequence[RunReport]) -> None:
    """The allocated time of each argument split into its segments; an argument without a progress log
    (where the time went unknown) gets no bar, and "?" in the title."""
    several = len(runs) > 1
    span = max((max(run.report.totals["allocated_s"], run.report.totals["between_allocations_s"])
                for run in runs if run.report.rows), default=0.0)
    unit, seconds = time_unit(span)
    ticks, names = [], []
    for k, run in enumerate(runs):
        totals = run.report.totals
        allocated, y = totals["allocated_s"], -2 * k
        if not run.report.rows:
            continue
        left = 0.0
        for name, sec in run.report.goodput_segments():
            share = f" {100 * sec / allocated:.1f}%" if allocated and not several else ""
            ax.barh(y, sec / seconds, left=left, color=SEGMENT_COLORS[name], edgecolor="white", linewidth=0.5,
                    label=name + share)
            left += sec / seconds
        ax.barh(y - 1, totals["between_allocations_s"] / seconds, color=QUEUE_COLOR, hatch="//", edgecolor="0.5",
                linewidth=0.5, label=QUEUE_WAIT)
        prefix = f"{run.label}\n" if several else ""
        ticks += [y, y - 1]
        names += [f"{prefix}allocated", f"{prefix}queue wait"]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_xlabel(f"time ({unit})")
    goodputs = [run.report.totals["goodput"] for run in runs]
    parts = [("?" if g is None else f"{100 * g:.1f}%")
             + ("" if run.report.totals["complete"] or g is None else " (max)") for run, g in zip(runs, goodputs)]
    ax.set_title("goodput " + ", ".join(f"{run.label} {p}" if several else p for run, p in zip(runs, parts))
                 + " of the allocated time")
    _legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)


def _has_interval_curve(run: RunReport) -> bool:
    """Whether the lost-time-against-interval panel is drawn for ``run``: its runs chose their interval
    (``save_interval = "auto"``) and the history gives a curve (a step time and a recorded save). The
    table and JSON give the hindsight figures of every run folder."""
    h = run.save_interval
    return h is not None and bool(h.curve) and any(u is not None for u in h.used)


def _interval_panel(ax: "Axes", runs: Sequence[RunReport], colors: Sequence[Optional[str]]) -> None:
    """Seconds lost to saves and to unwarned interruptions had every run saved every N steps (the recorded
    runs, :func:`bridge_hpc.contracts.save_interval.lost_with_interval`), the best N marked, and the
    intervals the runs used."""
    for run, color in zip(runs, colors):
        h = run.save_interval
        xs, ys = zip(*h.curve)
        label = f"{run.label}: " if len(runs) > 1 else ""
        ax.plot(xs, ys, color=color, label=f"{label}lost time at a fixed interval")
        ax.plot([h.best], [h.best_lost_s], "o", color=color or "C0", label=f"{label}best in hindsight: {h.best}")
        for used in sorted({u for u in h.used if u is not None}):
            ax.axvline(used, color=color or "C1", linestyle=":", linewidth=1)
        if any(u is not None for u in h.used):
            ax.plot([], [], ":", color=color or "C1", label=f"{label}intervals used (auto)")
    ax.set_xscale("log")
    ax.set_xlabel("save interval (steps)")
    ax.set_ylabel("seconds lost to saves and unwarned interruptions")
    ax.set_title("lost time against the save interval, in hindsight")
    _legend(ax, loc="upper center")
