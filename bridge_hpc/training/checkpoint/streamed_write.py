"""A synchronous save's files written straight from GPU memory: one thread per file, all at once,
each tensor copied to host memory just before it is written, and the disk's writeback started while
the rest is still being copied.

Why: a synchronous save (every exit save; interval saves without ``checkpoint.async_save``) holds
training, or the preempted job's grace time, for as long as it writes. megatron-core's own
synchronous write first copies every tensor to pinned host memory (``preload_tensors``), then writes
its files with threads, but writes the last file alone in the calling thread before it starts the
others (0.19; 0.16 forks a process per file instead), and the kernel starts writing the dirty pages
to disk only at the final fsync. For the 370 M GPT (5.2 GB) on an H100 that took 5.0-8.7 s against
2.4 s for the same bytes written by 4 threads with fsync (benchmarks/results/device-2026-11-27c),
and the 5.2 GB of pinned memory it needs had to be pinned ahead (2.2-2.9 s, stalling the steps of
every run) and made the rank's exit 1-1.6 s slower (unpinning). Here no pinned memory is used:

- every file (a megatron-core *write bucket*, balanced by bytes) gets its own thread from the start;
- a thread copies one tensor at a time into a host buffer of its own (pageable, reused for every
  tensor of its file, as large as the file's largest tensor) on a CUDA stream of its own, then
  writes it with torch's ``_write_item``, so the bytes on disk are exactly those megatron-core's
  writer produces (``torch.save`` of a host tensor with its own storage, at the same offsets);
- after every :data:`WRITEBACK_CHUNK` bytes the thread asks the kernel to start writing them to disk
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux; elsewhere nothing), so the disk is busy from
  the first bytes instead of from the final ``fsync``, which then waits only for the tail.

Each file is fsynced before its thread returns, as megatron-core's writer does. Measured on H100
hosts (2026-11-27, benchmarks/results/device-2026-11-27d): the 5.2 GB exit save in 3.1-3.9 s where 4
files written at once and fsynced took 3.4-3.5 s (1.48-1.51 GB/s), and 0.23-0.31 s from the save
being durable to every process of the rank gone.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

#: A write bucket as megatron-core's ``FileSystemWriterAsync`` plans it: (file path, storage key,
#: (byte items, tensor items)); each item is ``(WriteItem, data)``.
WriteBucket = Tuple[str, str, Tuple[list, list]]
#: ``write_one(stream, data, write_item, storage_key) -> WriteResult``: torch's ``_write_item`` as the
#: caller's megatron-core version calls it.
WriteOne = Callable[[Any, Any, Any, str], Any]

#: Bytes a file's thread writes between two requests to the kernel to start writing them back.
WRITEBACK_CHUNK = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2


def write_buckets(buckets: Sequence[WriteBucket], write_one: WriteOne) -> Union[Dict[int, list], BaseException]:
    """Write every bucket's file, each in its own thread; returns ``{bucket index: [WriteResult]}``
    (what megatron-core's writer puts into its results queue), or the first failure: an OSError
    names the file it was writing. The caller has made the tensors' values final (no kernel still
    writing them: :func:`torch.cuda.synchronize`)."""
    results: Dict[int, Any] = {}

    def run(index: int, bucket: WriteBucket) -> None:
        try:
            results[index] = _write_file(bucket, write_one)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, which agrees with the other ranks
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i, b), name=f"ckpt-write-{i}", daemon=True)
               for i, b in enumerate(buckets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(len(buckets)):
        if isinstance(results.get(index), BaseException):
            return results[index]
    return results


def _write_file(bucket: WriteBucket, write_one: WriteOne) -> list:
    path, storage_key, (bytes_data, tensor_data) = bucket
    staging = _Staging([tensor for _, tensor in tensor_data])
    out = []
    try:
        with open(path, "wb") as stream:
            writeback = _Writeback(stream)
            for item, data in bytes_data:
                out.append(write_one(stream, data, item, storage_key))
            for item, tensor in tensor_data:
                out.append(write_one(stream, staging.host_copy(tensor), item, storage_key))
                writeback.advance()
            stream.flush()
            os.fsync(stream.fileno())
    except Exception as exc:
        # Name the file: a full disk is then reported as "no space left on device writing <file>",
        # also where torch's zip writer raised a RuntimeError from the OSError (the chain does not
        # survive the pickling that gathers the ranks' outcomes).
        cause = _os_error_behind(exc)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror or str(cause), cause.filename or path) from exc
    return out


def _os_error_behind(exc: BaseException) -> Optional[OSError]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class _Staging:
    """One file's host buffer: each tensor, in turn, copied into it, as a host tensor of exactly that
    tensor's bytes (``torch.save`` writes a tensor's whole storage, so a plain view of a larger
    buffer would not do: :func:`torch.frombuffer` over a slice makes one whose storage is the
    slice). A tensor that is empty or not contiguous is copied as megatron-core's staging copies it
    (``tensor.to("cpu")``), strides and all."""

    def __init__(self, tensors: List[torch.Tensor]):
        sizes = [t.numel() * t.element_size() for t in tensors if t.numel() and t.is_contiguous()]
        # torch.empty, not bytearray: no pass that zeroes it first (its pages are first touched by the
        # first copy into them).
        self.buffer = memoryview(torch.empty(max(sizes, default=0), dtype=torch.uint8).numpy())
        self.stream: Optional[torch.cuda.Stream] = None
        device = next((t.device for t in tensors if t.is_cuda), None)
        if device is not None:
            # A new thread's device is 0: set the rank's, or the stream (and a CUDA context) would
            # be made on another rank's GPU.
            torch.cuda.set_device(device)
            self.stream = torch.cuda.Stream(device=device)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0 or not tensor.is_contiguous():
            return tensor.to("cpu")
        nbytes = tensor.numel() * tensor.element_size()
        host = torch.frombuffer(self.buffer[:nbytes], dtype=tensor.dtype).view(tensor.shape)
        if tensor.is_cuda:
            with torch.cuda.stream(self.stream):
                host.copy_(tensor)  # into pageable memory: returns once the bytes are there
        else:
            host.copy_(tensor)
        return host


class _Writeback:
    """Asks the kernel to start writing a file's dirty pages to disk every :data:`WRITEBACK_CHUNK`
    bytes, without waiting for them (the final fsync does)."""

    def __init__(self, stream):
        self.stream, self.fd, self.started = stream, stream.fileno(), 0

    def advance(self) -> None:
        end = self.stream.tell()
        if end - self.started < WRITEBACK_CHUNK or _sync_file_range is None:
            return
        self.stream.flush()
        _sync_file_range(self.fd, self.started, end - self.started, _SYNC_FILE_RANGE_WRITE)
        self.started = end


def _libc_sync_file_range() -> Optional[Callable]:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the final fsync writes everything
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function  # a failure (a file system without it) returns -1 and is ignored: the fsync remains


_sync_file_range = _libc_sync_file_range()
