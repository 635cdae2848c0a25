"""The ranks' stop-signal handler: it records, the exit policy acts.

Torch-free on purpose: the rank entry point installs it before it imports torch and megatron (a few
seconds), so a stop signal that arrives during start-up is recorded instead of killing the rank by
its default action. ``pretrain`` then installs its own recorder, which takes over what the early one
saw.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Dict, List, Optional


class StopSignalRecorder:
    """Records that a stop signal arrived; the loop acts on it between steps.

    The handler does nothing but set a flag: anything more (collectives, I/O, locks) inside a
    signal handler can deadlock. It distributes nothing itself: after each step the exit policy
    all-reduces the flag (:func:`bridge_hpc.training.resilience.exit_policy.exit_reasons`), so every rank sees it
    at the same iteration and they all stop, save and exit together. ``signals`` are Python names
    (``train.exit_signal``, from :mod:`bridge_hpc.contracts.signals`).
    """

    def __init__(self, signals: List[str]):
        self.signals = [getattr(signal, name) for name in signals]
        self.received: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "StopSignalRecorder":
        # Python delivers signals to the main thread only; elsewhere the default action stays.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                previous = signal.signal(sig, self._record)
                self._previous[sig] = previous
                earlier = getattr(previous, "__self__", None)
                if isinstance(earlier, StopSignalRecorder) and earlier.received is not None:
                    self.received = earlier.received  # seen by the entry point's early recorder
        return self

    def _record(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
