"""Datasets and the iterators the loop reads from.

The data position is one number, the count of consumed samples: datasets are map-style and
deterministic in the index, and the sampler walks global sample indices in order from that count,
each data-parallel rank taking its slice of every micro-batch. Restoring the count from a
checkpoint therefore restores the exact next batch on every rank.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bridge_hpc.contracts import signals
from bridge_hpc.training.config import DataloaderConfig, DatasetBuildContext, DatasetProvider

__all__ = ["MockGPTDataset", "DatasetProvider", "DatasetBuildContext", "SampleIterator", "build_data_iterator"]

_SPLITS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset(Dataset):
    """Synthetic next-token data that a model can learn, generated from ``(seed, split, index)``.

    Each sample is an arithmetic token sequence ``(start + stride·i) mod vocab`` with a random
    start and stride, so loss falls quickly (a useful smoke signal) and any sample can be produced
    on its own: no files, no state, nothing to shard.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str = "train"):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_id = _SPLITS[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.split_id, int(index)])
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        seq = (start + stride * np.arange(self.seq_length + 1)) % self.vocab_size
        seq = torch.from_numpy(seq.astype(np.int64))
        return {
            "tokens": seq[:-1],
            "labels": seq[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


class _PretrainingBatchSampler:
    """Yields this rank's indices of each micro-batch, starting at ``consumed_samples``.

    Global sample ``i`` of the run is dataset index ``i mod len(dataset)``: a dataset shorter than
    the run is read again, in order, which keeps the position a single number.
    """

    def __init__(self, dataset_len: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset_len = dataset_len
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self):
        position = self.consumed
        while True:
            first = position + self.dp_rank * self.mbs
            yield [(first + j) % self.dataset_len for j in range(self.mbs)]
            position += self.mbs * self.dp_size


def _ignore_stop_signals(stop_signals: Sequence[str], worker_id: int) -> None:
    """Loader workers leave the stop signals (``train.exit_signal``) to the rank. Slurm signals every
    process of a step on preemption or time-out; a worker dying of SIGTERM would make torch raise in
    the rank in the middle of its step, before it could checkpoint. Workers still exit with their rank
    (torch watches the parent) and die with the step's final SIGKILL."""
    signals.ignore(stop_signals)


class SampleIterator:
    """The loop's data iterator: batches in order, with its position as ``state_dict()``.

    ``consumed_samples`` counts global samples (all data-parallel ranks) of the batches handed out,
    not of those prefetched by loader workers, so it is the position to resume from.
    """

    def __init__(self, dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 dataloader: DataloaderConfig, seed: int, stop_signals: Optional[Sequence[str]] = None):
        self.consumed_samples = consumed_samples
        self._step = micro_batch_size * dp_size
        sampler = _PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        # The loader draws its workers' base seed from its generator; a private one keeps the global
        # torch RNG (dropout) untouched, which exact resume depends on.
        generator = torch.Generator().manual_seed(seed)
        self._loader = DataLoader(
            dataset, batch_sampler=sampler, num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory and torch.cuda.is_available(),
            persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0,
            generator=generator,
            worker_init_fn=functools.partial(_ignore_stop_signals, tuple(stop_signals or signals.default_rank_signals())),
        )
        self._iter: Optional[Iterator] = None

    def __iter__(self) -> "SampleIterator":
        return self

    def __next__(self) -> Any:
        if self._iter is None:
            self._iter = iter(self._loader)
        batch = next(self._iter)
        self.consumed_samples += self._step
        return batch

    def state_dict(self) -> Dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def build_data_iterator(dataset: Optional[Dataset], consumed_samples: int, micro_batch_size: int, dp_rank: int,
                        dp_size: int, dataloader: DataloaderConfig, seed: int,
                        stop_signals: Optional[Sequence[str]] = None) -> Optional[SampleIterator]:
    """An iterator over ``dataset`` positioned at ``consumed_samples``, or None without a dataset.
    ``stop_signals``: the rank's (``train.exit_signal``), which its loader workers ignore."""
    if dataset is None or len(dataset) == 0:
        return None
    return SampleIterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, dataloader, seed,
                          stop_signals)


def build_datasets(provider: DatasetProvider, cfg) -> tuple:
    """Ask the dataset provider for ``(train, valid, test)`` sized for the whole run."""
    t = cfg.train
    train_samples = t.train_iters * t.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    valid_samples = evals * (t.eval_iters or 0) * t.global_batch_size
    test_samples = (t.eval_iters or 0) * t.global_batch_size
    return provider.build_datasets(DatasetBuildContext(train_samples, valid_samples, test_samples))
