"""A stop signal that reaches a data-loader worker while it starts (before it has set the signal to SIG_IGN)
does not kill it: the rank forks its workers with the stop signals blocked (issue 27's Slurm test caught a
worker killed by Slurm's SIGTERM there, which made the rank fail instead of checkpointing)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from bridge_hpc.training.config import MockGPTDatasetConfig
from bridge_hpc.training.datasets import builders


def test_a_sigterm_while_workers_start_does_not_kill_them(monkeypatch):
    from torch.utils.data._utils import signal_handling

    real = signal_handling._set_worker_signal_handlers

    def slow_start(*args):  # runs in each forked worker before its worker_init_fn: widen that window
        real(*args)
        time.sleep(1.0)

    monkeypatch.setattr(signal_handling, "_set_worker_signal_handlers", slow_start)
    dataset = builders.MockGPTDataset(64, 8, 32, 1, "train")
    loader_cfg = MockGPTDatasetConfig(seq_length=8, num_workers=2)
    it = builders.SampleIterator(dataset, 0, 2, 0, 1, loader_cfg, seed=1, stop_signals=["SIGTERM"])
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *a: received.append(1))

    def sigterm_the_workers():  # while each is still in its slowed start
        for worker in it._iter._workers:
            os.kill(worker.pid, signal.SIGTERM)

    timer = threading.Timer(0.4, sigterm_the_workers)
    try:
        timer.start()
        batch = next(it)  # forks the workers (the path the loop takes), then waits for the first batch
        timer.join()
        assert batch["tokens"].shape == torch.Size([2, 8])
        assert all(w.is_alive() for w in it._iter._workers)
        assert received == []
    finally:
        signal.signal(signal.SIGTERM, previous)
        it._iter._shutdown_workers()
