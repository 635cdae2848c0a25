"""Datasets and the iterators the loop reads from.

The data position is one number, the count of consumed samples: datasets are map-style and
deterministic in the index, and the sampler walks global sample indices in order from that count,
each data-parallel rank taking its slice of every micro-batch. Restoring the count from a
checkpoint therefore restores the exact next batch on every rank. megatron-core's GPTDataset and
BlendedDataset are of that kind (their document, sample, shuffle and blend indices are fixed by the
config's seed and sizes), so indexed data and blends resume exactly as mock data does. Fine-tuning
data (:class:`FinetuningDataset`) is too: its sample ``i`` is a line of a jsonl file picked by
``(seed, i)``, tokenized when it is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bridge_hpc.contracts import signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.datasets.config import (  # the descriptions: the ranks' classes derive from them
    DataloaderConfig,
    DatasetBuildContext,
    DatasetProvider,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    GPTFIMDatasetConfig,
    MockGPTDatasetConfig,
    read_index_header,
)
from bridge_hpc.training.datasets.jsonl_records import JsonlProblem, parse_jsonl_record

__all__ = ["MockGPTDataset", "FinetuningDataset", "DatasetProvider", "DatasetBuildContext", "SampleIterator",
           "build_data_iterator", "build_datasets", "build_mock_datasets", "build_gpt_datasets",
           "build_finetuning_datasets", "BUILDERS",
           "check_token_ids", "index_jsonl"]

#: In ``path_to_cache``: the largest token id of each ``.bin`` already scanned, keyed by path, size and
#: modification time, so a requeued job does not read its whole corpus again.
TOKEN_SCAN_FILE = "max_token_ids.json"
#: Tokens per read when scanning a ``.bin`` (64 MiB of int32): bounded memory, large sequential reads.
_SCAN_CHUNK = 1 << 24

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


class _GlobalBatchSampler:
    """Yields this rank's indices of a whole global batch at once (``dataloader_type = "batch"``).

    The same samples in the same order as :class:`_PretrainingBatchSampler` gives over the global
    batch's micro-batches, concatenated, so that a collate function sees them together and can pad
    them to one length.
    """

    def __init__(self, dataset_len: int, consumed_samples: int, micro_batch_size: int, num_microbatches: int,
                 dp_rank: int, dp_size: int):
        self.micro = _PretrainingBatchSampler(dataset_len, consumed_samples, micro_batch_size, dp_rank, dp_size)
        self.num_microbatches = num_microbatches

    def __iter__(self):
        micro_batches = iter(self.micro)
        while True:
            yield [index for _ in range(self.num_microbatches) for index in next(micro_batches)]


def _ignore_stop_signals(stop_signals: Sequence[str], worker_id: int) -> None:
    """Loader workers leave the stop signals (``train.exit_signal``) to the rank. Slurm signals every
    process of a step on preemption or time-out; a worker dying of SIGTERM would make torch raise in
    the rank in the middle of its step, before it could checkpoint. Workers still exit with their rank
    (torch watches the parent) and die with the step's final SIGKILL."""
    signals.ignore(stop_signals)


#: How long a loader worker may take from its fork to its first own instruction (``worker_init_fn``)
#: before it is taken for stuck in the fork (:meth:`SampleIterator.start`); a start takes milliseconds,
#: seconds on a loaded machine.
WORKER_START_S = 60.0
#: Forks of a loader's workers before the rank gives up (each attempt after the first forks all of the
#: loader's workers again).
WORKER_START_ATTEMPTS = 3
#: How the workers are started: by fork, whatever the platform's default (Python 3.14 makes it
#: forkserver): the stop signals are blocked around it and the start reports are fork-inherited events.
WORKER_CONTEXT = "fork"

logger = logging.getLogger(__name__)


def _worker_started(stop_signals: Sequence[str], started: Sequence[Any], worker_id: int) -> None:
    """A loader worker's first instruction: its start reported (the fork is over, which is what is
    measured), then the stop signals ignored (an error there reaches the rank with the first batch)."""
    try:
        started[worker_id].set()
    finally:
        _ignore_stop_signals(stop_signals, worker_id)


