"""``bridge-report``'s text and JSON: a table of runs and the goodput split per argument, and a
comparison of the headline figures when there are several arguments.

Cells: "?" where the log does not record a value, "-" where it does not apply (TFLOP/s/GPU of ranks
that run on CPUs). Rates are scaled (``11.9k`` tokens/s) so a small run does not read 0. An argument
without a progress log gets what its metrics.jsonl says and "?" for goodput (:func:`format_metrics_only`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from bridge_hpc.contracts.progress_log import format_time
from bridge_hpc.contracts.text import one_line
from bridge_hpc.report.goodput import UNKNOWN, RunRow
from bridge_hpc.report.run_report import RunReport
from bridge_hpc.report.units import format_rate

NOT_APPLICABLE = "-"

#: (header, RunRow attribute, format): a format() spec, "s" text, "t" a time stamp, "rate" a scaled
#: rate, "gpu" a TFLOP/s/GPU figure ("-" for ranks on CPUs).
COLUMNS = [
    ("job", "job_id", "s"), ("restart", "restart", "d"), ("devices", "devices", "s"),
    ("start", "start", "t"), ("end", "end", "t"), ("reason", "reason", "s"), ("steps", "steps", "d"),
    ("tokens/s", "tokens_per_s", "rate"), ("TFLOP/s/GPU", "job_throughput", "gpu"),
    ("start-up s", "startup_s", ".1f"), ("saves", "saves", "d"), ("save s", "save_s", ".1f"),
    ("loads", "loads", "d"), ("load s", "load_s", ".1f"), ("lost steps", "lost_steps", "d"), ("lost s", "lost_s", ".1f"),
]
_TEXT_FORMATS = ("s", "t")


def format_value(value, fmt: str) -> str:
    if value is None:
        return UNKNOWN
    if fmt == "t":
        return format_time(value)
    if fmt == "rate":
        return format_rate(value)
    if fmt == "gpu":
        return format(value, ".1f")
    return format(value, fmt)


def format_cell(row: RunRow, attr: str, fmt: str) -> str:
    if fmt == "gpu" and not row.has_gpus:
        return NOT_APPLICABLE
    return format_value(getattr(row, attr), fmt)


def _table(header: List[str], body: List[List[str]], right: List[bool]) -> List[str]:
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    out = []
    for row in [header] + body:
        cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        out.append("  ".join(cells).rstrip())
    return out


def format_metrics_only(run: RunReport) -> str:
    """An argument without a progress log: what its metrics.jsonl says, and "?" for the rest."""
    t, curves = run.report.totals, run.curves
    steps = curves.steps if curves is not None else []
    lines = [
        "no progress log: the runs, where the time went and goodput are unknown",
        f"from {one_line(curves.metrics_path) if curves is not None else UNKNOWN}: steps "
        f"{format_value(steps[0] if steps else None, 'd')}-{format_value(t['final_step'], 'd')} ({len(steps)} records), "
        f"final loss {format_value(t['final_loss'], '.4f')}, "
        f"validation loss {format_value(t['final_validation_loss'], '.4f')}, "
        f"tokens/s {format_value(t['tokens_per_s'], 'rate')}",
        f"goodput {UNKNOWN}",
    ]
    return "\n".join(lines) + "\n"


def format_table(run: RunReport) -> str:
    """The runs of one argument, then where its allocated time went (:func:`format_metrics_only` where
    there is no progress log)."""
    report = run.report
    if not report.rows:
        return format_metrics_only(run)
    header = [h for h, _, _ in COLUMNS]
    body = [[format_cell(row, attr, fmt) for _, attr, fmt in COLUMNS] for row in report.rows]
    right = [fmt not in _TEXT_FORMATS for _, _, fmt in COLUMNS]
    lines = _table(header, body, right)

    t = report.totals
    allocated = t["allocated_s"] or 0.0
    summary = (f"runs {t['runs']} (jobs {t['jobs']}), steps {t['steps']}, "
               f"lost steps {format_value(t['lost_steps'], 'd')}, tokens/s {format_value(t['tokens_per_s'], 'rate')}")
    if any(row.has_gpus for row in report.rows):
        summary += f", cumulative throughput {format_value(t['cumulative_throughput'], '.1f')} TFLOP/s/GPU"
    lines += ["", summary]
    training = "training" if t["complete"] else "training or unrecorded"
    share = [[training if name == "training" else name, sec] for name, sec in report.goodput_segments()]
    rows = [[name, f"{sec:.1f}", f"{100 * sec / allocated:.1f}%" if allocated else UNKNOWN] for name, sec in share]
    rows.append(["allocated", f"{allocated:.1f}", "100.0%" if allocated else UNKNOWN])
    lines += _table(["time", "seconds", "share"], rows, [False, True, True])
    goodput = format_value(None if t["goodput"] is None else 100 * t["goodput"], ".1f")
    lines += [
        f"goodput {goodput}%" + ("" if t["complete"] else
                                 " (upper bound: the log does not record every start-up, load, save or loss)"),
        f"between allocations (queue wait, not allocated) {t['between_allocations_s']:.1f} s",
    ]
    lines += save_interval_lines(run)
    lines += moe_lines(run)
    return "\n".join(lines) + "\n"


def moe_lines(run: RunReport) -> List[str]:
    """An MoE model's auxiliary losses (first, last and mean over the steps recorded) and what its
    TFLOP/s count: the active parameters, not every expert's."""
    curves, model = run.curves, run.model
    experts, topk = model.get("num_moe_experts"), model.get("moe_router_topk", 2)
    lines = []
    if isinstance(experts, int) and not isinstance(experts, bool):
        shared = " and the shared expert" if model.get("moe_shared_expert_intermediate_size") else ""
        lines.append(f"Mixture-of-Experts: {experts} experts, {topk} per token; TFLOP/s and MFU count the active "
                     f"parameters (the {topk} routed experts{shared} a token passes through, not all {experts})")
    elif curves is not None and curves.aux_losses:  # (a run without resolved.toml: torchrun, not bridge-submit)
        lines.append("Mixture-of-Experts: TFLOP/s and MFU count the active parameters (the experts a token is "
                     "routed to, not all of them)")
    for name, values in (curves.aux_losses.items() if curves is not None else ()):
        mean = sum(v for _, v in values) / len(values)
        lines.append(f"{name}: step {values[0][0]} {values[0][1]:.4f}, step {values[-1][0]} {values[-1][1]:.4f}, "
                     f"mean {mean:.4f} ({len(values)} steps)")
    return lines


