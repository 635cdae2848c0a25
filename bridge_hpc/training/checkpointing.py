"""Crash-safe checkpoints: a folder per iteration that is either complete or invisible, verified before
it is loaded.

Layout under ``checkpoint.save``::

    latest_checkpointed_iteration.txt   # the iteration to resume from (Megatron's tracker), replaced atomically
    .lock                               # flock'ed by rank 0 of the job training into this folder
    iter_0000020/
        .metadata, __0_0.distcp, ...    # model + optimizer (torch.distributed.checkpoint format)
        rank_00000.pt, rank_00001.pt    # per rank: python/numpy/torch RNG states, data position
        run_config.json                 # the resolved configuration
        train_state.pt                  # train_state, scheduler, iteration (rank 0)
        manifest.json                   # every other file with its size in bytes; written last
    iter_0000010.damaged/               # a checkpoint that failed verification or loading, set aside

Write protocol (what makes a SIGKILL at any instant harmless): every rank writes into
``iter_XXXXXXX.tmp`` and fsyncs the files it wrote; after the ranks agree that all writes succeeded,
rank 0 writes ``train_state.pt``, then ``manifest.json`` (both fsynced), fsyncs the folder, renames it
to ``iter_XXXXXXX``, fsyncs the parent, and only then replaces the tracker (write temp, fsync, rename,
fsync parent). A ``.tmp`` folder is never loaded; old checkpoints beyond ``most_recent_k`` are renamed
to ``*.del`` before deletion, so a half-deleted folder never looks complete either. With
``checkpoint.async_save`` the same protocol runs with the shard write in a background process per rank
(:mod:`bridge_hpc.training.async_checkpoint`): :func:`begin_save` and :func:`write_rank_state` at the
save's iteration, :func:`commit_save` steps later, once every rank's shards are durable.

A failed write on any rank (a full disk, a quota, an I/O error) is agreed on by all ranks at the end
of each phase of the save, so every rank raises :class:`CheckpointSaveError` with the cause within
seconds instead of the healthy ranks waiting forever in the next collective for the failed one.

Load: rank 0 picks the checkpoint and every other rank follows it (one broadcast), so all ranks enter
the collective load of the same folder. The tracker is obeyed when it names a complete checkpoint,
also an older one than the newest (a user rolling back after a loss spike, as in Megatron); when it
is missing, unreadable or names no complete checkpoint, the newest complete one is used. Before
loading, rank 0 checks the folder against its manifest (:func:`verify_checkpoint`: sizes only,
cheap); a damaged one, or one whose load fails on any rank, is renamed to ``*.damaged`` (never
deleted), reported on stderr and in progress.txt (``Checkpoint fallback``), and the next older
complete checkpoint is tried. Folders of format 1 (no manifest) are still read; for them only the
presence and non-emptiness of the files can be checked.

Back ends: without CUDA the model and optimizer go through ``torch.distributed.checkpoint``
(torch-native DDP and optimizer); on CUDA through megatron-core's ``dist_checkpointing`` with
megatron's DDP and optimizer. Everything else is shared.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import fcntl
import glob
import io
import json
import logging
import os
import queue
import random
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.slurm.job_environment import JobEnvironment
from bridge_hpc.training import parallel
from bridge_hpc.training.state import GlobalState

logger = logging.getLogger(__name__)

TRACKER = run_folder.TRACKER_FILE
#: Written by rank 0 once every rank's files are durable (not ``common.pt``: megatron-core's
#: dist_checkpointing writes a file of that name itself).
COMMON_FILE = "train_state.pt"
#: Written last into a checkpoint folder (format 2): every other file of the folder with its size.
#: Its presence marks the folder complete; the sizes let a load find a truncated or missing file
#: before any rank reads it.
MANIFEST_FILE = "manifest.json"
#: The resolved configuration of the run that saved (rank 0); the loader reads the optimizer layout from it.
RUN_CONFIG_FILE = "run_config.json"
#: Suffix of a checkpoint folder set aside because it failed verification or loading.
DAMAGED_SUFFIX = ".damaged"
_ITER_RE = run_folder.ITERATION_DIR_RE
FORMAT_VERSION = 2
#: A save failure with less free space than this on the file system is reported as a full disk even
#: when the OSError itself was lost on the way (megatron's writers and torch's zip writer replace it).
_NEARLY_FULL_BYTES = 1 << 20
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed on some rank; raised on every rank with the same one-line message."""


class CheckpointLoadError(RuntimeError):
    """No checkpoint under ``checkpoint.load`` can be loaded, although some exist (all damaged)."""


class CheckpointFolderInUse(RuntimeError):
    """Another process holds the checkpoint folder's lock: two jobs would write the same checkpoints."""


iteration_dir = run_folder.iteration_dir


