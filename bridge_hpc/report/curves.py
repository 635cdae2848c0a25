"""A run folder's training curves: loss and tokens/s per step, and the validation loss.

- ``metrics.jsonl`` (rank 0, :mod:`bridge_hpc.training.engine.metrics`) holds one record per step of the run's
  one trajectory: a resume drops the records past the step it resumed from, so steps never repeat.
  Each record has ``step``, ``loss``, ``tokens_per_s`` and ``step_time_s`` (the optimizer step alone,
  without evaluation, checkpoint saves or start-up). An MoE model's records add its auxiliary losses
  (``load_balancing_loss``, ``z_loss`` ...).
- Validation loss: a record that carries :data:`VALIDATION_LOSS` holds the evaluation at its step and is
  read first. Where no record does, the evaluations the ranks printed into the job's stdout log, in
  Megatron's format (``validation loss at iteration 20 | lm loss value: 4.85E+00 | ...``), are read
  instead; a step evaluated twice (a run that died before its next checkpoint) keeps the later value.

Stdlib only: the login node reads these.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.metrics_file import LOSS, MOE_LOSSES, STEP, TOKENS_PER_S, VALIDATION_LOSS

#: The key of a metrics.jsonl record that holds the validation ("lm loss") evaluated at that step.
#: Megatron's evaluation line, as the ranks print it (rank prefixes such as ``0: `` before it).
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+)")


@dataclass
class TrainingCurves:
    """Per-step values, ordered by step; ``validation`` maps step to validation loss."""

    metrics_path: str
    steps: List[int] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    tokens_per_s: List[Optional[float]] = field(default_factory=list)
    step_time_s: List[Optional[float]] = field(default_factory=list)
    validation: Dict[int, float] = field(default_factory=dict)
    #: Mixture-of-Experts auxiliary losses (:data:`MOE_LOSSES`): name -> [(step, value)], the steps that have it
    aux_losses: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)
    validation_sources: List[str] = field(default_factory=list)  # the files the validation losses came from
    #: 1-based numbers of the non-blank lines of metrics.jsonl that were passed over (not UTF-8, not JSON, not
    #: a record with an integer ``step``, or a last line cut short), and how many non-blank lines it has
    skipped: List[int] = field(default_factory=list)
    lines: int = 0
    #: job logs named for validation losses that could not be read: "path (why)"
    unread_logs: List[str] = field(default_factory=list)

    @property
    def final_step(self) -> Optional[int]:
        return self.steps[-1] if self.steps else None

    @property
    def final_loss(self) -> Optional[float]:
        return self.losses[-1] if self.losses else None

    @property
    def final_validation_loss(self) -> Optional[float]:
        return self.validation[max(self.validation)] if self.validation else None

    def tokens_per_s_over(self, steps: Iterable[int]) -> Optional[float]:
        """Tokens trained over the time the optimizer steps took, for the given steps (None: no record).

        A time-weighted mean: the tokens of each step (its rate x its time) over the sum of the times."""
        wanted: Set[int] = set(steps)
        tokens = seconds = 0.0
        for step, rate, dt in zip(self.steps, self.tokens_per_s, self.step_time_s):
            if step in wanted and rate is not None and dt is not None and dt > 0:
                tokens, seconds = tokens + rate * dt, seconds + dt
        return tokens / seconds if seconds > 0 else None


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_curves(metrics_path: str, job_logs: Iterable[str] = ()) -> Optional[TrainingCurves]:
    """The curves of ``metrics_path`` (None when there is no such file), validation from its records or,
    where none has one, from ``job_logs`` (stdout logs of the run's jobs, oldest first; missing ones skipped).

    Best effort: a line that is not UTF-8, not JSON or not a JSON object with an integer ``step`` is
    damage, and a last line without its newline a record being written (or a killed writer's); either is
    passed over and its number kept in ``skipped``. A job log that cannot be read is named in
    ``unread_logs``. Raises ConfigError naming the file only when metrics.jsonl itself cannot be read.
    """
    if not os.path.isfile(metrics_path):
        return None
    try:
        with open(metrics_path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", path=metrics_path) from None
    by_step: Dict[int, dict] = {}
    skipped: List[int] = []
    count = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        count += 1
        record = None
        if number < len(lines):  # after the last newline: b"" or a line being written
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                record = None
        if not isinstance(record, dict) or not isinstance(record.get(STEP), int) or isinstance(record[STEP], bool):
            skipped.append(number)
            continue
        by_step[record[STEP]] = record  # a reader's view: the last record of a step wins

    curves = TrainingCurves(metrics_path, skipped=skipped, lines=count)
    for step in sorted(by_step):
        record = by_step[step]
        validation = _number(record.get(VALIDATION_LOSS))
        if validation is not None:
            curves.validation[step] = validation
        loss = _number(record.get(LOSS))
        if loss is None:
            continue
        curves.steps.append(step)
        curves.losses.append(loss)
        curves.tokens_per_s.append(_number(record.get(TOKENS_PER_S)))
        curves.step_time_s.append(_number(record.get("step_time_s")))
        for name in MOE_LOSSES:
            value = _number(record.get(name))
            if value is not None:
                curves.aux_losses.setdefault(name, []).append((step, value))
    if curves.validation:
        curves.validation_sources = [metrics_path]
    else:
        for log in job_logs:
            try:
                found = read_validation_lines(log)
            except ConfigError as err:
                curves.unread_logs.append(f"{log} ({err.message})")
                continue
            if found:
                curves.validation.update(found)
                curves.validation_sources.append(log)
        curves.validation = dict(sorted(curves.validation.items()))
    return curves


def read_validation_lines(path: str) -> Dict[int, float]:
    """Step -> validation loss printed in a job log (the later of two lines for a step); {} for no file."""
    found: Dict[int, float] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if "validation loss at" not in line:
                    continue
                match = VALIDATION_LINE.search(line)
                if match:
                    try:
                        found[int(match.group(1))] = float(match.group(2))
                    except ValueError:
                        continue  # a line cut short by a killed rank
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", path=path) from None
    return found
