"""Per-step metrics: ``metrics.jsonl`` on rank 0 and TensorBoard scalars on the last rank.

The JSON-lines file is the run's record of truth: one object per step with the loss at full float
precision (``json`` writes Python floats round-trip exactly), so two runs can be compared bit for
bit. Resuming appends; records past the step a run resumed from (written by an attempt that died
before its next checkpoint) are dropped first, so the file always reads as one trajectory.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional


class MetricsLogger:
    """Writes each step's record; ``writer_fn`` returns the TensorBoard writer or None on this rank."""

    TENSORBOARD_KEYS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
                        "tokens_per_s": "throughput/tokens_per_sec", "step_time_s": "iteration-time"}

    def __init__(self, path: Optional[str], rank: int, writer_fn: Callable[[], Any], tensorboard_log_interval: int = 1):
        self.path = path if rank == 0 else None
        self._writer_fn = writer_fn
        self._tb_interval = tensorboard_log_interval
        self._file = None

    def open(self, resume_step: int) -> None:
        """Open for appending after dropping records newer than ``resume_step``."""
        if self.path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):
            _truncate_after(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: Dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        step = record["step"]
        writer = self._writer_fn()
        if writer is not None and step % self._tb_interval == 0:
            for key, value in record.items():
                if key == "step" or value is None or isinstance(value, bool):
                    continue
                writer.add_scalar(self.TENSORBOARD_KEYS.get(key, key), value, step)

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        """Extra scalars (e.g. validation loss) for TensorBoard only."""
        writer = self._writer_fn()
        if writer is not None:
            for key, value in values.items():
                writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _truncate_after(path: str, step: int) -> None:
    """Atomically rewrite ``path`` without records whose step is > ``step`` (and without a torn last line)."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) == len(lines) and all(line.endswith("\n") for line in lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str) -> Dict[int, Dict[str, Any]]:
    """step -> last record for that step (a reader's view of a metrics file)."""
    out: Dict[int, Dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                out[record["step"]] = record
    return out