# ---------------------------------------------------------------------------------------------
# Filesystem primitives
# ---------------------------------------------------------------------------------------------


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: str, data: bytes) -> None:
    """Write, flush and fsync ``path``. An OSError is raised again with ``path`` as its filename: the
    one from ``write`` names no file, and "no space left on device" alone does not say where."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror, path) from err


def _torch_save_durable(obj: Any, path: str) -> None:
    # Serialized in memory first: torch.save straight into a file that hits a full disk reports
    # "unexpected pos 704 vs 598" (its zip writer) instead of the OSError.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_durable(path, buffer.getvalue())


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    _write_durable(tmp, f"{iteration}\n".encode())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_path(root)


def _is_complete(path: str) -> bool:
    """Named like a checkpoint and renamed from ``.tmp`` (it has a manifest, or, format 1, a
    ``train_state.pt``). Complete is not the same as loadable: see :func:`verify_checkpoint`."""
    return _ITER_RE.match(os.path.basename(path)) is not None and (
        os.path.isfile(os.path.join(path, MANIFEST_FILE)) or os.path.isfile(os.path.join(path, COMMON_FILE)))


def complete_iterations(root: str) -> List[int]:
    """Iterations with a complete checkpoint folder under ``root``, ascending."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITER_RE.match(name)
        if match and _is_complete(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def _load_order(root: str) -> Tuple[List[str], Optional[int], Optional[str]]:
    """The complete checkpoint folders to try, best first, the tracker's iteration (None: unusable),
    and a warning about the tracker (or None).

    A tracker naming a complete checkpoint is obeyed and only older ones are fallbacks (Megatron's
    rule: a user rolls back by writing an older iteration into it; a kill between a save's rename
    and its tracker update also leaves the tracker one checkpoint behind, which is as good).
    Otherwise every complete checkpoint is a candidate, newest first.
    """
    iterations = complete_iterations(root)
    tracked, problem = run_folder.read_tracker(root)
    if tracked is not None and tracked in iterations:
        newer = [i for i in iterations if i > tracked]
        if newer:
            logger.info("%s names iteration %d: newer checkpoints %s are ignored", TRACKER, tracked, newer)
        chosen = [tracked] + [i for i in reversed(iterations) if i < tracked]
        return [iteration_dir(root, i) for i in chosen], tracked, None
    if tracked is not None:
        problem = f"{TRACKER} names iteration {tracked}, which has no complete checkpoint"
    warning = None
    if iterations and problem:
        warning = f"{problem} in {root}; using the newest complete checkpoint"
    return [iteration_dir(root, i) for i in reversed(iterations)], tracked, warning


def verify_checkpoint(path: str, world_size: Optional[int] = None) -> Optional[str]:
    """None if the checkpoint folder ``path`` looks loadable, else one line naming the damaged file.

    Format 2: every file in the manifest is there with the size the manifest gives. Format 1 (no
    manifest): ``train_state.pt`` loads, ``.metadata`` is not empty, and every rank of the world size
    that saved it has its non-empty ``rank_*.pt``. Only sizes are checked, no shard is read, so a
    shard corrupted at its full size passes here and fails in the load (which falls back as well).
    ``world_size``: this run's; a different one than the checkpoint's is a resharding, not damage.
    """
    name = os.path.basename(os.path.normpath(path))
    if not os.path.isdir(path):
        return f"{name} missing"
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest_path):
        return _verify_format_1(path, name)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = {str(rel): int(size) for rel, size in manifest["files"].items()}
        saved_iteration = int(manifest["iteration"])
        saved_world = int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{name}/{MANIFEST_FILE} unreadable ({type(err).__name__}: {err})"
    match = _ITER_RE.match(name)
    if match and int(match.group(1)) != saved_iteration:
        return f"{name}/{MANIFEST_FILE} is of iteration {saved_iteration}"
    for rel, size in sorted(files.items()):
        try:
            actual = os.stat(os.path.join(path, rel)).st_size
        except FileNotFoundError:
            return f"{name}/{rel} missing"
        except OSError as err:
            return f"{name}/{rel} unreadable ({err.strerror})"
        if actual != size:
            return f"{name}/{rel}: {actual} bytes, manifest says {size}"
    if world_size is None or world_size == saved_world:  # else resharding: rank states do not carry over
        for rank in range(saved_world):
            if f"rank_{rank:05d}.pt" not in files:
                return f"{name}/{MANIFEST_FILE} lists no rank_{rank:05d}.pt"
    return None


def _verify_format_1(path: str, name: str) -> Optional[str]:
    common = os.path.join(path, COMMON_FILE)
    if not os.path.exists(common):
        return f"{name}/{MANIFEST_FILE} missing"
    try:
        version = int(torch.load(common, weights_only=False).get("format_version", 1))
    except Exception as err:  # noqa: BLE001 - any failure to read it makes the folder unusable
        return f"{name}/{COMMON_FILE} unreadable ({type(err).__name__})"
    if version >= 2:  # written with a manifest, which is gone
        return f"{name}/{MANIFEST_FILE} missing"
    for required in (".metadata", "rank_00000.pt"):
        problem = _empty_or_missing(path, name, required)
        if problem:
            return problem
    try:
        saved_world = int(torch.load(os.path.join(path, "rank_00000.pt"), weights_only=False)["world_size"])
    except Exception as err:  # noqa: BLE001
        return f"{name}/rank_00000.pt unreadable ({type(err).__name__})"
    for rank in range(1, saved_world):
        problem = _empty_or_missing(path, name, f"rank_{rank:05d}.pt")
        if problem:
            return problem
    return None


def _empty_or_missing(path: str, name: str, rel: str) -> Optional[str]:
    try:
        size = os.stat(os.path.join(path, rel)).st_size
    except FileNotFoundError:
        return f"{name}/{rel} missing"
    except OSError as err:
        return f"{name}/{rel} unreadable ({err.strerror})"
    return f"{name}/{rel} is empty" if size == 0 else None


def find_latest_checkpoint(root: str, world_size: Optional[int] = None) -> Optional[str]:
    """The checkpoint folder a run resuming from ``root`` loads (if it loads), or None. Read-only.

    The tracker's if it names a complete checkpoint that verifies, else the newest older (or, with
    an unusable tracker, newest) complete one that verifies. :func:`load_checkpoint` picks the same
    folder, and in addition sets damaged ones aside.
    """
    if not root or not os.path.isdir(root):
        return None
    order, _, _ = _load_order(root)
    for path in order:
        if verify_checkpoint(path, world_size) is None:
            return path
    return None


def _resolve_checkpoint_dir(path: str) -> Optional[str]:
    """``path`` itself if it is an iteration folder, else its newest complete checkpoint."""
    if _is_complete(path):
        return path
    return find_latest_checkpoint(path)


