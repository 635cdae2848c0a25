"""Where a run's start-up goes, phase by phase: from the process start to the end of its first step.

A requeued run pays its start-up on every preemption (issue: at most 15 s lost per preemption in
all), so the one figure "Start-up seconds" of the progress log is not enough to act on: rank 0 also
logs the phases (launch and imports, process group, set-up, model, optimizer, checkpoint load, data,
first step) and the progress log's ``First step`` line carries them
(:data:`bridge_hpc.contracts.progress_log.STARTUP_PHASES`), where ``benchmarks/preemption.py`` reads them.
"""

from __future__ import annotations

import time
from typing import Dict


class StartupPhases:
    """Seconds per start-up phase, each from the previous :meth:`mark` (the first from ``origin``:
    epoch seconds of the process start, or of an in-process restart's attempt)."""

    def __init__(self, origin: float):
        self.origin = origin
        self._last = origin
        self.seconds: Dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now (a phase marked twice adds up)."""
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(now - self._last, 0.0)
        self._last = now

    def describe(self) -> str:
        """``launch and imports 3.12 s, process group 0.41 s, ...`` in the order the phases ran."""
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.seconds.items())


def parse_phases(text: str) -> Dict[str, float]:
    """The phases of :meth:`StartupPhases.describe`'s text (a progress log's ``Start-up phases``)."""
    out: Dict[str, float] = {}
    for part in text.split(", "):
        name, _, seconds = part.rpartition(" ")[0].rpartition(" ")
        out[name] = float(seconds)
    return out