class SampleIterator:
    """The loop's data iterator: micro-batches in order, with its position as ``state_dict()``.

    ``consumed_samples`` counts global samples (all data-parallel ranks) of the micro-batches handed
    out, not of those prefetched by loader workers, so it is the position to resume from. A dataset's
    own ``collate_fn`` (fine-tuning pads with it) makes the batches. With ``dataloader_type = "batch"``
    the loader makes one batch of this rank's share of each global batch (``global_batch_size``
    samples over all ranks) and the iterator hands it out in micro-batches.
    """

    def __init__(self, dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 dataloader: DataloaderConfig, seed: int, stop_signals: Optional[Sequence[str]] = None,
                 global_batch_size: Optional[int] = None, wait_s: float = 0.0):
        self.consumed_samples = consumed_samples
        self._step = micro_batch_size * dp_size
        self._micro_batch_size = micro_batch_size
        self._num_microbatches = 1  # per loaded batch
        if dataloader.dataloader_type == "batch":
            if global_batch_size is None or global_batch_size % self._step:
                raise ValueError(f"dataloader_type 'batch' needs a global batch size divisible by micro-batch size "
                                 f"x data-parallel size ({self._step}), got {global_batch_size}")
            self._num_microbatches = global_batch_size // self._step
            sampler: Any = _GlobalBatchSampler(len(dataset), consumed_samples, micro_batch_size,
                                               self._num_microbatches, dp_rank, dp_size)
        else:
            sampler = _PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        # The loader draws its workers' base seed from its generator; a private one keeps the global
        # torch RNG (dropout) untouched, which exact resume depends on.
        generator = torch.Generator().manual_seed(seed)
        self._stop_signals = tuple(stop_signals or signals.default_rank_signals())
        self._loader = DataLoader(
            dataset, batch_sampler=sampler, num_workers=dataloader.num_workers,
            collate_fn=getattr(dataset, "collate_fn", None),
            pin_memory=dataloader.pin_memory and torch.cuda.is_available(),
            persistent_workers=dataloader.persistent_workers and dataloader.num_workers > 0,
            generator=generator,
            worker_init_fn=functools.partial(_ignore_stop_signals, self._stop_signals),  # start() adds its report
            multiprocessing_context=WORKER_CONTEXT if dataloader.num_workers > 0 else None,
            # A worker that is alive but stuck would leave this rank waiting for ever, and its peers in
            # their next collective: it fails the rank instead (the job then requeues).
            timeout=wait_s if dataloader.num_workers > 0 else 0,
        )
        self._iter: Optional[Iterator] = None
        self._pending: List[Any] = []

    def __iter__(self) -> "SampleIterator":
        return self

    def start(self) -> None:
        """Forks the loader's workers now (idempotent; the first batch otherwise does), and makes
        sure each has started.

        A worker can hang in the fork itself, before any code of its own runs: Python 3.11's child,
        in ``PyOS_AfterFork_Child``, waits on a lock of the interpreter's thread states that another
        thread of the parent held at the fork (the other thread seen there: a torch.distributed gloo
        thread, which enters and leaves Python). Seen on the local cluster, 2026-11-29: rank 1 waited
        for ever for its first batch after a resume, one of its workers stuck there, and rank 0 in
        the gradient all-reduce. So each worker reports its start (its ``worker_init_fn``); when
        one does not within :data:`WORKER_START_S`, it is killed and the loader's workers are
        forked again (from the loader's generator as it was: the workers' seeds are a first
        fork's), up to :data:`WORKER_START_ATTEMPTS` times. The stop signals stay blocked until
        each worker has set them to SIG_IGN, so a signal in between cannot kill one (torch would
        then raise in this rank's step)."""
        if self._iter is not None:
            return
        workers = self._loader.num_workers
        seeds = self._loader.generator.get_state()
        for attempt in range(1, WORKER_START_ATTEMPTS + 1):
            started = [multiprocessing.get_context(WORKER_CONTEXT).Event() for _ in range(workers)]
            self._loader.worker_init_fn = functools.partial(_worker_started, self._stop_signals, started)
            self._loader.generator.set_state(seeds)  # the workers' base seed is drawn from it
            with signals.blocked(self._stop_signals):
                self._iter = iter(self._loader)
            deadline = time.monotonic() + WORKER_START_S
            stuck = [i for i, event in enumerate(started) if not event.wait(max(0.0, deadline - time.monotonic()))]
            if not stuck:
                return
            pids = [self._iter._workers[i].pid for i in stuck]
            self._discard_iterator([self._iter._workers[i] for i in stuck])
            again = attempt < WORKER_START_ATTEMPTS
            logger.warning("data loader workers %s did not start within %.0f s of their fork (attempt %d of %d): "
                           "killed%s", pids, WORKER_START_S, attempt, WORKER_START_ATTEMPTS,
                           ", the loader's workers forked again" if again else "")
        raise RuntimeError(f"data loader workers did not start within {WORKER_START_S:.0f} s of their fork, "
                           f"{WORKER_START_ATTEMPTS} times (the last ones killed: {pids})")

    def _discard_iterator(self, stuck: List[Any]) -> None:
        """Kills ``stuck`` workers and shuts the iterator's others down, before the next fork."""
        it = self._iter
        # torch's SIGCHLD handler would take the kill for a worker failure and raise: its record of this
        # iterator's workers goes first (what _shutdown_workers would do).
        if it._worker_pids_set:
            torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for worker in stuck:
            worker.kill()  # multiprocessing's: not once the worker is reaped
        it._shutdown_workers()
        # The closed queues' feeder threads end now; a fork while one ends its thread state is the
        # very race above: the next fork waits for them.
        for queue in it._index_queues:
            thread = getattr(queue, "_thread", None)
            if thread is not None:
                thread.join(WORKER_START_S)
        self._iter = self._loader._iterator = None  # a persistent loader would reuse the closed iterator

    def __next__(self) -> Any:
        self.start()
        if not self._pending:
            self._pending = self._micro_batches(next(self._iter))
        batch = self._pending.pop(0)
        self.consumed_samples += self._step
        return batch

    def _micro_batches(self, batch: Any) -> List[Any]:
        """A loaded batch as the micro-batches it holds: itself, unless ``dataloader_type = "batch"``, whose
        batches are dicts of tensors with the samples along the first dimension."""
        if self._num_microbatches == 1:
            return [batch]
        size = self._micro_batch_size
        return [{key: value[i * size:(i + 1) * size] for key, value in batch.items()}
                for i in range(self._num_microbatches)]

    def state_dict(self) -> Dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


