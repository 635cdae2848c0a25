"""bridge_hpc.prepare.worker_pool: the ordered map bridge-prepare-data tokenizes with. Real processes.

Why it exists: ``multiprocessing.Pool.terminate`` hung when a worker was stopped while writing a
result into the pipe all workers share (a prepare alive 5 s after SIGTERM). These tests pin what
replaces it: results in input order, the worker's exception raised in the parent, every worker gone
when the consumer stops early, and a worker that dies is an error, never a wait.
"""

from __future__ import annotations

import os
import signal

import pytest

from bridge_hpc.prepare import worker_pool


def _noop_init(*_):
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _square_slowly_by_parity(x):
    if x % 2:  # odd items take longer, so results come back out of order
        sum(range(20000))
    return x * x


def _fail_on_seven(x):
    if x == 7:
        raise ValueError("seven")
    return x


def _pid_then_die_on_three(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def test_results_come_in_input_order_and_never_far_ahead():
    read = []

    def items():
        for i in range(200):
            read.append(i)
            yield i

    out = []
    for value in worker_pool.ordered_map(_square_slowly_by_parity, items(), 3, _noop_init, (), 2):
        out.append(value)
        assert len(read) - len(out) <= 2 * 3 + 1  # the bound on results held for the consumer, plus the one read next
    assert out == [i * i for i in range(200)]


def test_a_workers_exception_is_raised_in_the_parent_and_no_worker_outlives_it():
    before = {c.pid for c in __import__("multiprocessing").active_children()}
    with pytest.raises(ValueError, match="seven"):
        list(worker_pool.ordered_map(_fail_on_seven, range(20), 2, _noop_init, (), 2))
    assert {c.pid for c in __import__("multiprocessing").active_children()} <= before


def test_closing_early_kills_every_worker():
    gen = worker_pool.ordered_map(_pid_then_die_on_three, iter([0, 1]), 2, _noop_init, (), 4)
    pids = {next(gen), next(gen)}
    gen.close()
    for pid in pids:  # killed and joined (reaped): the pid no longer names a process of ours
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_dies_is_an_error_not_a_wait():
    with pytest.raises(worker_pool.WorkerDied, match="exit code -9"):
        list(worker_pool.ordered_map(_pid_then_die_on_three, range(10), 2, _noop_init, (), 2))
