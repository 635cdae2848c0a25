"""A checkpoint load's tensors copied into the model straight out of the page cache.

torch's DCP reader (``FileSystemReader.read_data``) ``torch.load``s every tensor of a checkpoint file
from the file: the bytes are read into a freshly allocated host tensor (the kernel copies them out of
the page cache, and the new memory's pages are faulted in and zeroed first) and then copied into the
target, on a GPU from pageable memory. A requeued run of the 370 M GPT spent 1.5-2.0 s that way on
5.2 GB that sat in the page cache, which reads at 18-27 GB/s on the H100 hosts used (benchmarks/
results/device-2026-11-27c). Here each file is mapped into memory once (``UntypedStorage.from_file``,
private, so nothing is written back) and each tensor item is unpickled as ``torch.load(...,
mmap=True)`` does it: torch's own ``_load`` with the mapping as the storage every tensor views. The
tensor is then a view of the page cache, copied into its target from there: on a CPU directly, on a
GPU through two small pinned buffers per reading thread (:class:`_ToDevice`), since from pageable
memory the CUDA driver copies one tensor at a time through staging memory of its own.

The items are the same, and go through the planner exactly as in torch's ``read_data`` (narrowed to
the requested slice, ``resolve_tensor``, ``copy_``, ``commit_tensor``). What this does not handle (byte
items, items written through storage transforms, a torch without these internals, a file that cannot
be mapped) is read by torch's ``read_data`` itself.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Dict, List, Optional

import torch


def available() -> bool:
    """Whether the installed torch has the internals this module uses (those of its DCP reader and of
    ``torch.load(..., mmap=True)``; torch 2.11 and 2.13 have them)."""
    from torch.distributed.checkpoint import filesystem

    return (hasattr(filesystem, "_create_file_view") and hasattr(filesystem, "narrow_tensor_by_index")
            and hasattr(torch.serialization, "_open_zipfile_reader")
            and "overall_storage" in inspect.signature(torch.serialization._load).parameters)


#: Bytes of each of a reading thread's two pinned host buffers, through which a tensor goes to GPU memory.
STAGING_CHUNK = 16 << 20


class _ToDevice:
    """One reading thread's way to GPU memory: a tensor's bytes copied out of the mapping into one of
    two small pinned buffers, in turn, each sent on by the copy engine while the next is filled, on a
    CUDA stream of the thread's own. Why: from pageable memory the CUDA driver copies through staging
    memory of its own, one copy at a time: 5.2 GB loaded at 2.6-3 GB/s whatever the number of reading
    threads (4, 8 or 16; H100, 2026-11-27). The buffers are pinned once per process (torch's host
    allocator keeps them) and hold 4 x 2 x :data:`STAGING_CHUNK` bytes in all."""

    def __init__(self, device: torch.device):
        torch.cuda.set_device(device)  # a new thread's device is 0
        self.stream = torch.cuda.Stream(device=device)
        self.buffers = [torch.empty(STAGING_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.sent: List = [None, None]  # the event after each buffer's last copy to the device
        self.next = 0

    @staticmethod
    def takes(source: torch.Tensor, target: torch.Tensor) -> bool:
        return (target.is_cuda and source.device.type == "cpu" and source.dtype == target.dtype
                and source.is_contiguous() and target.is_contiguous() and source.numel() == target.numel() > 0)

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        src, dst = source.reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8)
        for start in range(0, src.numel(), STAGING_CHUNK):
            end = min(start + STAGING_CHUNK, src.numel())
            k, self.next = self.next, 1 - self.next
            if self.sent[k] is not None:
                self.sent[k].synchronize()  # its previous bytes are on the device
            buffer = self.buffers[k][:end - start]
            buffer.copy_(src[start:end])
            with torch.cuda.stream(self.stream):
                dst[start:end].copy_(buffer, non_blocking=True)
                self.sent[k] = torch.cuda.Event()
                self.sent[k].record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()


def read_items(reader, items: List, planner, read_with_torch: Callable[[List], None]) -> None:
    """Read ``items`` (DCP ``ReadItem``s of ``reader``'s plan) into ``planner``'s tensors; what this
    module does not handle goes to ``read_with_torch(items)`` (torch's ``read_data`` on those). The
    caller has made the targets' earlier GPU work complete (:func:`torch.cuda.synchronize`): the copies
    to GPU memory run on a stream of this thread's own; they are complete when this returns."""
    from torch.distributed.checkpoint.planner import LoadItemType

    by_file: Dict[str, list] = {}
    others = []
    to_device: Optional[_ToDevice] = None
    for item in items:
        info = reader.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
            others.append(item)
        else:
            by_file.setdefault(info.relative_path, []).append(item)
    for relative_path, requests in by_file.items():
        path = str(reader.fs.concat_path(reader.path, relative_path))
        try:
            mapping = torch.UntypedStorage.from_file(path, False, os.path.getsize(path))
        except (OSError, RuntimeError):  # cannot be mapped here: torch reads it
            others += requests
            continue
        with reader.fs.create_stream(path, "rb") as stream:
            for request in sorted(requests, key=lambda r: reader.storage_data[r.storage_index].offset):
                to_device = _read_tensor(reader, stream, mapping, request, planner, to_device)
        del mapping
    if to_device is not None:
        to_device.finish()
    if others:
        read_with_torch(others)


def _read_tensor(reader, stream, mapping, request, planner, to_device: Optional[_ToDevice]) -> Optional[_ToDevice]:
    from torch.distributed.checkpoint import filesystem

    info = reader.storage_data[request.storage_index]
    item_file = filesystem._create_file_view(stream, info.offset, info.length)
    with torch.serialization._open_zipfile_reader(item_file) as archive:
        tensor = torch.serialization._load(archive, "cpu", torch.serialization._weights_only_unpickler,
                                           overall_storage=mapping[info.offset:info.offset + info.length])
    tensor = filesystem.narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
    target = planner.resolve_tensor(request).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {request.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    if _ToDevice.takes(tensor, target):
        to_device = to_device or _ToDevice(target.device)
        to_device.copy(tensor, target)
        # What commit_tensor does with the target on this thread's stream (megatron's planner may copy
        # it into a quantized tensor) comes after the copies.
        torch.cuda.current_stream(target.device).wait_stream(to_device.stream)
    else:
        target.copy_(tensor)
    planner.commit_tensor(request, target)
    return to_device
