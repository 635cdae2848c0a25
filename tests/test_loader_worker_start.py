"""Loader workers forked at set-up, checked to have started, and a stuck one fails its rank instead of hanging.

Seen on the local cluster (2026-11-29, 2-rank CPU jobs under load): a rank waited for ever for a batch,
its loader worker stuck in the fork itself (Python 3.11's ``PyOS_AfterFork_Child`` waiting on a lock of
the interpreter's thread states that another thread held at the fork; a gloo thread of torch.distributed
was the one seen), and its peer waited in the next collective. So
:class:`~bridge_hpc.training.datasets.builders.SampleIterator` forks its workers when set-up asks
(``start()``), waits for each to report its start, and forks again the ones that did not; and a batch
may take as long as a peer rank waits in a collective (``wait_s``): past that the rank fails with the
cause, and the job requeues.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from bridge_hpc.training.config import MockGPTDatasetConfig
from bridge_hpc.training.datasets import builders


def _iterator(num_workers: int = 2, wait_s: float = 0.0) -> builders.SampleIterator:
    dataset = builders.MockGPTDataset(64, 8, 32, 1, "valid")
    return builders.SampleIterator(dataset, 0, 2, 0, 1, MockGPTDatasetConfig(seq_length=8, num_workers=num_workers),
                                   seed=1, stop_signals=["SIGTERM"], wait_s=wait_s)


def test_start_forks_the_workers_before_the_first_batch_and_changes_no_batch():
    early, lazy = _iterator(), _iterator()
    try:
        early.start()
        workers = list(early._iter._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        early.start()  # a second call forks nothing more
        assert list(early._iter._workers) == workers
        assert lazy._iter is None  # without start(), the first batch forks them
        for _ in range(5):
            a, b = next(early), next(lazy)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert early.state_dict() == lazy.state_dict() == {"consumed_samples": 10}
    finally:
        for it in (early, lazy):
            if it._iter is not None:
                it._iter._shutdown_workers()


def test_without_workers_start_changes_nothing():
    it = _iterator(num_workers=0, wait_s=5.0)  # torch refuses a timeout without workers: none is passed
    it.start()
    assert next(it)["tokens"].shape == torch.Size([2, 8])


STUCK = textwrap.dedent("""
    import time
    from torch.utils.data import get_worker_info
    from bridge_hpc.training.config import MockGPTDatasetConfig
    from bridge_hpc.training.datasets import builders

    class Stuck(builders.MockGPTDataset):
        def __getitem__(self, index):
            if get_worker_info() is not None:  # alive, and never delivers (as a worker on a lock its parent held)
                time.sleep(3600)
            return super().__getitem__(index)

    it = builders.SampleIterator(Stuck(64, 8, 32, 1, "valid"), 0, 2, 0, 1,
                                 MockGPTDatasetConfig(seq_length=8, num_workers=2), seed=1,
                                 stop_signals=["SIGUSR1"], wait_s=2.0)  # SIGTERM still ends the workers at exit
    it.start()
    try:
        next(it)
    except RuntimeError as err:
        print("raised:", err, flush=True)
        raise SystemExit(3)
    print("delivered", flush=True)
""")


def test_a_stuck_worker_fails_the_rank_with_the_cause():
    # In a child process, so that the test ends (failing) rather than hangs if the wait had no bound.
    proc = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "raised: DataLoader timed out after 2" in proc.stdout, proc.stdout


STUCK_IN_FORK = textwrap.dedent("""
    import os, sys, time
    import torch
    from bridge_hpc.training.config import MockGPTDatasetConfig
    from bridge_hpc.training.datasets import builders

    builders.WORKER_START_S = 15.0  # the module's own bound, shortened for the test (a loaded machine's
    # worker starts in seconds: the replacements must all start within it)
    first_child = sys.argv[1]

    def hang_in_the_first_fork():
        # The first child hangs before any code of its own runs, as one that inherited a held lock does.
        try:
            os.close(os.open(first_child, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        while True:
            time.sleep(1)

    os.register_at_fork(after_in_child=hang_in_the_first_fork)

    class Seeded(builders.MockGPTDataset):
        def __getitem__(self, index):  # each sample also says the seed of the worker that read it
            return dict(super().__getitem__(index), worker_seed=torch.tensor(torch.initial_seed()))

    def iterator(workers):
        return builders.SampleIterator(Seeded(64, 8, 32, 1, "valid"), 0, 2, 0, 1,
                                       MockGPTDatasetConfig(seq_length=8, num_workers=workers), seed=1,
                                       stop_signals=["SIGUSR1"])

    it = iterator(2)
    it.start()  # its first fork hangs: replaced
    assert all(w.is_alive() for w in it._iter._workers)
    fresh = iterator(2)  # started without a hang
    for _ in range(4):
        a, b = next(it), next(fresh)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (a, b)  # seeds included
    print("same batches", flush=True)
""")


def test_a_worker_stuck_in_its_fork_is_replaced_and_the_batches_are_the_same(tmp_path):
    marker = tmp_path / "first-child"
    proc = subprocess.run([sys.executable, "-c", STUCK_IN_FORK, str(marker)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "same batches" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert marker.exists()  # the first fork did hang
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("data loader workers")]
    assert len(warnings) == 1, proc.stderr
    assert "did not start within 15 s of their fork (attempt 1 of 3): killed, the loader's workers forked again" \
        in warnings[0], warnings