class PositionIterator:
    """The data iterator of a rank that does not read (a tensor-parallel rank other than its group's
    first, which broadcasts each micro-batch to it: :func:`bridge_hpc.training.gpt_step.get_batch`):
    it hands out None and keeps the same position as the reader, so checkpoints, re-runs and the
    exit policy see the same data state on every rank."""

    def __init__(self, consumed_samples: int, micro_batch_size: int, dp_size: int):
        self.consumed_samples = consumed_samples
        self._step = micro_batch_size * dp_size

    def __iter__(self) -> "PositionIterator":
        return self

    def __next__(self) -> None:
        self.consumed_samples += self._step
        return None

    def state_dict(self) -> Dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def build_data_iterator(dataset: Optional[Dataset], consumed_samples: int, micro_batch_size: int, dp_rank: int,
                        dp_size: int, dataloader: DataloaderConfig, seed: int,
                        stop_signals: Optional[Sequence[str]] = None,
                        global_batch_size: Optional[int] = None,
                        reads: bool = True, wait_s: float = 0.0) -> Optional[Union[SampleIterator, PositionIterator]]:
    """An iterator over ``dataset`` positioned at ``consumed_samples``, or None without a dataset.
    ``stop_signals``: the rank's (``train.exit_signal``), which its loader workers ignore;
    ``global_batch_size``: needed by ``dataloader_type = "batch"``; ``reads = False``: a
    :class:`PositionIterator` (the micro-batches come from another rank); ``wait_s``: how long a
    batch may take to come from the loader's workers before the rank fails (0: for ever)."""
    if dataset is None or len(dataset) == 0:
        return None
    if not reads:
        return PositionIterator(consumed_samples, micro_batch_size, dp_size)
    return SampleIterator(dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, dataloader, seed,
                          stop_signals, global_batch_size, wait_s)


