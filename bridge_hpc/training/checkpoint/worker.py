"""What runs in the processes behind ``checkpoint.async_save`` (see
:mod:`bridge_hpc.training.checkpoint.async_writer`), and how the rank starts them.

Stdlib only on purpose: a spawned process imports the module of every function it is given to run,
and the write-results Manager runs :func:`end_with_parent` before it answers the rank that waits for
it; with torch and megatron to import first it took seconds, which the first save waited for.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing.resource_tracker
import os
import signal
import threading
import time
from typing import Iterator, Optional, Sequence, Tuple

from bridge_hpc.contracts import signals

#: ``/proc/PID/comm`` of a checkpoint worker (at most 15 characters): what ``ps`` and ``top`` show.
WORKER_NAME = "bridge-ckpt"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


@contextlib.contextmanager
def stop_signals_blocked(names: Sequence[str]) -> Iterator[None]:
    """Block the stop signals in this thread while processes are started: a child inherits the mask,
    so a signal in its first seconds (before it can ignore them) stays pending instead of killing it.
    The rank loses nothing: a signal to the process goes to a thread that does not block it, or
    waits until the mask is restored."""
    numbers = {getattr(signal, name) for name in names}
    # Starting the resource tracker unblocks SIGINT and SIGTERM in this thread once it has spawned it
    # (bpo-33613): start it first, under the mask, so it ignores the stop signals too.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _prctl(option: int, value) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the worker still works, it just lacks these
        pass


def _die_with_parent(parent_pid: int) -> None:
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


#: In a process forked by the worker: the pid of the process that forked it (see prepare_worker).
_forked_by: int = 0


def _before_fork() -> None:
    global _forked_by
    _forked_by = os.getpid()


def _after_fork_in_child() -> None:
    _die_with_parent(_forked_by)


def prepare_worker(parent_pid: int, stop_signals: Tuple[str, ...], writer_module: str,
                   cuda_device: Optional[int] = None, began: Optional[float] = None) -> None:
    """The first request every checkpoint worker runs, in the worker: die with the rank (an orphan
    would wait for requests forever), and make every process it forks (the writers of each save) die
    with it (one whose worker died mid-save waits forever for its next message); ignore the rank's
    stop signals; name the process ``bridge-ckpt``; import the module of the write function now
    rather than in the first save. ``cuda_device`` (GPU runs): the worker copies the rank's tensors
    to pinned host memory itself, so its CUDA context and host allocator are created now too,
    overlapped with model building, not inside the first save's blocking part. ``began``: the rank's
    ``time.time()`` when it started the worker; given, the worker prints how long it took to be ready
    (a save asked for earlier waits for it)."""
    _die_with_parent(parent_pid)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    signals.ignore(stop_signals)
    _prctl(_PR_SET_NAME, WORKER_NAME.encode())
    importlib.import_module(writer_module)
    if cuda_device is not None:
        torch = importlib.import_module("torch")
        torch.cuda.set_device(cuda_device)
        torch.empty(1, device="cuda")
        torch.empty(1, pin_memory=True)
    if began is not None:
        print(f"checkpoint worker ready {time.time() - began:.1f}s after it was started (pid {os.getpid()})",
              flush=True)


def stage_once(tensors: Sequence, began: float, report: bool) -> None:
    """Runs in the worker, in the background (GPU runs, once, after the checkpoint load): copy every
    tensor a save will stage to host memory, as the save's own staging does
    (``tensor.to("cpu", non_blocking=True)``: pinned memory from torch's caching host allocator), and
    drop the copies. Why: the first save's staging otherwise pays, inside training's blocking time,
    for opening the rank's CUDA memory in this process, for page-locking gigabytes of host memory
    (``cudaHostAlloc``) and for the first copies; afterwards the allocator hands the same pinned
    blocks back, sizes matching, and the first save stages as fast as later ones. The pinned memory
    stays reserved by the worker, as it would after the first save. ``report``: print what it took
    (seconds from ``began``, the rank's ``time.time()`` when it asked)."""
    torch = importlib.import_module("torch")
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.synchronize()
    nbytes = sum(c.numel() * c.element_size() for c in copies)
    del copies
    if report:
        print(f"checkpoint worker: staged {len(tensors)} tensors ({nbytes / 1e9:.2f} GB) to pinned host memory "
              f"ahead of the first save, {time.time() - began:.1f}s after it was asked", flush=True)


def end_with_parent(parent_pid: int) -> None:
    """Runs in the write-results Manager process (its initializer): end it when its rank is gone. A
    rank that fails leaves with ``os._exit`` (see ``bridge_hpc.rank``), which skips the
    Manager's shutdown; an orphaned Manager would live on, holding the job's output pipes. (Not
    ``PR_SET_PDEATHSIG``: the Manager is started from a thread that ends right after.)"""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="end-with-rank", daemon=True).start()
