"""The loader's workers are forked at set-up, and a stuck one fails its rank instead of hanging the job.

Seen once on the local cluster (2026-11-29, a 2-rank CPU job under heavy load): rank 0 went silent in
the run's first evaluation, which forked the validation loader's workers from a process already running
its other threads; rank 1 waited in the evaluation's collective until gloo's 10-minute timeout, and Slurm
ended the job at its time limit. A process forked while another thread holds a lock inherits the lock
held; a worker that needs it never delivers a batch, and torch's DataLoader (``timeout=0``) waits for it
for ever. So :class:`~bridge_hpc.training.datasets.builders.SampleIterator` forks its workers when set-up
asks (``start()``, before the run's threads exist), and gives a batch as long as a peer rank waits in a
collective (``wait_s``): past that the rank fails with the cause, and the job requeues.
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
