"""A running job at a glance: Slurm state, restarts, step of ``train_iters``, loss, tokens/s, ETA
and the time left in the allocation.

``bridge-status RUN_DIR --follow`` shows it as one screen redrawn in place and ``bridge-submit
--wait`` as a one-line progress bar. Both show the same :class:`LiveStatus`, which
:mod:`bridge_hpc.cli.watch` builds from the run folder and Slurm (this module reads no Slurm and no
job config: the report side depends on the run folder's contracts alone):

- the job config the ranks run (the run folder's resolved.toml, through ``load_job_config`` like the
  ranks): ``train.train_iters`` and where ``metrics.jsonl`` is;
- ``metrics.jsonl`` (rank 0, one record per step), read incrementally: only the bytes added since the
  last poll, from the start again when a resume rewrote the file (a new inode or a shorter file);
- Slurm (:mod:`bridge_hpc.slurm.query`): every run of the job (state, restarts) and the current
  run's end time.

The job's ETA (:func:`job_eta`) is to ``train_iters`` across requeues, from the run folder's history
(progress.txt, read by :mod:`bridge_hpc.contracts.save_interval`, the reader the interval rule uses):
the steps left times the median of the recent step times, plus the saves' share of training so far,
plus the requeues still expected -- the allocations the time limit will end, and the interruptions
expected at the history's rates (unwarned: the mean time between them as the interval rule estimates
it; warned preemptions: as often as so far) -- each costing this run's mean start-up, lost work and
queue wait between its allocations. Before a step has been timed it says "not yet" and why, never a
guess. The current allocation's time left is shown beside it, labelled.

Where output is not a terminal (a pipe, a log file, CI), both print plain lines without control
codes: one when the state changes, else at most one per ``interval`` seconds when the step moved.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, List, Optional, TextIO

from bridge_hpc.contracts import save_interval as history_rules
from bridge_hpc.contracts.metrics_file import LOSS, STEP, STEP_TIME_S, TOKENS_PER_S

#: How many recent steps the rate, step time and ETA are taken over.
RECENT_STEPS = 20
#: Seconds between two plain lines that only report progress (a state change prints at once).
PLAIN_INTERVAL_S = 10.0
#: A metrics file longer than this is first read from this many bytes before its end.
_TAIL_BYTES = 256 * 1024


@dataclass
class LiveStatus:
    """What a person wants to know about a running job; None where it is not known yet."""

    job_id: str
    state: str
    restarts: int
    step: Optional[int] = None
    train_iters: Optional[int] = None
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    eta_s: Optional[float] = None  # the job's, to train_iters across requeues (None: not known yet)
    eta_note: str = ""  # what the ETA is made of, or why there is none yet
    step_s: Optional[float] = None  # the median of the recent step times
    allocation_left_s: Optional[float] = None
    reason: str = ""
    finished: bool = False  # Slurm is done with the job (a requeue is not done)

    @property
    def fraction(self) -> Optional[float]:
        if self.step is None or not self.train_iters:
            return None
        return min(1.0, self.step / self.train_iters)


@dataclass
class MetricsTail:
    """The newest records of a metrics.jsonl, read incrementally."""

    path: Optional[Path]
    offset: int = 0
    inode: Optional[int] = None
    partial: bytes = b""
    records: Deque[dict] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def poll(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except OSError:
            return
        if st.st_ino != self.inode or st.st_size < self.offset:  # rewritten on resume: read it again
            self.inode, self.offset, self.partial = st.st_ino, 0, b""
            self.records.clear()
        if st.st_size == self.offset:
            return
        skip_partial_first = False
        if self.offset == 0 and st.st_size > _TAIL_BYTES:  # a long run's file: its tail holds the recent steps
            self.offset, skip_partial_first = st.st_size - _TAIL_BYTES, True
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = data.split(b"\n")
        if skip_partial_first:
            lines = lines[1:]
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get(STEP), int):
                if self.records and record[STEP] <= self.records[-1][STEP]:
                    self.records.clear()  # a resumed attempt went back to its checkpoint's step
                self.records.append(record)


def add_training_figures(status: LiveStatus, records: List[dict]) -> None:
    """Step, loss, tokens/s and ETA from the newest metrics records (oldest first)."""
    if not records:
        return
    last = records[-1]
    status.step = last[STEP]
    status.loss = last.get(LOSS)
    rates = [r[TOKENS_PER_S] for r in records if r.get(TOKENS_PER_S)]
    status.tokens_per_s = statistics.median(rates) if rates else None
    times = [r[STEP_TIME_S] for r in records if r.get(STEP_TIME_S)]
    status.step_s = statistics.median(times) if times else None
    if status.step_s is not None and status.train_iters is not None:
        status.eta_s = max(0, status.train_iters - status.step) * status.step_s
        status.eta_note = "training time at the recent step time"


@dataclass
class JobEta:
    """The job's ETA to ``train_iters`` across requeues: ``seconds`` None where it cannot be estimated yet,
    ``note`` then saying why; else what it is made of."""

    seconds: Optional[float]
    note: str
    parts: dict = field(default_factory=dict)


def job_eta(history: history_rules.History, step: Optional[int], train_iters: Optional[int],
            step_s: Optional[float], *, running: bool, allocation_left_s: Optional[float] = None,
            time_limit_s: Optional[float] = None, prior_mtbf_s: Optional[float] = None,
            prior_from: str = "") -> JobEta:
    """The ETA of the module docstring. ``history`` is the run folder's (its last run live where
    ``running``); ``step``/``step_s`` the newest step and the recent step time (metrics.jsonl);
    ``allocation_left_s``/``time_limit_s`` Slurm's for the current allocation."""
    if train_iters is None:
        return JobEta(None, "not known: resolved.toml records no train.train_iters")
    if step is not None and step >= train_iters:
        return JobEta(0.0, "train_iters reached")
    if step_s is None:
        return JobEta(None, "not yet: no step of this job timed yet (metrics.jsonl)")
    left = (train_iters - (step or 0)) * step_s
    trained = [r for r in history.runs if r.trained]
    training = sum(r.training_span_s for r in trained)
    saves = sum(history.interval_save_costs)
    save_share = saves / training if training > 0 else 0.0
    work = left * (1.0 + save_share)
    startups = [r.first_step - r.start for r in trained if r.first_step is not None]
    startup = statistics.mean(startups) if startups else None
    lost = [max(r.end - max([r.first_step] + [t for t, _ in r.saves]), 0.0) for r in trained if r.unwarned]
    waits = history.queue_waits_s
    queue = statistics.mean(waits) if waits else 0.0
    mtbf, _ = history_rules.mtbf_estimate(history, prior_mtbf_s, prior_from or "[cluster] prior")
    warned = sum(1 for r in history.runs if r.reason in ("signal", "straggler", "transient_fault"))
    unwarned_expected = work / mtbf
    warned_expected = work * warned / history.allocated_s if history.allocated_s > 0 else 0.0
    limit_expected = 0
    if running and allocation_left_s is not None and time_limit_s and work > allocation_left_s:
        usable = time_limit_s - (startup or 0.0)
        limit_expected = math.ceil((work - allocation_left_s) / usable) if usable > 0 else 0
    requeues = unwarned_expected + warned_expected + limit_expected + (0 if running else 1)
    if requeues >= 0.5 and startup is None:
        return JobEta(None, "not yet: no run's start-up recorded (progress.txt), and a requeue is expected")
    per_requeue = (startup or 0.0) + queue
    lost_each = statistics.mean(lost) if lost else 0.0
    seconds = work + requeues * per_requeue + unwarned_expected * lost_each
    parts = {"steps_left": train_iters - (step or 0), "step_s": step_s, "save_share": save_share,
             "requeues_expected": requeues, "startup_s": startup, "queue_wait_s": queue if waits else None,
             "lost_per_interruption_s": lost_each, "unwarned_mtbf_s": mtbf, "unwarned_expected": unwarned_expected,
             "time_limit_requeues": limit_expected}
    queue_text = f"queue {format_duration(queue)} each" if waits else "no queue wait seen yet"
    startup_text = format_duration(startup) if startup is not None else "not recorded yet"
    note = (f"{parts['steps_left']} steps x {step_s:.3g} s, +{100 * save_share:.0f} % saves, "
            f"{requeues:.1f} requeues expected x (start-up {startup_text}, {queue_text})")
    return JobEta(seconds, note, parts)


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def format_duration(seconds: Optional[float]) -> str:
    """``45s``, ``12m 05s``, ``3h 07m``, ``2d 04h``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def format_rate(value: Optional[float]) -> str:
    """Tokens/s scaled to stay readable: ``850``, ``12.3k``, ``1.25M``."""
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def _step_text(status: LiveStatus) -> str:
    total = "?" if status.train_iters is None else str(status.train_iters)
    return f"{'-' if status.step is None else status.step}/{total}"


def _state_text(status: LiveStatus) -> str:
    text = status.state
    if status.reason and status.reason not in ("None", "") and not status.state == "RUNNING":
        text += f" ({status.reason})"
    return text


def _eta_short(status: LiveStatus) -> str:
    return "not yet" if status.eta_s is None and status.eta_note else format_duration(status.eta_s)


def eta_text(status: LiveStatus) -> str:
    if status.eta_s is None:
        return status.eta_note or "-"
    return f"{format_duration(status.eta_s)}" + (f"  ({status.eta_note})" if status.eta_note else "")


def bar(fraction: Optional[float], width: int) -> str:
    if fraction is None:
        return "[" + " " * width + "]"
    filled = int(round(fraction * width))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def plain_line(status: LiveStatus) -> str:
    """One line, no control codes: what a log file or a pipe gets."""
    loss = "-" if status.loss is None else f"{status.loss:.4f}"
    return (f"{time.strftime('%H:%M:%S')} job {status.job_id} {_state_text(status)} restarts {status.restarts} "
            f"step {_step_text(status)} loss {loss} tokens/s {format_rate(status.tokens_per_s)} "
            f"job ETA {_eta_short(status)} allocation left {format_duration(status.allocation_left_s)}")


def bar_line(status: LiveStatus, width: int) -> str:
    """The progress bar line of ``bridge-submit --wait``, fitted to ``width`` columns."""
    loss = "-" if status.loss is None else f"{status.loss:.4f}"
    fraction = status.fraction
    pct = "" if fraction is None else f" {fraction * 100:3.0f}%"
    tail = (f" {_step_text(status)}{pct} loss {loss} {format_rate(status.tokens_per_s)} tok/s "
            f"job ETA {_eta_short(status)} | {_state_text(status)} restarts {status.restarts} "
            f"alloc left {format_duration(status.allocation_left_s)}")
    room = width - len(tail) - 2
    if room >= 10:
        return bar(fraction, min(room, 40)) + tail
    return tail.strip()[: max(width - 1, 10)]


def screen_lines(status: LiveStatus, run_dir: Path) -> List[str]:
    """The lines of ``bridge-status --follow``'s screen."""
    loss = "-" if status.loss is None else f"{status.loss:.4f}"
    fraction = status.fraction
    pct = "" if fraction is None else f"  {fraction * 100:.1f} %"
    return [
        f"bridge-status  {run_dir}  job {status.job_id}  ({time.strftime('%H:%M:%S')})",
        f"  state            {_state_text(status)}",
        f"  restarts         {status.restarts}",
        f"  step             {_step_text(status)}  {bar(fraction, 30)}{pct}",
        f"  loss             {loss}",
        f"  tokens/s         {format_rate(status.tokens_per_s)}",
        f"  job ETA          {eta_text(status)}",
        f"  allocation left  {format_duration(status.allocation_left_s)}  (this allocation, Slurm's time limit)",
    ]


