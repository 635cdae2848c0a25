"""An ordered map over worker processes that can always be stopped at once.

``multiprocessing.Pool`` cannot: its workers share one result pipe, and a worker stopped while it
writes a result (Ctrl-C, SIGTERM, an error in the parent) leaves half a message in that pipe; the
pool's result thread then waits for the rest forever and ``Pool.terminate`` joins that thread
(seen: a 2-worker ``bridge-prepare-data`` alive 5 s after SIGTERM on a loaded machine, one run in
ten). Here each worker has a pipe of its own and there are no helper threads: stopping is killing
the workers and joining them, whatever they were doing, and a worker that dies (the OOM killer) is
an error naming its exit code, not a wait.
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence

#: Signals a worker must not receive before its initializer has chosen what they do: it is forked with
#: them blocked (a stop signal to the group right then would otherwise run the parent's handler in it).
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class WorkerDied(RuntimeError):
    """A worker process ended without answering (killed from outside, out of memory)."""


def _serve(conn: Connection, func: Callable[[Any], Any], initializer: Callable[..., None], initargs: tuple,
           parent_mask: Sequence[int]) -> None:
    initializer(*initargs)
    signal.pthread_sigmask(signal.SIG_SETMASK, parent_mask)
    while True:
        item = conn.recv()
        if item is None:
            return
        try:
            answer = (True, func(item))
        except BaseException as err:  # noqa: BLE001 - handed to the parent, which raises it
            answer = (False, err)
        conn.send(answer)


def ordered_map(func: Callable[[Any], Any], items: Iterable[Any], workers: int, initializer: Callable[..., None],
                initargs: tuple, ahead_per_worker: int) -> Iterator[Any]:
    """``func(item)`` for each of ``items``, in their order, computed by ``workers`` processes.

    Each worker holds one item at a time (so neither side ever blocks sending while the other
    sends); at most ``ahead_per_worker x workers`` results wait, in order, for the consumer, so a
    long input is never read far ahead of it. An exception raised by ``func`` is raised here.
    However the generator ends (exhausted, an exception, ``close()``), every worker is killed and
    joined before it returns: the workers hold nothing another process needs.
    """
    context = multiprocessing.get_context("fork")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    procs: List[multiprocessing.process.BaseProcess] = []
    conns: List[Connection] = []
    try:
        for _ in range(workers):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(theirs, func, initializer, initargs, sorted(mask)), daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        source = iter(items)
        busy: Dict[int, int] = {}  # worker -> the index of the item it holds
        done: Dict[int, Any] = {}  # index -> result, until it is its turn
        sent = given = 0
        exhausted = False
        while True:
            for worker in range(workers):  # keep every idle worker busy while there is room
                if worker in busy or exhausted or len(done) + len(busy) >= ahead_per_worker * workers:
                    continue
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    continue
                conns[worker].send(item)
                busy[worker] = sent
                sent += 1
            if given in done:
                yield done.pop(given)
                given += 1
                continue
            if exhausted and not busy:
                return
            for conn in wait([conns[w] for w in busy]):
                worker = conns.index(conn)
                try:
                    ok, value = conn.recv()
                except EOFError:
                    procs[worker].join(1.0)
                    raise WorkerDied(f"worker process {procs[worker].pid} ended without answering (exit code "
                                     f"{procs[worker].exitcode})") from None
                if not ok:
                    raise value
                done[busy.pop(worker)] = value
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join()
        for conn in conns:
            conn.close()
