"""The ranks' stop-signal handler: it records, the exit policy acts.

Torch-free on purpose: the rank entry point installs it before it imports torch and megatron (a few
seconds), so a stop signal that arrives during start-up is recorded instead of killing the rank by
its default action. ``pretrain`` then installs its own recorder, which takes over what the early one
saw.

C code can take a signal from Python without Python knowing: ``signal.getsignal`` reads Python's own
table, not the process's handler (sigaction). Seen on an H200, 2026-11-29: one-GPU ranks on the fast
path trained on through SIGUSR1 (Slurm's preemption notice) with the recorder still named as the handler,
while the same job without the fast path's Triton kernels and compiled fusions stopped and saved. Which
code took it was not found then. So the loop has the recorder check the process's handlers before every
training step and every evaluation batch (:meth:`StopSignalRecorder.rearm`: one ``sigaction`` query a
signal), install Python's again where they were replaced, and say once which library held the signal; a
signal is missed only if it lands between such a takeover and the next check.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from typing import Any, Dict, List, Optional

#: The words of the rank's warning when C code had taken a stop signal (:meth:`StopSignalRecorder.rearm`).
TAKEN_FROM_PYTHON = "was taken from Python's handler by"


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
        #: The process's handler for each signal once the recorder is in place (Python's C handler).
        self._installed: Dict[int, Optional[int]] = {}
        self._reported: set = set()

    def __enter__(self) -> "StopSignalRecorder":
        # Python delivers signals to the main thread only; elsewhere the default action stays.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                previous = signal.signal(sig, self._record)
                self._previous[sig] = previous
                self._installed[sig] = process_handler(sig)
                earlier = getattr(previous, "__self__", None)
                if isinstance(earlier, StopSignalRecorder) and earlier.received is not None:
                    self.received = earlier.received  # seen by the entry point's early recorder
        return self

    def _record(self, signum, frame) -> None:
        self.received = signum

    def rearm(self) -> None:
        """Where C code replaced the process's handler of a signal this recorder holds in Python's
        table (module docstring), install Python's again, and say once which code held it. A signal
        that came while the other handler held it is lost."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, installed in self._installed.items():
            if signal.getsignal(sig) != self._record:
                continue  # Python code replaced the recorder on purpose: its choice stands
            current = process_handler(sig)
            if current == installed:
                continue
            signal.signal(sig, self._record)
            if sig not in self._reported:
                self._reported.add(sig)
                print(f"warning: {signal.Signals(sig).name} {TAKEN_FROM_PYTHON} {describe_handler(current)}; "
                      "taken back (a stop signal in between would have been lost)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self._installed.clear()


_getsig = ctypes.pythonapi.PyOS_getsig
_getsig.restype, _getsig.argtypes = ctypes.c_void_p, [ctypes.c_int]


def process_handler(signum: int) -> Optional[int]:
    """The address of the process's handler of ``signum`` (sigaction, through CPython's
    ``PyOS_getsig``): None for SIG_DFL, 1 for SIG_IGN."""
    return _getsig(signum)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def describe_handler(address: Optional[int]) -> str:
    """A process handler in words: SIG_DFL, SIG_IGN, or the shared object (and symbol) holding it."""
    if not address:
        return "the default action (SIG_DFL)"
    if address == 1:
        return "SIG_IGN (ignored)"
    info = _DlInfo()
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        found = dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    except (OSError, AttributeError):
        found = 0
    if not found or not info.dli_fname:
        return f"a handler at {address:#x} (no shared object known)"
    symbol = f" ({info.dli_sname.decode(errors='replace')})" if info.dli_sname else ""
    return f"a handler in {info.dli_fname.decode(errors='replace')}{symbol}"
