"""The checkpoint folder on disk: names, durable writes, the tracker, verification, the folder lock.

What makes a kill at any instant harmless (see :mod:`bridge_hpc.training.checkpoint.checkpointing` for
the whole protocol): files are written and fsynced before they are renamed into place, a folder is
complete only once its manifest is written last, and :func:`verify_checkpoint` checks one against its
manifest before it is loaded. The small collectives the save and load phases agree through live here
too. Shared by the synchronous save, the async writer and its worker.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from bridge_hpc.contracts import run_folder
from bridge_hpc.slurm.job_environment import JobEnvironment

logger = logging.getLogger(__name__)
TRACKER = run_folder.TRACKER_FILE
#: Written by rank 0 once every rank's files are durable (not ``common.pt``: megatron-core's
#: dist_checkpointing writes a file of that name itself).
COMMON_FILE = "train_state.pt"
#: Written last into a checkpoint folder (format 2): see run_folder.CHECKPOINT_MANIFEST_FILE.
MANIFEST_FILE = run_folder.CHECKPOINT_MANIFEST_FILE
#: The resolved configuration of the run that saved (rank 0): see run_folder.CHECKPOINT_RUN_CONFIG_FILE.
RUN_CONFIG_FILE = run_folder.CHECKPOINT_RUN_CONFIG_FILE
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
    return checkpoint_choice(root, world_size)[0]


def checkpoint_choice(root: str, world_size: Optional[int] = None
                      ) -> Tuple[Optional[str], List[Tuple[str, str]], Optional[str]]:
    """:func:`find_latest_checkpoint` with its reasons, for a tool to tell: ``(the folder it picks or
    None, the better candidates passed over as (folder, :func:`verify_checkpoint`'s line naming the
    damaged file), the tracker's warning of the load order or None)``. Read-only."""
    if not root or not os.path.isdir(root):
        return None, [], None
    order, _, warning = _load_order(root)
    damaged: List[Tuple[str, str]] = []
    for path in order:
        problem = verify_checkpoint(path, world_size)
        if problem is None:
            return path, damaged, warning
        damaged.append((path, problem))
    return None, damaged, warning


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