def build_mock_datasets(config: GPTDatasetConfig, context: DatasetBuildContext) -> tuple:
    """``(train, valid, test)`` of :class:`MockGPTDataset`, each sized as the context asks (None for 0):
    for a :class:`MockGPTDatasetConfig`, or a :class:`GPTDatasetConfig` given no data (megatron-core's
    mock mode), whose token ids stay below the model's vocabulary size."""
    vocab_size = config.vocab_size if isinstance(config, MockGPTDatasetConfig) else context.vocab_size

    def split(name: str, n: int) -> Optional[MockGPTDataset]:
        if n <= 0:
            return None
        return MockGPTDataset(n, config.seq_length, vocab_size, config.random_seed, name)

    return split("train", context.train_samples), split("valid", context.valid_samples), split(
        "test", context.test_samples)


def build_datasets(dataset: Union[DatasetProvider, DataloaderConfig], cfg, tokenizer: Optional[Any] = None) -> tuple:
    """``(train, valid, test)`` for ``cfg.dataset`` sized for the whole run: a user's
    :class:`DatasetProvider` builds its own; a built-in config type is built by the function
    :data:`BUILDERS` maps it to (the most derived match).

    ``tokenizer``: the run's, from :func:`bridge_hpc.training.tokenizers.build_tokenizer_for` (which
    indexed data needs). A collective when torch.distributed is up: every rank must call it.
    """
    train_samples, valid_samples, test_samples = cfg.split_samples()
    context = DatasetBuildContext(train_samples, valid_samples, test_samples, tokenizer=tokenizer,
                                  vocab_size=cfg.model.vocab_size)
    if isinstance(dataset, DatasetProvider):
        return dataset.build_datasets(context)
    builder = next((BUILDERS[t] for t in type(dataset).__mro__ if t in BUILDERS), None)
    if builder is None:
        raise ConfigError(f"{type(dataset).__name__} is neither a built-in dataset config nor a DatasetProvider "
                          "(implement build_datasets)", key="dataset")
    return builder(dataset, context)


# ---------------------------------------------------------------------------------------------
# Indexed data: megatron-core's GPTDataset through its BlendedMegatronDatasetBuilder
# ---------------------------------------------------------------------------------------------


