"""One writer per output prefix: the lock that ``bridge-prepare-data`` holds while it writes shards.

Two preparations writing one ``--output-prefix`` at once would interleave their shards and records
(the worst outcome: a shard whose tokens came from two inputs, and a record that vouches for it).
So every writer takes ``<output-prefix>.lock`` with ``flock`` before it reads a record:

- a run on this machine, and ``--slurm`` while it plans and submits: **exclusive**, for its whole
  duration. The holder's host, pid, mode and start time are written into the lock file, so that
  the one refused can say who holds the prefix, and the file is removed when it is done;
- an array task of a ``--slurm`` job, and its final step: **shared**. The tasks of one array write
  different shards, and no other array of the prefix can exist (below).

A lock is only held while a process runs, and an array job waits in the queue first. So a Slurm job
that has not finished (pending, running, requeued) holds the prefix too: an exclusive writer is
given ``unfinished_jobs`` (the caller asks Slurm about the jobs submitted for the prefix, which the
data side does not import) and is refused while it returns any.

``flock`` works on local file systems, NFS (as POSIX locks) and Lustre mounted with ``flock``. Where
the file system refuses locks, :func:`hold_prefix` goes on without one and says so in one line: the
tmp files are still private to their writer, but two concurrent writers are no longer refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, TextIO

from bridge_hpc.contracts.errors import ConfigError

#: The lock file is ``<output-prefix>`` + this suffix, beside the manifest.
LOCK_SUFFIX = ".lock"
_KEY = "--output-prefix"


def lock_path(output_prefix: str) -> Path:
    return Path(output_prefix + LOCK_SUFFIX)


#: Seconds the tasks of a --slurm job wait for the lock (the submission holds it exclusively until both
#: jobs are submitted and recorded, and a task can start before that).
TASK_LOCK_WAIT_S = 60.0
#: Seconds between two tries of a lock that is waited for.
LOCK_POLL_S = 0.2
#: Seconds a refused writer waits for an exclusive holder that has just taken the lock to write its name.
HOLDER_NAME_WAIT_S = 1.0


def _holder(fd: int) -> str:
    """Who the lock file says holds it: an exclusive holder writes itself there right after it takes
    the lock, so a name not there yet is waited for a moment; shared holders write nothing."""
    deadline = time.monotonic() + HOLDER_NAME_WAIT_S
    while True:
        try:
            info = json.loads(os.pread(fd, 65536, 0).decode("utf-8", "replace") or "{}")
        except (OSError, ValueError):
            info = {}
        if isinstance(info, dict) and "pid" in info:
            return (f"bridge-prepare-data ({info.get('mode', '?')}) pid {info.get('pid')} on {info.get('host', '?')} "
                    f"since {info.get('since', '?')}")
        if time.monotonic() >= deadline:
            return "the tasks of a bridge-prepare-data --slurm job (they hold it shared while they run)"
        time.sleep(0.05)


def _refuse_unfinished_jobs(output_prefix: str, jobs: Dict[str, str]) -> None:
    if jobs:
        listed = ", ".join(f"{job_id} ({state})" for job_id, state in jobs.items())
        raise ConfigError(f"output prefix {output_prefix!r} is in use by its --slurm job(s) {listed}; wait for them "
                          "to end or cancel them, or choose another --output-prefix", key=_KEY)


@contextlib.contextmanager
def hold_prefix(output_prefix: str, mode: str, shared: bool = False,
                unfinished_jobs: Optional[Callable[[], Dict[str, str]]] = None,
                warn: TextIO = sys.stderr, wait_s: float = 0.0) -> Iterator[None]:
    """Hold ``output_prefix``'s lock for the block; ConfigError naming who holds it when it is taken.

    ``mode`` says what the holder does ("local", "submit", "task 3", "finish"), for the message a
    refused writer prints. A writer a user started is refused at once (``wait_s = 0``); the tasks of a
    --slurm job wait :data:`TASK_LOCK_WAIT_S` for the submission that holds the prefix while it
    submits them, since a task can start before that submission has let go. An exclusive holder is
    also refused while ``unfinished_jobs()`` (``{job id: state}`` of the prefix's --slurm jobs that
    Slurm has not finished) returns any. The lock file's folder is created (the output folder); a folder that cannot be created or
    written is a ConfigError naming ``--output-prefix``.
    """
    path = lock_path(output_prefix)
    fd = _locked_fd(path, output_prefix, shared, warn, wait_s)
    try:
        if not shared:
            info = {"host": socket.gethostname(), "pid": os.getpid(), "mode": mode,
                    "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            with contextlib.suppress(OSError):
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            if unfinished_jobs is not None:
                _refuse_unfinished_jobs(output_prefix, unfinished_jobs())
        yield
    finally:
        if not shared:  # no one else holds it: the file goes, so that none is left naming a process that is gone
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


def _locked_fd(path: Path, output_prefix: str, shared: bool, warn: TextIO, wait_s: float) -> int:
    """An open descriptor of the lock file, locked; a lock held by another is waited for up to
    ``wait_s`` seconds, then refused naming its holder. An exclusive holder removes the file when it
    is done, so a descriptor opened just before that locks a file no longer there: it is checked
    against the path (same inode) and the lock taken again on the new file."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise ConfigError(f"cannot write beside {output_prefix!r}: {err.strerror or err}", key=_KEY) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(LOCK_POLL_S)
                    continue
                holder = _holder(fd)
                os.close(fd)
                raise ConfigError(f"output prefix {output_prefix!r} is in use by {holder} (lock {str(path)!r}); "
                                  "wait for it to end, or choose another --output-prefix", key=_KEY) from None
            print(f"[prepare-data] warning: the file system of {path} refuses locks ({err.strerror}): going on "
                  "without; do not run two preparations of this prefix at once", file=warn)
            return fd
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