def used_intervals(run: RunReport) -> str:
    """The interval of each run: the ``auto`` choice its progress log records, else the configured one."""
    h = run.save_interval
    configured = run.configured_interval
    shown = []
    for value in (h.used if h is not None else []):
        if value is not None:
            shown.append(f"{value} (auto)")
        elif configured == "auto":
            shown.append("?")  # an auto run that died before it chose
        else:
            shown.append("exit only" if configured is None else f"{configured}")
    return ", ".join(shown) or UNKNOWN


def best_goodput(run: RunReport) -> Optional[float]:
    """The goodput the best interval in hindsight would have given: the measured saves and lost work
    replaced by the best interval's."""
    h, t = run.save_interval, run.report.totals
    if h is None or h.best_lost_s is None or not t["allocated_s"] or t["goodput"] is None:
        return None
    allocated = t["allocated_s"] - h.lost_to_saves_s - h.lost_to_interruptions_s + h.best_lost_s
    return t["training_s"] / allocated if allocated > 0 else None


def save_interval_lines(run: RunReport) -> List[str]:
    """The save interval(s) used, what saves and unwarned interruptions cost, and the best in hindsight."""
    h = run.save_interval
    if h is None:
        return []
    lines = [f"save interval (steps) per run: {used_intervals(run)}; lost to unwarned interruptions "
             f"{h.lost_to_interruptions_s:.1f} s ({h.unwarned}), to interval saves {h.lost_to_saves_s:.1f} s"]
    if h.best is None:
        lines.append("best save interval in hindsight: ? (needs a step time and a recorded save)")
    else:
        goodput = best_goodput(run)
        lines.append(f"best save interval in hindsight: {h.best} steps, {h.best_lost_s:.1f} s lost to saves and "
                     f"interruptions, goodput {format_value(None if goodput is None else 100 * goodput, '.1f')}% "
                     f"(save cost {h.save_cost_s:.2g} s, step {h.step_s:.3g} s)")
    return lines


def _headline(run: RunReport) -> List[str]:
    t, rows = run.report.totals, run.report.rows
    gpus = any(row.has_gpus for row in rows)
    goodput = None if t["goodput"] is None else 100 * t["goodput"]
    return [
        one_line(run.label),
        t["devices"] or UNKNOWN,
        format_value(t["runs"], "d"),
        format_value(t["steps"], "d"),
        format_value(goodput, ".1f") + ("%" if goodput is not None else "")
        + ("" if t["complete"] or goodput is None else " (max)"),
        format_value(t["tokens_per_s"], "rate"),
        format_value(t["cumulative_throughput"], ".1f") if gpus else NOT_APPLICABLE,
        format_value(t["final_step"], "d"),
        format_value(t["final_loss"], ".4f"),
        format_value(t["final_validation_loss"], ".4f"),
    ]


COMPARISON_HEADER = ["run", "devices", "runs", "steps", "goodput", "tokens/s", "TFLOP/s/GPU", "final step",
                     "final loss", "validation loss"]


def format_comparison(runs: Sequence[RunReport]) -> str:
    """One line per argument: the figures to compare two configs, or before and after a change."""
    body = [_headline(run) for run in runs]
    right = [False, False] + [True] * (len(COMPARISON_HEADER) - 2)
    return "\n".join(_table(COMPARISON_HEADER, body, right)) + "\n"


def format_report(runs: Sequence[RunReport]) -> str:
    """The whole text output: one table, or one per argument (each under its name) and the comparison."""
    if len(runs) == 1:
        return format_table(runs[0])
    parts = [f"{one_line(run.label)}: {one_line(run.progress_log or 'no progress log')}\n{format_table(run)}"
             for run in runs]
    parts.append("comparison\n" + format_comparison(runs))
    return "\n".join(parts)


def to_json(run: RunReport) -> Dict[str, object]:
    runs = []
    for row in run.report.rows:
        data = asdict(row)
        data.update(steps=row.steps, devices=row.devices, duration_s=row.duration_s, training_s=row.training_s,
                    start=format_time(row.start), end=format_time(row.end), start_epoch=row.start, end_epoch=row.end)
        runs.append(data)
    interval = None
    if run.save_interval is not None:
        interval = dict(run.save_interval.as_dict(), used_text=used_intervals(run), best_goodput=best_goodput(run),
                        configured=run.configured_interval)
    return {"target": run.target, "label": run.label, "progress_log": run.progress_log,
            "metrics": run.curves.metrics_path if run.curves is not None else None, "runs": runs,
            "totals": run.report.totals, "notes": run.notes, "save_interval": interval}


def reports_to_json(runs: Sequence[RunReport]) -> Dict[str, object]:
    """One argument: its report (``runs``, ``totals``); several: ``{"reports": [...]}`` in argument order."""
    if len(runs) == 1:
        return to_json(runs[0])
    return {"reports": [to_json(run) for run in runs]}