def _set_aside(path: str) -> str:
    """Rename ``path`` to ``path.damaged`` (``.damaged.1``, ... if taken); returns the new path."""
    target = path + DAMAGED_SUFFIX
    count = 0
    while os.path.exists(target):
        count += 1
        target = f"{path}{DAMAGED_SUFFIX}.{count}"
    os.replace(path, target)
    _fsync_path(os.path.dirname(path) or ".")
    return target


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_errors(error: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's error (None: it succeeded), as (rank, error) pairs of the ranks that failed
    (collective). It doubles as the barrier between the phases of a save."""
    if not dist.is_initialized():
        return [] if error is None else [(0, error)]
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return [(rank, e) for rank, e in enumerate(errors) if e is not None]


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# Lock on the checkpoint folder
# ---------------------------------------------------------------------------------------------

#: Lock file path -> open descriptor holding its flock, for the life of this process's training. An
#: in-process restart re-enters pretrain in the same process; a second ``open`` + ``flock`` there
#: would conflict with the first descriptor, so the held one is reused.
_held_locks: Dict[str, int] = {}
#: How long a taken lock is retried before the folder counts as in use: the flock belongs to the open
#: file, which forked children of the previous holder (DataLoader workers) share until they notice
#: its death and exit, seconds after it; an in-job restart must not take that for another job.
_LOCK_GRACE_S = 10.0


def lock_checkpoint_folder(root: str) -> None:
    """Rank 0 takes an exclusive ``flock`` on ``root/.lock`` for as long as this process trains; if
    another process holds it, every rank raises :class:`CheckpointFolderInUse` naming the holder
    (collective). Two jobs saving into one folder would overwrite each other's checkpoints and
    tracker. The kernel drops the lock when the holder dies, so a requeued job or an in-job restart
    (new processes) is never locked out by its dead predecessor."""
    error = None
    if _rank() == 0:
        try:
            error = _try_lock(root)
        except OSError as err:  # rank 0 must still reach the broadcast, or the others wait in it
            error = f"cannot lock checkpoint folder {root}: {err}"
    error = _from_rank0(error)
    if error is not None:
        raise CheckpointFolderInUse(error)


def _try_lock(root: str) -> Optional[str]:
    os.makedirs(root, exist_ok=True)
    path = os.path.realpath(os.path.join(root, run_folder.CHECKPOINT_LOCK))
    if path in _held_locks:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + _LOCK_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)  # e.g. a Lustre mount without flock support: train unlocked rather than not at all
                logger.warning("cannot lock %s (%s): two jobs on this checkpoint folder would not be stopped",
                               path, err)
                return None
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown holder"
                os.close(fd)
                return (f"checkpoint folder {root} is in use by another job (lock {path} held by {holder}); "
                        f"two jobs must not train into the same checkpoint folder")
            time.sleep(0.5)
    env = JobEnvironment.from_env()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {env.hostname}, Slurm job {env.job_id or 'none'}\n".encode(), 0)
    except OSError as err:  # the lock is held all the same; only the note for the next job is lost
        logger.warning("could not write the holder into %s: %s", path, err)
    _held_locks[path] = fd
    return None


def release_checkpoint_folder(root: str) -> None:
    """Drop this process's lock on ``root`` (no-op where it holds none)."""
    path = os.path.realpath(os.path.join(root, run_folder.CHECKPOINT_LOCK))
    fd = _held_locks.pop(path, None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


# ---------------------------------------------------------------------------------------------
# Model and optimizer back ends
# ---------------------------------------------------------------------------------------------


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _uses_megatron_dist(model) -> bool:
    return torch.cuda.is_available() and hasattr(_unwrap(model[0]), "sharded_state_dict") and not isinstance(
        model[0], torch.nn.parallel.DistributedDataParallel)


def _without_empty_extra_state(model_sd: Dict[str, Any]) -> Dict[str, Any]:
    """megatron-core's linear layers report ``_extra_state = None`` (a Transformer Engine slot);
    DCP cannot store None, and there is nothing to store."""
    return {key: value for key, value in model_sd.items() if value is not None}


def _dcp_writer(path: str):
    """DCP's file writer, with a full disk reported as an OSError naming the file. DCP gathers a
    rank's write error to every rank by pickling it, which drops the chained OSError that torch's zip
    writer raises its "unexpected pos" RuntimeError from; an OSError's errno and filename survive."""
    import torch.distributed.checkpoint as dcp

    class _Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as exc:
                raise _naming_file(exc, _newest(glob.glob(os.path.join(path, f"__{_rank()}_*.distcp"))) or path) from exc

        def finish(self, metadata, results):
            try:
                return super().finish(metadata, results)
            except Exception as exc:
                raise _naming_file(exc, os.path.join(path, ".metadata")) from exc

    return _Writer(path, sync_files=True)


def _newest(paths: List[str]) -> Optional[str]:
    existing = [p for p in paths if os.path.exists(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def _naming_file(exc: BaseException, path: str) -> BaseException:
    space = _space_error(exc)
    if space is None:
        return exc
    return OSError(space.errno, os.strerror(space.errno), space.filename or path)


#: Threads that read a checkpoint being loaded (each its share of the items, balanced by bytes):
#: one reader alternates reading, unpickling and copying into the model, leaving the disk idle.
LOAD_READ_THREADS = 4


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """A synchronous megatron-core save collects its write results in-process.

    megatron-core's ``FileSystemWriterAsync`` gathers the results of its write processes in a queue
    of a ``multiprocessing`` Manager started with *spawn* at the first save of the process (its
    ``_get_write_results_queue``): the child re-imports torch and megatron, 8.6-21 s on an H100
    host, all of it inside the first save. A synchronous save runs the write in this process, where
    a plain queue does. Where an asynchronous writer started its Manager queue already (at start-up,
    :mod:`bridge_hpc.training.async_checkpoint`), that one is used; versions without the module
    global are left alone."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def _parallel_reader(base: type) -> type:
    """``base`` (a DCP ``FileSystemReader``) reading the items of a load in :data:`LOAD_READ_THREADS`
    threads. Each thread runs ``base.read_data`` on its share of the plan (items balanced by bytes,
    in file order), so the reading itself stays torch's; file reads, unpickling and the copies into
    the model release the GIL."""

    class _ParallelReader(base):
        def read_data(self, plan, planner):
            items = list(plan.items)
            count = min(LOAD_READ_THREADS, len(items))
            if count <= 1:
                return super().read_data(plan, planner)
            info = self.storage_data
            groups: List[list] = [[] for _ in range(count)]
            sizes = [0] * count
            for item in sorted(items, key=lambda i: -info[i.storage_index].length):
                k = sizes.index(min(sizes))
                groups[k].append(item)
                sizes[k] += info[item.storage_index].length
            read = super().read_data
            with ThreadPoolExecutor(count, thread_name_prefix="ckpt-read") as pool:
                futures = [pool.submit(read, dataclasses.replace(plan, items=sorted(
                    group, key=lambda i: (info[i.storage_index].relative_path, info[i.storage_index].offset))),
                    planner) for group in groups]
                for future in futures:
                    future.result().wait()  # raises the first failed read's error here
            done: Future = Future()
            done.set_result(None)
            return done

    _ParallelReader.__name__ = _ParallelReader.__qualname__ = f"Parallel{base.__name__}"
    return _ParallelReader


def _megatron_load_strategy():
    """megatron-core's torch_dist load, its file reads in :data:`LOAD_READ_THREADS` threads, and
    with several data-parallel ranks fully parallel (``FullyParallelLoadStrategyWrapper``: each rank
    reads a share of the replicated tensors and they exchange them, instead of every rank reading
    everything)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    class _ParallelReadsLoad(mcore_torch.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
            # The strategy builds its reader inside load() through this module function (0.16-0.19);
            # it is swapped for the call only. Without it, torch's one-thread reader is used.
            # (0.19 adds arguments, e.g. async_strategy: passed on as given.)
            make_reader = getattr(mcore_torch, "_get_filesystem_reader", None)
            if make_reader is None:
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

            def parallel(checkpoint_dir, *args, **kwargs):
                reader = make_reader(checkpoint_dir, *args, **kwargs)
                reader.__class__ = _parallel_reader(type(reader))
                return reader

            mcore_torch._get_filesystem_reader = parallel
            try:
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            finally:
                mcore_torch._get_filesystem_reader = make_reader

    strategy = _ParallelReadsLoad()
    if parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelLoadStrategyWrapper(strategy, parallel_state.get_data_parallel_group())
    return strategy


#: How megatron-core's distributed optimizer lays out its state in a checkpoint, by
#: ``checkpoint.dist_ckpt_optim_fully_reshardable``. Off: each rank's buffers as they are (parallel
#: save and load without gathers; reshardable across data parallelism only), as Megatron-LM does by
#: default. On: ``fully_reshardable``, loadable at any tensor/pipeline/data-parallel layout.
#: megatron-core's own default, ``fully_sharded_model_space``, is deprecated and fails to save in
#: 0.19 (``ShardedTensor.flattened_range is not supported``).
DISTRIB_OPTIM_SHARDING_TYPES = {False: "dp_reshardable", True: "fully_reshardable"}


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False,
                                 fully_reshardable: bool = False):
    """The megatron-core optimizer's sharded state dict, in the layout of
    :data:`DISTRIB_OPTIM_SHARDING_TYPES` where it is the distributed optimizer (the others are keyed
    by parameter and load at any layout)."""
    if _is_distributed_optimizer(optimizer):
        sharding = DISTRIB_OPTIM_SHARDING_TYPES[bool(fully_reshardable)]
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                            metadata={"distrib_optim_sharding_type": sharding})
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)


def _init_empty_distributed_optimizer_state(optimizer) -> list:
    """Give a fresh distributed optimizer's inner torch Adam placeholder state while the state dict
    to load into is built: megatron-core's ``DistributedOptimizer.state_dict`` reads every parameter's
    ``step`` without Apex or Transformer Engine and asserts they agree, and a fresh optimizer has
    none. Zeros, as torch's Adam makes them at its first step. Returns the state dicts it filled,
    which the caller empties again before ``load_state_dict``: megatron allocates an empty
    optimizer's state there itself (and does not expect it filled)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    filled = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer) or len(inner.optimizer.state) > 0:
            continue
        torch_opt = inner.optimizer
        filled.append(torch_opt.state)
        for group in torch_opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = torch_opt.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return filled


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer) -> Iterator[None]:
    """While a distributed optimizer loads its parameter state: megatron-core's
    ``_set_main_param_and_optimizer_states`` copies into every tensor of a parameter's torch Adam
    state, ``step`` included, from loaded tensors that never hold ``step`` (it comes from the
    parameter groups, set just before), and fails with KeyError 'step' without Apex/TE. Here a state
    tensor missing from the loaded ones is copied onto itself: ``step`` keeps the groups' value."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               if isinstance(inner, DistributedOptimizer) and not inner.config.use_precision_aware_optimizer]
    for inner in patched:
        def set_states(model_param, tensors, __inner=inner, __set=inner._set_main_param_and_optimizer_states):
            group_index, group_order = __inner.model_param_group_index_map[model_param]
            main_param = __inner.optimizer.param_groups[group_index]["params"][group_order]
            current = __inner.optimizer.state[main_param]
            return __set(model_param, {**{k: v for k, v in current.items() if isinstance(v, torch.Tensor)}, **tensors})

        inner._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states  # the class's method again


def model_sharded_state_dict(model) -> dict:
    """The model's sharded state dict: ``{"model": ...}``, or with virtual pipeline stages
    ``{"model0": ..., "model1": ...}``, one per chunk (Megatron-LM's keys). Tensor keys are global
    (layer numbers counted over the whole model), so the state loads at another layout."""
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def megatron_sharded_state(model, optimizer, save_optim: bool, fully_reshardable: bool = False) -> dict:
    """What a megatron-core (GPU) save writes: the model's sharded state dict, and the optimizer's."""
    sharded = model_sharded_state_dict(model)
    if save_optim:
        sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(sharded),
                                                            fully_reshardable=fully_reshardable)
    return sharded


def megatron_save_tensors(model, optimizer, save_optim: bool, fully_reshardable: bool = False) -> List[torch.Tensor]:
    """Every GPU tensor a megatron-core save writes, i.e. copies to host memory first."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded = megatron_sharded_state(model, optimizer, save_optim, fully_reshardable)
    return [v.data.detach() for v in nested_values(sharded)
            if isinstance(v, ShardedTensor) and isinstance(v.data, torch.Tensor) and v.data.is_cuda]


def warm_up_host_buffers(tensors: List[torch.Tensor]) -> threading.Thread:
    """Pin host memory for a copy of each of ``tensors`` and give it back to torch's caching host
    allocator, in a background thread; returns the thread (a save waits for it: ``join``).

    Why: a synchronous save copies every tensor to pinned host memory (megatron-core's
    ``preload_tensors``), and the first save of a process pins all of it first: 2.66 s of an 8.15 s
    save of the 370 M GPT's 5.2 GB on an H100, 0.1 s in later saves, which reuse the cached blocks
    (benchmarks/checkpoint.py). An exit save is often a rank's first synchronous save, inside Slurm's
    grace time. The blocks pinned here have the sizes the save asks for, so its copies find them
    cached. The rank holds that much pinned host memory from then on, as after its first save."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    device = torch.cuda.current_device()

    def pin() -> None:
        torch.cuda.set_device(device)  # a new thread's device is 0: no context on another rank's GPU
        started = time.perf_counter()
        try:
            blocks = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
        except RuntimeError as err:  # host memory short: the save pins what it needs itself, as before
            logger.warning("could not pin %.2f GB of host memory ahead of synchronous saves (%s); the first "
                           "such save pins it itself", sum(sizes) / 1e9, _one_line(str(err)))
            return
        del blocks
        logger.info("pinned %.2f GB of host memory for synchronous saves in %.2fs", sum(sizes) / 1e9,
                    time.perf_counter() - started)

    thread = threading.Thread(target=pin, name="bridge-pin-host", daemon=True)
    thread.start()
    return thread


@dataclasses.dataclass(frozen=True)
class SavedParallelism:
    """How a checkpoint was laid out, from its ``run_config.json``: the model-parallel sizes
    (:func:`bridge_hpc.training.parallel.model_parallel_sizes`'s keys) and whether the distributed
    optimizer's state was saved ``fully_reshardable``."""

    sizes: Dict[str, int]
    fully_reshardable: bool


def saved_parallelism(path: str) -> Optional[SavedParallelism]:
    """:class:`SavedParallelism` of the checkpoint at ``path``; None where its config cannot be read."""
    try:
        with open(os.path.join(path, RUN_CONFIG_FILE)) as f:
            saved = json.load(f)
        m, c = saved.get("model", {}), saved.get("checkpoint", {})
    except (OSError, ValueError, AttributeError):
        return None
    return SavedParallelism(
        sizes={"tp": m.get("tensor_model_parallel_size", 1), "pp": m.get("pipeline_model_parallel_size", 1),
               "cp": m.get("context_parallel_size", 1)},
        fully_reshardable=bool(c.get("dist_ckpt_optim_fully_reshardable", False)))


def check_optimizer_layout(path: str, saved: Optional[SavedParallelism], now: Dict[str, int], optimizer,
                           load_optim: bool) -> None:
    """Raises ConfigError, before anything is loaded, where the distributed optimizer's state in the
    checkpoint at ``path`` cannot load at this run's model-parallel sizes ``now``: saved per rank
    (``dp_reshardable``) at other tensor/pipeline/context-parallel sizes."""
    if (load_optim and saved is not None and not saved.fully_reshardable and saved.sizes != now
            and _is_distributed_optimizer(optimizer)):
        raise ConfigError(
            f"{path} holds the distributed optimizer's state per rank (dp_reshardable), saved at tensor/pipeline/"
            f"context-parallel sizes {saved.sizes['tp']}/{saved.sizes['pp']}/{saved.sizes['cp']}; this run is "
            f"{now['tp']}/{now['pp']}/{now['cp']}. Resume at the saved sizes, load the weights only "
            "(checkpoint.load_optim = false), or save with checkpoint.dist_ckpt_optim_fully_reshardable = true",
            key="checkpoint.load_optim")


def _save_model_and_optimizer(model, optimizer, path: str, save_optim: bool, writers: int,
                              fully_reshardable: bool = False) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        sharded = megatron_sharded_state(model, optimizer, save_optim, fully_reshardable)
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writers)
        with _in_process_write_results():
            dist_checkpointing.save(sharded, path, sharded_strategy=strategy)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    state = {"model": _without_empty_extra_state(model_sd)}
    if save_optim:
        state["optimizer"] = optim_sd
    dcp.save(state, storage_writer=_dcp_writer(path))


