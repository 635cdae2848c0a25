"""A tool's output folder that appears complete or not at all, and overwrites nothing. Stdlib only.

:func:`new_output_folder` gives a block a temporary folder of its own beside ``OUT``: a fresh, unique
name (``.OUT.tmp-XXXXXXXX``) made with ``mkdir``, which never follows a link and never takes a folder
that is already there, so no one else's ``OUT.tmp`` (a folder, or a link to one) is removed or written
into, and two runs into one ``OUT`` never share one. When the block ends well, its files are fsynced
and the folder is renamed to ``OUT`` without replacing anything (``renameat2(RENAME_NOREPLACE)``; where
the file system lacks it, ``OUT`` is first claimed with ``mkdir``, which fails if anything is there):
``OUT`` made by someone else meanwhile is one :class:`ConfigError` ("exists already"). On any failure,
Ctrl-C or SIGTERM (see :func:`sigterm_as_interrupt`) only the temporary folder is removed; a full disk
or another OSError while writing becomes one ConfigError naming ``OUT``, and an interrupt a
:class:`OutputInterrupted` (a KeyboardInterrupt) that says ``OUT`` was not written. A run killed with
SIGKILL leaves its hidden temporary folder, never a partial ``OUT``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import signal
from typing import Iterator, Optional, Set

from bridge_hpc.contracts.errors import ConfigError

#: The exit status of a tool stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130
#: A write failure with less free space than this beside OUT is reported as a full disk even when the
#: OSError itself was lost on the way (safetensors' writer reports ENOSPC as its own exception type).
_NEARLY_FULL_BYTES = 1 << 20
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
#: Absolute paths this process has published (renamed into place): an interrupt after that left OUT complete.
_published: Set[str] = set()


class OutputInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while the output was being written: the temporary folder is removed, OUT absent."""

    def __init__(self, out: str):
        self.out = out
        super().__init__(f"interrupted: {out} was not written (its temporary folder was removed)")


def was_published(out: str) -> bool:
    """Whether this process renamed a complete output folder into place at ``out``."""
    return os.path.abspath(out) in _published


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, Slurm's time limit) ends the tool as Ctrl-C does: through the same clean-up."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving in the block take effect at its end (their handlers then run as they
    would have), so that a step and its bookkeeping are not torn apart. Only in the main thread, where
    Python runs signal handlers; elsewhere the block runs as it is."""
    caught = []
    try:
        previous = {number: signal.signal(number, lambda signum, frame: caught.append(signum))
                    for number in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: a handler not from Python
        for number in dict.fromkeys(caught):
            handler = previous[number]
            if callable(handler):
                handler(number, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(number)


def _temporary_beside(out: str) -> str:
    parent, name = os.path.split(out)
    for _ in range(100):
        path = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)  # mode 0o777 less the umask, as OUT's would be; fails on anything already there
            return path
        except FileExistsError:
            continue
    raise ConfigError("cannot make a temporary folder beside it: 100 fresh names were all taken", path=out)


@contextlib.contextmanager
def new_output_folder(out: str) -> Iterator[str]:
    """A fresh temporary folder beside ``out`` to write into; renamed to ``out`` when the block ends
    without an exception (``out`` must not exist then: ConfigError otherwise). See the module's text."""
    out = os.path.abspath(out)
    tmp: Optional[str] = None
    published = False
    try:
        with _interrupts_deferred():  # no Ctrl-C between the mkdir and knowing the folder is ours to remove
            tmp = _temporary_beside(out)
        yield tmp
        _fsync_tree(tmp)
        with _interrupts_deferred():  # nor between the rename and knowing OUT is complete
            _rename_noreplace(tmp, out)
            published = True
            _published.add(out)
        _fsync_dir(os.path.dirname(out))
    except BaseException as exc:
        if published:
            raise  # OUT is complete
        full = _space_error(exc) is not None or _free_bytes(os.path.dirname(out)) < _NEARLY_FULL_BYTES
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ConfigError):
            raise
        if _interrupted(exc):
            raise OutputInterrupted(out) from None
        if full:
            cause = _space_error(exc)
            raise ConfigError(f"not written: {cause.strerror if cause else os.strerror(errno.ENOSPC)} (its file "
                              "system is full; what was written of it is removed)", path=out) from None
        cause = _os_error(exc)
        if cause is not None:
            where = f" ({_outside(cause.filename, tmp, out)})" if cause.filename else ""
            raise ConfigError(f"not written: {cause.strerror or cause}{where}", path=out) from None
        raise


def _outside(filename, tmp: str, out: str) -> str:
    """``filename`` as it would be under OUT (the temporary folder's name means nothing to a user)."""
    name = os.fsdecode(filename)
    return out + name[len(tmp):] if name.startswith(tmp) else name


def _rename_noreplace(src: str, dst: str) -> None:
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise _exists(dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), dst)
    # No RENAME_NOREPLACE here (NFS, older kernels): claim OUT with mkdir, which fails if anything is
    # there, then rename onto that empty folder of this process's own.
    try:
        os.mkdir(dst)
    except FileExistsError:
        raise _exists(dst) from None
    try:
        os.rename(src, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def _exists(out: str) -> ConfigError:
    return ConfigError("exists already: it appeared while this run wrote its output (another run into the same "
                       "folder?); nothing is overwritten, and this run's output was removed", path=out)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root`` (what a writer did not sync itself), folders last."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(directory)


def _free_bytes(path: str) -> int:
    try:
        stat = os.statvfs(path)
    except OSError:
        return _NEARLY_FULL_BYTES
    return stat.f_bavail * stat.f_frsize


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures that torch.distributed.checkpoint's
    CheckpointException holds (``failures``: rank -> (exception, traceback))."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]


def _interrupted(exc: BaseException) -> bool:
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


def _space_error(exc: BaseException) -> Optional[OSError]:
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS), None)


def _os_error(exc: BaseException) -> Optional[OSError]:
    return next((e for e in _chain(exc) if isinstance(e, OSError)), None)
