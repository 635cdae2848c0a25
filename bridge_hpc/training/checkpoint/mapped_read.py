"""A checkpoint load's tensors copied into the model straight out of the page cache.

torch's DCP reader (``FileSystemReader.read_data``) ``torch.load``s every tensor of a checkpoint file
from the file: the bytes are read into a freshly allocated host tensor (the kernel copies them out of
the page cache, and the new memory's pages are faulted in and zeroed first) and then copied into the
target, on a GPU from pageable memory. A requeued run of the 370 M GPT spent 1.5-2.0 s that way on
5.2 GB that sat in the page cache, which reads at 18-27 GB/s on the H100 hosts used (benchmarks/
results/device-2026-11-27c). Here each file is mapped into memory once (``UntypedStorage.from_file``,
private, so nothing is written back) and each tensor item is unpickled as ``torch.load(...,
mmap=True)`` does it: torch's own ``_load`` with the mapping as the storage every tensor views. The
tensor is then a view of the page cache, and the copy into the target is the only copy.

The items are the same, and go through the planner exactly as in torch's ``read_data`` (narrowed to
the requested slice, ``resolve_tensor``, ``copy_``, ``commit_tensor``). What this does not handle (byte
items, items written through storage transforms, a torch without these internals, a file that cannot
be mapped) is read by torch's ``read_data`` itself.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Dict, List

import torch


def available() -> bool:
    """Whether the installed torch has the internals this module uses (those of its DCP reader and of
    ``torch.load(..., mmap=True)``; torch 2.11 and 2.13 have them)."""
    from torch.distributed.checkpoint import filesystem

    return (hasattr(filesystem, "_create_file_view") and hasattr(filesystem, "narrow_tensor_by_index")
            and hasattr(torch.serialization, "_open_zipfile_reader")
            and "overall_storage" in inspect.signature(torch.serialization._load).parameters)


def read_items(reader, items: List, planner, read_with_torch: Callable[[List], None]) -> None:
    """Read ``items`` (DCP ``ReadItem``s of ``reader``'s plan) into ``planner``'s tensors; what this
    module does not handle goes to ``read_with_torch(items)`` (torch's ``read_data`` on those)."""
    from torch.distributed.checkpoint.planner import LoadItemType

    by_file: Dict[str, list] = {}
    others = []
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
                _read_tensor(reader, stream, mapping, request, planner)
        del mapping
    if others:
        read_with_torch(others)


def _read_tensor(reader, stream, mapping, request, planner) -> None:
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
    target.copy_(tensor)
    planner.commit_tensor(request, target)