def _load_model_and_optimizer(model, optimizer, path: str, load_optim: bool, fully_reshardable: bool = False) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing

        sharded = model_sharded_state_dict(model)
        if load_optim:
            placeholders = _init_empty_distributed_optimizer_state(optimizer)
            sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(sharded), is_loading=True,
                                                                fully_reshardable=fully_reshardable)
            for state in placeholders:  # megatron's load_state_dict allocates the state of an empty optimizer
                state.clear()
        loaded = dist_checkpointing.load(sharded, path, sharded_strategy=_megatron_load_strategy())
        if len(model) == 1:
            _unwrap(model[0]).load_state_dict(loaded["model"])
        else:
            for i, chunk in enumerate(model):
                _unwrap(chunk).load_state_dict(loaded[f"model{i}"])
        if load_optim:
            with _torch_adam_step_kept(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    if load_optim:
        model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    else:
        # Not get_state_dict: it initializes an empty optimizer state by running a step with zero
        # gradients, after which Adam's first real update of a fresh optimizer is scaled as its second.
        model_sd, optim_sd = get_model_state_dict(model[0]), None
    state = {"model": _without_empty_extra_state(model_sd)}
    if load_optim:
        state["optimizer"] = optim_sd
    dcp.load(state, storage_reader=_parallel_reader(dcp.FileSystemReader)(path))
    state["model"].update({key: None for key, value in model_sd.items() if value is None})
    _unwrap(model[0]).load_state_dict(state["model"], strict=True)
    if load_optim:
        set_state_dict(model[0], optimizer.optimizer, model_state_dict={}, optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        # With CUDA graphs the tracker's states are graph-safe generators (pretrain.set_random_seed):
        # saved as their state tensors, so that a run with and a run without graphs load each other's.
        state["rng_tracker"] = {name: s.get_state() if isinstance(s, torch.Generator) else s
                                for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tracker = tensor_parallel.get_cuda_rng_tracker()
        current = tracker.get_states()
        for name, saved in state["rng_tracker"].items():
            if isinstance(current.get(name), torch.Generator):
                current[name].set_state(saved)  # the generator a captured graph reads stays the same object
            else:
                current[name] = saved
        tracker.set_states(current)


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _space_error(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC / EDQUOT OSError behind ``exc`` (its causes, contexts, and the per-rank failures
    of a torch.distributed.checkpoint CheckpointException), or None."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _SPACE_ERRNOS:
            return current
        todo += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]
    return None


def _free_bytes(path: str) -> Optional[int]:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _describe_save_error(exc: BaseException, folder: str) -> str:
    """One line: the cause of a failed save, naming the file where known."""
    space = _space_error(exc)
    if space is not None:
        return f"{os.strerror(space.errno).lower()} writing {space.filename or folder}"
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = next(iter(exc.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        what = f"{type(inner).__name__} on rank {rank}: {inner}"
    else:
        what = f"{type(exc).__name__}: {exc}"
    free = _free_bytes(folder)
    if free is not None and free < _NEARLY_FULL_BYTES:
        return f"no space left on device writing {folder} ({free} bytes free; {_one_line(what, 200)})"
    return _one_line(what)


def save_checkpoint(state: GlobalState, model, optimizer, scheduler, train_data_iterator=None) -> str:
    """Save iteration ``state.train_state.step`` under ``checkpoint.save``; returns the folder.

    Collective: every rank must call it at the same iteration. A failure on any rank raises
    :class:`CheckpointSaveError` on every rank; the previous checkpoints are untouched then.
    (``checkpoint.async_save`` runs the same protocol with the write in the background:
    :mod:`bridge_hpc.training.async_checkpoint`.)
    """
    save = begin_save(state, scheduler)

    def write() -> None:
        ckpt = state.cfg.checkpoint
        _save_model_and_optimizer(model, optimizer, save.tmp, ckpt.save_optim, ckpt.storage_writers_per_rank,
                                  ckpt.dist_ckpt_optim_fully_reshardable)  # collective
        write_rank_state(save, state, train_data_iterator)
        _fsync_written_files(save.tmp)

    _save_phase(write, save.iteration, save.tmp)
    return commit_save(save)


@dataclass
class SaveInProgress:
    """One save between its start and its commit: where it writes and what rank 0 commits.

    ``common`` (the content of ``train_state.pt``) is taken when the save starts, so that a save
    committed steps later (``checkpoint.async_save``) records the iteration it holds.
    """

    iteration: int
    root: str
    final: str
    tmp: str
    world_size: int
    most_recent_k: int
    common: Dict[str, Any]
    started: float  # time.perf_counter() when the save began


def begin_save(state: GlobalState, scheduler) -> SaveInProgress:
    """Start a save of the current iteration: rank 0 removes stale ``iter_*.tmp``/``*.del`` folders
    and creates ``iter_N.tmp``. Collective; a failure raises :class:`CheckpointSaveError` on every rank."""
    cfg = state.cfg.checkpoint
    iteration = state.train_state.step
    final = iteration_dir(cfg.save, iteration)
    common = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "train_state": state.train_state.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    ft = state.fault_tolerance
    if ft is not None:  # computed FT timeouts travel with the checkpoint (see fault_tolerance.py)
        common["fault_tolerance"] = ft.state_dict()
    save = SaveInProgress(iteration=iteration, root=cfg.save, final=final, tmp=final + ".tmp",
                          world_size=_world_size(), most_recent_k=cfg.most_recent_k, common=copy.deepcopy(common),
                          started=time.perf_counter())

    def prepare() -> None:
        os.makedirs(save.root, exist_ok=True)
        for stale in glob.glob(os.path.join(save.root, "iter_*.tmp")) + glob.glob(os.path.join(save.root, "iter_*.del")):
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(save.tmp)

    _save_phase(prepare if _rank() == 0 else None, iteration, save.tmp)
    return save


def write_rank_state(save: SaveInProgress, state: GlobalState, train_data_iterator=None) -> None:
    """This rank's ``rank_NNNNN.pt`` (RNG states, data position) and, on rank 0, ``run_config.json``,
    both durable. Taken at the save's iteration: the next step draws random numbers and reads data."""
    cfg = state.cfg.checkpoint
    rank = _rank()
    per_rank = {"rank": rank, "world_size": save.world_size}
    if cfg.save_rng:
        per_rank["rng"] = _rng_state()
    if train_data_iterator is not None and hasattr(train_data_iterator, "state_dict"):
        per_rank["data"] = train_data_iterator.state_dict()
    _torch_save_durable(per_rank, os.path.join(save.tmp, f"rank_{rank:05d}.pt"))
    if rank == 0:
        config = json.dumps(state.cfg.to_dict(), indent=2, default=str)
        _write_durable(os.path.join(save.tmp, RUN_CONFIG_FILE), config.encode())


def _fsync_written_files(tmp: str) -> None:
    """fsync this rank's shards and, on rank 0, the model/optimizer writer's files that belong to no
    rank in particular (e.g. ``.metadata``)."""
    rank = _rank()
    if rank == 0:
        for path in glob.glob(os.path.join(tmp, "*")) + glob.glob(os.path.join(tmp, ".*")):
            if os.path.isfile(path) and not re.match(r"^(__\d+_\d+\.distcp|rank_\d+\.pt)$", os.path.basename(path)):
                _fsync_path(path)
    for path in glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")):
        _fsync_path(path)


def commit_save(save: SaveInProgress) -> str:
    """Make ``save`` the checkpoint to resume from; returns its folder. Collective, and only once every
    rank's files are durable: rank 0 writes ``train_state.pt`` and the manifest, renames the folder,
    replaces the tracker, then removes checkpoints beyond ``most_recent_k``."""
    rank = _rank()

    def commit() -> None:
        tmp, final = save.tmp, save.final
        _torch_save_durable(save.common, os.path.join(tmp, COMMON_FILE))
        _write_manifest(tmp, save.iteration, save.world_size)
        _fsync_path(tmp)
        if os.path.isdir(final):  # re-saving an iteration (after a rollback or a resume): swap it whole
            problem = verify_checkpoint(final, save.world_size)
            if problem is None:
                os.replace(final, final + ".del")
            else:  # never delete a damaged checkpoint: someone may want to look at it
                logger.warning("%s is damaged (%s): set aside as %s", final, problem, _set_aside(final))
        os.replace(tmp, final)
        _fsync_path(save.root)
        _write_tracker(save.root, save.iteration)

    _save_phase(commit if rank == 0 else None, save.iteration, save.tmp)
    if rank == 0:
        shutil.rmtree(save.final + ".del", ignore_errors=True)
        try:
            _remove_old_checkpoints(save.root, save.most_recent_k, save.iteration, save.world_size)
        except OSError as err:  # the new checkpoint is complete; an old one left behind harms nothing
            logger.warning("could not remove old checkpoints in %s: %s", save.root, err)
        elapsed = time.perf_counter() - save.started
        logger.info("saved checkpoint %s in %.2fs", save.final, elapsed)
        print(f"saved checkpoint at iteration {save.iteration} to {save.final} ({elapsed:.2f}s)", flush=True)
    # The ranks leave the save together: a rank that went on to the next step would wait for rank 0's
    # clean-up inside that step's gradient all-reduce, where gloo polls, and its step would look slow
    # to the straggler detector (which times steps by CPU time).
    _barrier()
    return save.final


def _save_phase(step, iteration: int, tmp: str) -> None:
    """Run this rank's part of a save phase (``step`` None: nothing to do here), then agree with all
    ranks on whether every part succeeded (collective). On a failure anywhere, every rank raises
    :class:`CheckpointSaveError` with the first failure's cause, after rank 0 removed the ``.tmp``
    folder; a rank that raised alone would leave the others waiting in the next collective."""
    error, local = None, None
    if step is not None:
        try:
            step()
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            local = exc
            error = _describe_save_error(exc, tmp)
    failures = _gather_errors(error)
    if not failures:
        return
    failed_rank, cause = failures[0]
    message = (f"checkpoint save of iteration {iteration} failed on rank {failed_rank}: {cause}; "
               f"{os.path.basename(tmp)} removed, earlier checkpoints in {os.path.dirname(tmp)} are kept")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {message}", file=sys.stderr, flush=True)
    _barrier()  # the cause in one line, before any rank's traceback
    raise CheckpointSaveError(message) from local


def _write_manifest(folder: str, iteration: int, world_size: int) -> None:
    files = {}
    for directory, _, names in os.walk(folder):
        for file_name in names:
            rel = os.path.relpath(os.path.join(directory, file_name), folder)
            if rel != MANIFEST_FILE:
                files[rel] = os.stat(os.path.join(directory, file_name)).st_size
    manifest = {"format_version": FORMAT_VERSION, "iteration": iteration, "world_size": world_size,
                "files": dict(sorted(files.items()))}
    _write_durable(os.path.join(folder, MANIFEST_FILE), json.dumps(manifest, indent=1).encode())


def _remove_old_checkpoints(root: str, keep: int, newest: int, world_size: int) -> None:
    """Delete complete checkpoints beyond the ``keep`` newest up to iteration ``newest`` (the one just
    saved). Newer ones (left from before a rollback) are not counted and not deleted, ``*.damaged``
    folders never; and if none of the kept ones verifies, the newest older one that does is kept."""
    if keep <= 0:
        return
    candidates = [i for i in complete_iterations(root) if i <= newest]
    doomed, kept = candidates[:-keep], candidates[-keep:]
    if doomed and all(verify_checkpoint(iteration_dir(root, i), world_size) is not None for i in kept):
        for i in reversed(doomed):
            if verify_checkpoint(iteration_dir(root, i), world_size) is None:
                doomed.remove(i)
                break
    for i in doomed:
        path = iteration_dir(root, i)
        os.replace(path, path + ".del")
        shutil.rmtree(path + ".del", ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


class _Chooser:
    """Rank 0's choice of the checkpoint to load, and the setting aside of damaged ones.

    ``progress``: the run's progress log (``state.progress``) or None; each damaged folder becomes a
    ``Checkpoint fallback`` event once the folder used instead (or none) is known.
    """

    def __init__(self, root: str, world_size: int, progress):
        self.root, self.world_size, self.progress = root, world_size, progress
        self.pending: List[Tuple[str, str, str]] = []  # (folder, set aside as, reason)
        self.skipped: set = set()  # folders that could not be renamed: not tried again
        self.set_aside: set = set()  # folders found damaged, by their original path

    def damaged(self, path: str, reason: str) -> None:
        reason = _one_line(reason)
        self.set_aside.add(path)
        try:
            aside = os.path.basename(_set_aside(path))
        except OSError as err:
            aside = f"not moved: {err}"
            self.skipped.add(path)
        name = os.path.basename(path)
        logger.warning("checkpoint %s is damaged (%s); set aside as %s", path, reason, aside)
        print(f"warning: checkpoint {path} is damaged: {reason}; set aside as {aside}", file=sys.stderr, flush=True)
        self.pending.append((name, aside, reason))

    def decide(self) -> Tuple[str, Optional[str]]:
        """:meth:`next`, with an unexpected error turned into ``("fail", message)``: rank 0 must reach
        the broadcast of its decision, or the other ranks would wait in it."""
        try:
            return self.next()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all raise it
            return "fail", f"cannot choose a checkpoint under {self.root}: {type(exc).__name__}: {exc}"

    def next(self) -> Tuple[str, Optional[str]]:
        """``("load", path)``, ``("none", None)`` (nothing here: start fresh) or ``("fail", message)``."""
        order, tracked, warning = _load_order(self.root)
        if warning and (tracked is None or iteration_dir(self.root, tracked) not in self.set_aside):
            logger.warning(warning)  # (not when the tracker names a folder this chooser set aside)
        for path in order:
            if path in self.skipped:
                continue
            reason = verify_checkpoint(path, self.world_size)
            if reason is None:
                self._report(os.path.basename(path))
                if self.pending:  # the tracker named a folder set aside: name the one used instead
                    try:
                        _write_tracker(self.root, int(os.path.basename(path)[len("iter_"):]))
                    except OSError as err:
                        logger.warning("could not update %s: %s", TRACKER, err)
                return "load", path
            self.damaged(path, reason)
        self._report("none")
        damaged = sorted(glob.glob(os.path.join(glob.escape(self.root), f"iter_*{DAMAGED_SUFFIX}*")))
        if not damaged and not self.skipped:
            return "none", None
        names = ", ".join(os.path.basename(p) for p in damaged + sorted(self.skipped))
        return "fail", (f"no loadable checkpoint under {self.root}: every one is damaged ({names}); "
                        f"not starting from scratch over them: move them out of the folder to do so")

    def _report(self, used: str) -> None:
        for name, aside, reason in self.pending:
            if self.progress is not None:
                try:
                    self.progress.checkpoint_fallback(name, aside, reason, used)
                except OSError as err:
                    logger.warning("could not record the checkpoint fallback in the progress log: %s", err)
        self.pending = []


def load_checkpoint(state: GlobalState, model, optimizer, scheduler) -> Optional[Dict[str, Any]]:
    """Restore from the checkpoint in ``checkpoint.load`` that the tracker names, else the newest
    complete one; returns this rank's data state (``{"consumed_samples": ...}``) or None when
    nothing was loaded. Collective.

    A checkpoint that fails verification or loading is set aside and the next older one tried; if
    only damaged ones exist, :class:`CheckpointLoadError`. Falls back to
    ``checkpoint.pretrained_checkpoint`` for model weights only (a fresh run that starts from
    pretrained weights). RNG states are restored last, after everything that might draw random
    numbers, so the next step draws exactly what it drew in the original run.
    """
    cfg = state.cfg.checkpoint
    rank = _rank()
    path, saved = None, None
    loaded: Optional[Tuple[Dict[str, Any], Optional[Dict[str, Any]]]] = None
    start = time.perf_counter()
    now = parallel.model_parallel_sizes()
    if cfg.load:
        chooser = _Chooser(cfg.load, _world_size(), state.progress) if rank == 0 else None
        while True:
            decision, value = _from_rank0(chooser.decide() if chooser is not None else None)
            if decision == "fail":
                raise CheckpointLoadError(value)
            if decision == "none":
                break
            path = value
            start = time.perf_counter()
            error = None
            load_optim = cfg.load_optim and not cfg.finetune
            saved = saved_parallelism(path)
            if _uses_megatron_dist(model):
                check_optimizer_layout(path, saved, now, optimizer, load_optim)
            fully = saved is not None and saved.fully_reshardable
            try:
                loaded = _read_checkpoint(model, optimizer, path, load_optim, rank, fully)
            except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
                error = _describe_load_error(exc)
                logger.warning("loading %s failed on rank %d", path, rank, exc_info=True)
            failures = _gather_errors(error)  # every rank learns of a failure on any rank
            if not failures:
                break
            if saved is not None and saved.sizes != now:
                # Not damage: the checkpoint loads at the layout it was saved at. It stays in place.
                failed_rank, cause = failures[0]
                sizes = saved.sizes
                raise CheckpointLoadError(
                    f"{path}, saved at tensor/pipeline/context-parallel sizes {sizes['tp']}/{sizes['pp']}/{sizes['cp']}, "
                    f"failed to load at {now['tp']}/{now['pp']}/{now['cp']} (rank {failed_rank}: {cause}); it is left "
                    "in place: resume at the saved sizes, or load the weights only (checkpoint.load_optim = false)")
            if chooser is not None:
                failed_rank, cause = failures[0]
                chooser.damaged(path, f"load failed on rank {failed_rank}: {cause}")
            path, loaded = None, None

    if path is None or loaded is None:
        if cfg.load and cfg.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"no complete checkpoint under {cfg.load}")
        if cfg.pretrained_checkpoint:
            pretrained = _resolve_checkpoint_dir(cfg.pretrained_checkpoint)
            if pretrained is None:
                raise FileNotFoundError(f"no complete checkpoint under {cfg.pretrained_checkpoint}")
            _load_model_and_optimizer(model, optimizer, pretrained, load_optim=False)
            if rank == 0:
                print(f"loaded pretrained weights from {pretrained}", flush=True)
        elif rank == 0:
            print(f"no checkpoint found under {cfg.load!r}: starting from scratch", flush=True)
        return None

    common, per_rank = loaded
    finetune = cfg.finetune
    state.checkpoint_extra = {key: common[key] for key in ("fault_tolerance",) if key in common}
    if not finetune:
        state.train_state.load_state_dict(common["train_state"])
        if scheduler is not None and common.get("scheduler") is not None:
            scheduler.load_state_dict(common["scheduler"])
    # Random-number states belong to ranks' roles: restored only at the layout they were saved at (a
    # checkpoint whose config cannot be read counts as saved at this one, as before configs recorded it).
    same_layout = (per_rank is not None and per_rank.get("world_size") == _world_size()
                   and (saved is None or saved.sizes == now))
    if rank == 0:
        print(f"loaded checkpoint {path} (iteration {common['iteration']}) in {time.perf_counter() - start:.2f}s",
              flush=True)
        if per_rank is None:
            print(f"warning: {path} has no state for rank {rank} (world size changed?); RNG not restored", flush=True)
        elif not same_layout:
            print(f"note: {path} was saved at model-parallel sizes {saved.sizes if saved else '?'} on "
                  f"{per_rank.get('world_size')} ranks, this run is {now} on {_world_size()}: "
                  "weights and optimizer resharded, random-number states not restored (they belong to other "
                  "ranks' roles)", flush=True)
    if finetune:
        return None
    # Every rank returns a dict once a checkpoint was loaded (the caller counts the step as saved on
    # all ranks alike); the data position where this rank's state has one.
    if per_rank is None:
        return {}
    if cfg.load_rng and "rng" in per_rank and same_layout:
        _set_rng_state(per_rank["rng"])
    return per_rank.get("data", {})


def _read_checkpoint(model, optimizer, path: str, load_optim: bool, rank: int,
                     fully_reshardable: bool = False) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Load model and optimizer in place (collective) and read the shared and this rank's state."""
    _load_model_and_optimizer(model, optimizer, path, load_optim=load_optim, fully_reshardable=fully_reshardable)
    common = torch.load(os.path.join(path, COMMON_FILE), weights_only=False)
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    per_rank = torch.load(rank_file, weights_only=False) if os.path.exists(rank_file) else None
    return common, per_rank


def _describe_load_error(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = next(iter(exc.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return _one_line(f"{type(inner).__name__} (rank {rank} of the reader): {inner}")
    return _one_line(f"{type(exc).__name__}: {exc}")