def build_gpt_datasets(config: GPTDatasetConfig, context: DatasetBuildContext) -> tuple:
    """``(train, valid, test)`` of megatron-core ``GPTDataset`` / ``BlendedDataset`` for ``config``.

    ``config`` must have been validated (``seq_length`` and ``path_to_cache`` filled). First the token
    ids are checked against the model's vocabulary (:func:`check_token_ids`), then megatron-core's
    builder runs on every rank: with torch.distributed up it builds each dataset on rank 0 first
    (writing the index cache), waits at a barrier, and the other ranks then load those indices. A
    :class:`GPTFIMDatasetConfig` builds :class:`bridge_hpc.training.datasets.fim.GPTFIMDataset` instead, its
    sentinel tokens resolved against the tokenizer first.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    if config.mock:  # no data given (megatron-core's mock mode): the toolkit's mock samples
        return build_mock_datasets(config, context)
    if context.tokenizer is None:
        raise ValueError("GPTDatasetConfig needs the run's tokenizer: build it with "
                         "bridge_hpc.training.tokenizers.build_tokenizer_for(cfg) and pass it to build_datasets")
    if context.vocab_size is not None:
        check_token_ids(config.prefixes(), context.vocab_size, config.path_to_cache)
    dataset_class, config_class, extra = GPTDataset, MCoreGPTDatasetConfig, {}
    if isinstance(config, GPTFIMDatasetConfig):
        from bridge_hpc.training.datasets.fim import GPTFIMDataset, MCoreGPTFIMDatasetConfig, fim_settings

        dataset_class, config_class = GPTFIMDataset, MCoreGPTFIMDatasetConfig
        extra = {"fim": fim_settings(config, context.tokenizer)}
    # Every megatron-core field of the section, as megatron-core's own config (it acts on each); the
    # ones it has and this megatron-core version lacks are dropped, the tokenizer is the run's.
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    values = {k: v for k, v in config.megatron_fields().items() if k in known}
    mcore_config = config_class(**{**values, "tokenizer": context.tokenizer}, **extra)
    sizes = [context.train_samples, context.valid_samples, context.test_samples]
    train, valid, test = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, mcore_config).build()
    return train, valid, test


def check_token_ids(prefixes: Sequence[Tuple[str, str]], vocab_size: int, cache_dir: Optional[str]) -> None:
    """Raise a ConfigError naming the ``.bin`` (and the config key) whose token ids reach ``vocab_size``.

    ``prefixes``: ``(prefix, config key)`` pairs. A dataset prepared with another tokenizer would
    otherwise index past the embedding table (a CUDA assert, or on CPU an IndexError) at some step, or
    train quietly on garbage. The scan reads every ``.bin`` once, in chunks, shared across the ranks
    (each reads every world-size-th chunk; one all-reduce takes the maxima), so it costs a fraction of
    one read of the corpus; each file's maximum is kept in ``cache_dir`` (:data:`TOKEN_SCAN_FILE`), so
    a restart rescans only files that changed. Every rank raises the same error, so all exit with the
    bad-input status together. Collective when torch.distributed is up.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    headers = [(read_index_header(prefix, key), key) for prefix, key in prefixes]
    stamps = [_stamp(h.prefix + ".bin") for h, _ in headers]
    # Rank 0 alone reads the cache and tells the others, so all ranks agree on what to scan.
    known = _load_scan_cache(cache_dir) if rank == 0 else {}
    cached: List[Optional[int]] = []
    for (header, _), stamp in zip(headers, stamps):
        entry = known.get(header.prefix + ".bin")
        fresh = isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("max_id"), int)
        cached.append(entry["max_id"] if fresh else None)
    if distributed:
        shared = [cached]
        dist.broadcast_object_list(shared, src=0)
        cached = shared[0]
    todo = [i for i, value in enumerate(cached) if value is None]
    maxima = [-1 if value is None else value for value in cached]
    if todo:
        local = _scan_max_ids([headers[i][0] for i in todo], rank, world)
        if distributed:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            reduced = torch.tensor(local, dtype=torch.int64, device=device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            local = reduced.cpu().tolist()
        for i, value in zip(todo, local):
            maxima[i] = int(value)
        if rank == 0 and cache_dir:
            for i in todo:
                path = headers[i][0].prefix + ".bin"
                known[path] = {"stamp": stamps[i], "max_id": maxima[i]}
            _save_scan_cache(cache_dir, known)
    for (header, key), max_id in zip(headers, maxima):
        if max_id >= vocab_size:
            raise ConfigError(f"token id {max_id} in {header.prefix}.bin is outside the model's vocabulary "
                              f"(size {vocab_size}): the data was made with another tokenizer than [tokenizer]",
                              path=header.prefix + ".bin", key=key)


def _stamp(path: str) -> List[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _scan_max_ids(headers: Sequence[Any], rank: int, world: int) -> List[int]:
    """This rank's share of the maxima: chunk ``c`` (counted over all files) belongs to rank ``c % world``."""
    out, chunk = [], 0
    for header in headers:
        tokens = np.memmap(header.prefix + ".bin", dtype=np.dtype(header.dtype), mode="r")
        best = -1
        for start in range(0, len(tokens), _SCAN_CHUNK):
            if chunk % world == rank:
                best = max(best, int(tokens[start:start + _SCAN_CHUNK].max()))
            chunk += 1
        del tokens
        out.append(best)
    return out


def _load_scan_cache(cache_dir: Optional[str]) -> Dict[str, Any]:
    if not cache_dir:
        return {}
    try:
        with open(os.path.join(cache_dir, TOKEN_SCAN_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: scan again


def _save_scan_cache(cache_dir: str, known: Dict[str, Any]) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, TOKEN_SCAN_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(known, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Fine-tuning data: prompt/answer pairs in jsonl files, tokenized on the fly
# ---------------------------------------------------------------------------------------------

#: A fine-tuning batch is padded to a multiple of this many tokens (capped at ``seq_length``): fewer
#: distinct shapes for the CUDA caching allocator and kernels, and tensor-core friendly sizes.
PAD_MULTIPLE = 8


def index_jsonl(path: str, prompt_key: str, answer_key: str) -> np.ndarray:
    """Byte ranges ``[start, end)`` and line numbers of the records of a jsonl file, one row each; blank
    lines are skipped.

    Every line is checked once here, as at submission (:func:`~bridge_hpc.training.datasets.jsonl_records.parse_jsonl_record`),
    so that a bad one stops the run at start-up rather than at the step that reads it, and a file
    changed since it was submitted is caught too: a line that is not a JSON object, or lacks either
    field, or whose field is not a string of text (a lone surrogate), is a ConfigError naming
    ``file:line`` and the config key of the field. So is a file with no records.
    """
    rows: List[Tuple[int, int, int]] = []
    position = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            start, position = position, position + len(raw)
            if not raw.strip():
                continue
            record = parse_jsonl_record(raw, prompt_key, answer_key)
            if isinstance(record, JsonlProblem):
                raise ConfigError(f"line {number} {record.problem}", path=f"{path}:{number}", key=record.key)
            rows.append((start, position, number))
    if not rows:
        raise ConfigError(f"{path} holds no records", path=path, key="dataset.dataset_root")
    return np.asarray(rows, dtype=np.int64)


class FinetuningDataset(Dataset):
    """Prompt/answer samples of one jsonl file, tokenized when read; see :class:`FinetuningDatasetConfig`.

    ``num_samples`` samples: sample ``i`` is record ``i mod records`` of pass ``i // records`` over the
    file, in file order, or with ``seed`` in a permutation drawn from ``(seed, pass)``; so any sample is
    found from its index alone, which is what exact resume needs. A sample holds ``tokens``, ``labels``,
    ``loss_mask`` and ``position_ids`` of its own length (at most ``seq_length``); :meth:`collate_fn`
    pads a batch of them to one length.
    """

    def __init__(self, path: str, tokenizer: Any, seq_length: int, prompt_key: str, answer_key: str,
                 num_samples: Optional[int] = None, seed: Optional[int] = None):
        self.path = path
        self.tokenizer = tokenizer
        self.eod = int(tokenizer.eod)
        self.seq_length = seq_length
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.records = index_jsonl(path, prompt_key, answer_key)
        self.num_samples = len(self.records) if num_samples is None else num_samples
        self.seed = seed
        self._order: Tuple[int, Optional[np.ndarray]] = (-1, None)
        self._fd: Optional[Tuple[int, int]] = None  # (pid, file descriptor): loader workers open their own

    def __len__(self) -> int:
        return self.num_samples

    def record(self, index: int) -> Dict[str, Any]:
        """The JSON record that sample ``index`` is made from.

        Checked again as it is read (the parse it needs anyway, and a UTF-8 encoding of its two fields):
        the file may have been changed since :func:`index_jsonl` indexed it, and its byte ranges then
        cut other text. Such a record is a ConfigError naming ``file:line`` (the line indexed there) and
        the key, not a bare exception of ``json`` or of the tokenizer.
        """
        passes, line = divmod(int(index), len(self.records))
        if self.seed is not None:
            if self._order[0] != passes:
                self._order = (passes, np.random.default_rng([self.seed, passes]).permutation(len(self.records)))
            line = int(self._order[1][line])
        start, end, number = (int(x) for x in self.records[line])
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), os.open(self.path, os.O_RDONLY))
        raw = os.pread(self._fd[1], end - start, start)
        record = parse_jsonl_record(raw, self.prompt_key, self.answer_key) if raw.strip() else JsonlProblem(
            "dataset.dataset_root", "is blank")
        if isinstance(record, JsonlProblem):
            raise ConfigError(f"line {number} {record.problem}; the file changed after the run indexed it at "
                              "start-up", path=f"{self.path}:{number}", key=record.key)
        return record

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        record = self.record(index)
        prompt = [int(t) for t in self.tokenizer.tokenize(record[self.prompt_key])]
        answer = [int(t) for t in self.tokenizer.tokenize(record[self.answer_key])] + [self.eod]
        excess = len(prompt) + len(answer) - (self.seq_length + 1)
        if excess > 0:
            cut = min(excess, len(prompt))
            prompt = prompt[cut:]
            answer = answer[:len(answer) - (excess - cut)]
        ids = torch.tensor(prompt + answer, dtype=torch.int64)
        # labels[i] is ids[i + 1]: it counts when that token belongs to the answer (or is its EOD).
        loss_mask = (torch.arange(1, len(ids)) >= len(prompt)).to(torch.float32)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(len(ids) - 1, dtype=torch.int64)}

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest sample has ``longest`` tokens is padded to."""
        return min(self.seq_length, -(-max(longest, 1) // PAD_MULTIPLE) * PAD_MULTIPLE)

    def collate_fn(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Stack ``samples``, padded at the end to :meth:`padded_length` of the longest. Padding gets the
        end-of-document id as token and label and ``loss_mask = 0``; under causal attention the real
        tokens before it never see it, so it changes no loss and no gradient."""
        length = self.padded_length(max(len(s["tokens"]) for s in samples))
        out = {"tokens": torch.full((len(samples), length), self.eod, dtype=torch.int64),
               "labels": torch.full((len(samples), length), self.eod, dtype=torch.int64),
               "loss_mask": torch.zeros((len(samples), length), dtype=torch.float32),
               "position_ids": torch.arange(length, dtype=torch.int64).repeat(len(samples), 1)}
        for row, sample in enumerate(samples):
            n = len(sample["tokens"])
            for key in ("tokens", "labels", "loss_mask"):
                out[key][row, :n] = sample[key]
        return out

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_fd"] = None  # a file descriptor means nothing in another process
        return state


def build_finetuning_datasets(config: FinetuningDatasetConfig, context: DatasetBuildContext) -> tuple:
    """``(train, valid, test)`` :class:`FinetuningDataset` of ``config``'s files; None for a split without one.

    ``config`` must have been validated (``seq_length`` filled). Every rank indexes the files itself
    (one read each, no shared cache to coordinate), and so every rank raises the same ConfigError for
    a bad line. The training split is sized for the run (or ``max_train_samples``) and shuffled per
    pass; validation and test are their files in order, read again from the start when exhausted.
    """
    if context.tokenizer is None:
        raise ValueError("FinetuningDatasetConfig needs the run's tokenizer: build it with "
                         "bridge_hpc.training.tokenizers.build_tokenizer_for(cfg) and pass it to build_datasets")

    def split(name: str, wanted: int, num_samples: Optional[int] = None, seed: Optional[int] = None):
        path = config.split_path(name)
        if path is None or wanted <= 0:
            return None
        return FinetuningDataset(path, context.tokenizer, config.seq_length, config.prompt_key, config.answer_key,
                                 num_samples=num_samples, seed=seed)

    train_samples = config.max_train_samples or context.train_samples
    return (split("train", context.train_samples, train_samples, config.seed),
            split("valid", context.valid_samples), split("test", context.test_samples))


#: Each built-in dataset config type -> the function that builds its datasets on the ranks. The
#: configs stay torch-free and never import a builder; :func:`build_datasets` looks the type up here
#: (FIM data is indexed data: :func:`build_gpt_datasets` reads its ``fim_*`` fields).
BUILDERS: Dict[type, Callable[[Any, DatasetBuildContext], tuple]] = {
    MockGPTDatasetConfig: build_mock_datasets,
    GPTDatasetConfig: build_gpt_datasets,
    FinetuningDatasetConfig: build_finetuning_datasets,
}
