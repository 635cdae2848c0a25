"""The ranks' stop-signal handler: it records, the exit policy acts.

Torch-free on purpose: the rank entry point installs it before it imports torch and megatron (a few
seconds), so a stop signal that arrives during start-up is recorded instead of killing the rank by
its default action. ``pretrain`` then installs its own recorder, which takes over what the early one
saw.

A library's C code can take a signal from Python without Python seeing it: ``signal.getsignal`` still
names the recorder, but the process's handler (sigaction) is another. Seen on an H200, 2026-11-29: a
one-GPU job on the fast path trained on through SIGUSR1 (Slurm's preemption notice) with the recorder
still named as the handler, while the same job with the fast path's Triton kernels and compiled
fusions off stopped and saved. The likeliest account: Triton registers LLVM's signal handlers when it is
imported (triton-lang/triton#4094, #4129), after the recorder (Triton comes with the model's kernels),
and LLVM's handler for SIGUSR1, its "info" signal, does nothing. So the recorder asks Triton not to
register them (``TRITON_DISABLE_PYTHON_STACKTRACE``, Triton's own switch, read when it is imported),
and the loop has it take the signals back before every step (:meth:`StopSignalRecorder.rearm`),
against any library that does the same at any time: a signal is then missed only if it lands between
such a library's takeover and the next step.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, List, Optional

#: Triton's switch for its LLVM signal handlers (``TRITON_DISABLE_PYTHON_STACKTRACE``: set, Triton
#: does not register them; read once, when Triton is imported).
TRITON_STACKTRACE_SWITCH = "TRITON_DISABLE_PYTHON_STACKTRACE"


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
        # Read by Triton when it is imported (later: with the model's kernels): without it, LLVM's handlers
        # take SIGUSR1 (module docstring). A user's own setting stands.
        os.environ.setdefault(TRITON_STACKTRACE_SWITCH, "1")
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

    def rearm(self) -> None:
        """Install the handlers again, while this recorder is the one in place: the process's handler
        for each signal is Python's again, whatever C code replaced it meanwhile without Python
        knowing (module docstring). A signal that came while another handler held it is lost."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._previous:
            if signal.getsignal(sig) == self._record:
                signal.signal(sig, self._record)

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