class LiveDisplay:
    """Shows statuses on ``stream``: redrawn in place on a terminal, plain lines otherwise.

    ``style`` is ``"screen"`` (several lines, ``bridge-status --follow``) or ``"bar"`` (one line,
    ``bridge-submit --wait``).
    """

    def __init__(self, run_dir: Path, style: str, stream: TextIO = sys.stdout, interval: float = PLAIN_INTERVAL_S):
        self.run_dir = run_dir
        self.style = style
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval
        self._drawn = 0
        self._last_plain: Optional[tuple] = None
        self._last_plain_time = 0.0

    def show(self, status: LiveStatus) -> None:
        if self.tty:
            self._redraw(status)
        else:
            self._plain(status)

    def close(self) -> None:
        if self.tty and self.style == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def _redraw(self, status: LiveStatus) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        if self.style == "bar":
            self.stream.write("\r\033[K" + bar_line(status, width))
            self._drawn = 1
        else:
            lines = [line[: width - 1] for line in screen_lines(status, self.run_dir)]
            up = f"\033[{self._drawn}F" if self._drawn else ""  # back to the first line of the last screen
            self.stream.write(up + "".join(f"\033[K{line}\n" for line in lines))
            self._drawn = len(lines)
        self.stream.flush()

    def _plain(self, status: LiveStatus) -> None:
        now = time.monotonic()
        key = (status.state, status.restarts, status.step)
        state_changed = self._last_plain is None or key[:2] != self._last_plain[:2]
        step_due = key != self._last_plain and now - self._last_plain_time >= self.interval
        if state_changed or step_due or (status.finished and key != self._last_plain):
            self.stream.write(plain_line(status) + "\n")
            self.stream.flush()
            self._last_plain, self._last_plain_time = key, now
