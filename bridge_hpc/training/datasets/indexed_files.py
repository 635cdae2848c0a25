"""The indexed datasets' files on the login node: megatron-core's ``.idx`` / ``.bin`` pairs read with
``struct`` and ``array`` (no numpy, no torch), so that ``bridge-submit`` checks the data a job names
before it queues. :func:`read_index_header` reads a header and the last entries (O(1) reads);
:func:`verify_index` walks every entry (``bridge-submit --verify-data``). Re-exported by
:mod:`bridge_hpc.training.datasets.config`, whose configs call them from ``finalize``."""

from __future__ import annotations

import array
import os
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import check as _check

#: megatron-core's indexed-dataset ``DType`` codes -> (name, bytes per token); floats are not token ids.
_INDEX_DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
                 8: ("uint16", 2)}
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
#: magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_INDEX_HEADER_BYTES = 34


@dataclass(frozen=True)
class IndexedDatasetHeader:
    """What an ``.idx`` file says about its ``.bin``: read with ``struct``, no numpy or torch."""

    prefix: str
    dtype: str
    itemsize: int
    sequence_count: int
    document_count: int
    bin_bytes: int


def read_index_header(prefix: str, key: str) -> IndexedDatasetHeader:
    """Check ``prefix.idx`` / ``prefix.bin`` in O(1) reads; raise ConfigError naming the file and ``key``.

    The ``.idx`` header gives the token dtype and the sequence and document counts, which fix the
    ``.idx`` size (lengths int32, pointers int64 per sequence, int64 per document boundary). The
    pointers are the running sum of the sequence lengths times the item size, so the last pointer plus
    the last length times the item size is what the ``.bin`` size must be: a truncated file, or an
    ``.idx`` paired with a ``.bin`` of another dtype or dataset, fails here instead of as a numpy error
    (or silently wrong tokens) on every rank. So does a dataset of empty documents only (an empty
    ``.bin``, which megatron-core's memory map cannot open: "cannot mmap an empty file").
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        _check(os.path.isfile(path), key, f"{path} is missing (expected {prefix}.bin and .idx, as written by "
                                          "bridge-prepare-data)")
    idx_bytes, bin_bytes = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        head = f.read(_INDEX_HEADER_BYTES)
        _check(len(head) == _INDEX_HEADER_BYTES, key, f"{idx} is truncated ({idx_bytes} bytes, shorter than the "
                                                     "index header)")
        magic, version, code, n, d = struct.unpack("<9sQBQQ", head)
        _check(magic == _INDEX_MAGIC, key, f"{idx} is not a megatron-core index file (bad magic bytes)")
        _check(version == 1, key, f"{idx} has index version {version}; this reader knows version 1")
        _check(code in _INDEX_DTYPES, key, f"{idx} has dtype code {code}, which is not an integer token dtype")
        dtype, itemsize = _INDEX_DTYPES[code]
        _check(n > 0 and d >= 2, key, f"{idx} holds no documents")
        expected = _INDEX_HEADER_BYTES + 12 * n + 8 * d
        # A multimodal index has one more byte per sequence (its modes), which a GPT dataset ignores.
        _check(idx_bytes >= expected, key, f"{idx} is truncated: {idx_bytes} bytes, its header "
                                           f"({n} sequences, {d - 1} documents) needs {expected}")
        _check(idx_bytes in (expected, expected + n), key,
               f"{idx} has {idx_bytes} bytes, its header ({n} sequences, {d - 1} documents) says {expected}")
        f.seek(_INDEX_HEADER_BYTES + 4 * (n - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_INDEX_HEADER_BYTES + 4 * n + 8 * (n - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
        f.seek(_INDEX_HEADER_BYTES + 12 * n + 8 * (d - 1))
        (last_boundary,) = struct.unpack("<q", f.read(8))
    _check(last_boundary == n, key, f"{idx} is inconsistent: its last document ends at sequence {last_boundary}, "
                                    f"not at its sequence count {n}")
    want = last_pointer + last_length * itemsize
    _check(bin_bytes == want, key,
           f"{bin_} has {bin_bytes} bytes but {idx} describes {want} ({n} sequences of {dtype}): "
           + ("the .bin is truncated, or " if bin_bytes < want else "")
           + "the .idx and .bin disagree (dtype or dataset)")
    # megatron-core memory-maps the .bin on every rank, and an empty file cannot be mapped.
    _check(bin_bytes > 0, key, f"{bin_} holds no tokens (every document is empty): prepare the data again from "
                               "a corpus with text in it")
    return IndexedDatasetHeader(prefix, dtype, itemsize, n, d - 1, bin_bytes)


def _bin_offset(header: IndexedDatasetHeader, sequence: int) -> int:
    """Where sequence ``sequence`` of ``header``'s dataset starts in its ``.bin`` (its size for the
    sequence count): one read of the ``.idx``'s pointers (all of which ``bridge-submit --verify-data``
    checks: :func:`verify_index`)."""
    if sequence >= header.sequence_count:
        return header.bin_bytes
    with open(header.prefix + ".idx", "rb") as f:
        f.seek(_INDEX_HEADER_BYTES + 4 * header.sequence_count + 8 * sequence)
        return struct.unpack("<q", f.read(8))[0]


#: ``progress(file, bytes done, bytes in all)``: how the checks of every record (``bridge-submit
#: --verify-data``) report on long files.
Progress = Callable[[str, int, int], None]
#: Entries per read when :func:`verify_index` walks an ``.idx``: 12 MiB of lengths and pointers at a time.
_VERIFY_CHUNK = 1 << 20


def _int_array(code: str, data: bytes) -> array.array:
    """Little-endian integers (megatron-core's ``.idx`` on x86 and ARM) as an ``array`` of ``code``."""
    out = array.array(code)
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out


def verify_index(prefix: str, key: str, progress: Optional[Progress] = None) -> int:
    """Check every entry of ``prefix.idx``, not only the last ones that :func:`read_index_header` reads.

    For ``bridge-submit --verify-data``: each sequence's length must be >= 0 and its pointer where the
    sequence before it ends, and the document boundaries must run from 0 up to the sequence count
    without going back. A damaged entry in the middle of an ``.idx`` would otherwise make megatron-core
    read the wrong tokens, or past the end of the ``.bin``, on the ranks, without an error. One pass
    over the ``.idx`` in chunks, with ``array`` (no numpy on the login node); the ``.bin`` is not read.
    Returns the sequence count; raises ConfigError naming the file, the entry and ``key``.
    """
    header = read_index_header(prefix, key)
    n, d = header.sequence_count, header.document_count + 1
    idx, total = prefix + ".idx", _INDEX_HEADER_BYTES + 12 * n + 8 * d
    expected = 0
    try:
        with open(idx, "rb") as f:
            for first in range(0, n, _VERIFY_CHUNK):
                count = min(_VERIFY_CHUNK, n - first)
                f.seek(_INDEX_HEADER_BYTES + 4 * first)
                lengths = _int_array("i", f.read(4 * count))
                f.seek(_INDEX_HEADER_BYTES + 4 * n + 8 * first)
                pointers = _int_array("q", f.read(8 * count))
                for i, (length, pointer) in enumerate(zip(lengths, pointers), first):
                    if length < 0 or pointer != expected:  # (no message built per entry: this loop is the cost)
                        raise ConfigError(f"{idx} is damaged: sequence {i} " + (
                            f"has length {length}" if length < 0 else
                            f"starts at byte {pointer} of the .bin, but the sequences before it end at byte {expected}"),
                            key=key)
                    expected = pointer + length * header.itemsize
                if progress is not None:
                    progress(idx, _INDEX_HEADER_BYTES + 12 * (first + count), total)
            previous = 0
            for first in range(0, d, _VERIFY_CHUNK):
                count = min(_VERIFY_CHUNK, d - first)
                f.seek(_INDEX_HEADER_BYTES + 12 * n + 8 * first)
                for j, boundary in enumerate(_int_array("q", f.read(8 * count)), first):
                    if not (boundary == 0 if j == 0 else previous <= boundary <= n):
                        raise ConfigError(f"{idx} is damaged: document {j} starts at sequence {boundary}, expected "
                                          + ("0" if j == 0 else f"{previous} to {n} (where document {j - 1} starts, "
                                                                "up to the sequence count)"), key=key)
                    previous = boundary
                if progress is not None:
                    progress(idx, _INDEX_HEADER_BYTES + 12 * n + 8 * (first + count), total)
    except OSError as err:
        raise ConfigError(f"{idx} cannot be read: {err.strerror or err}", key=key) from None
    return n
