"""A Hugging Face folder's ``*.safetensors`` files, read with the standard library.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range in the data that follows) and the data. Reading the headers alone tells, on the
login node and without torch, which tensors a folder holds, their shapes and dtypes, and whether a
file was cut short or has bytes after its last tensor, or whether the tensors' byte ranges overlap or
leave gaps (safetensors refuses such a file): what ``bridge-submit`` and ``bridge-hf`` check before any
rank starts. The contents of the tensors are not checked here: the format carries no checksum, so
damaged bytes inside a tensor show only where they make a value NaN or infinite, which the ranks'
reader refuses (:mod:`bridge_hpc.training.hf.load`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

from bridge_hpc.contracts.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: safetensors dtype -> bytes per element, for the dtypes a model's weights come in.
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
#: safetensors dtype -> torch dtype name (what the loader casts from; ``config.json``'s ``dtype``).
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: The largest header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the folder: the file that holds it, its dtype and shape."""

    name: str
    file: str
    dtype: str
    shape: Tuple[int, ...]


def read_header(path: str) -> Dict[str, TensorInfo]:
    """The tensors of one safetensors file by name; ConfigError naming the file (and tensor) when the
    file is missing, its header is not the format's, or the file is shorter than its header says."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"truncated: {size} bytes, not even a safetensors header", path=path)
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"not a safetensors file, or truncated: its header claims {length} bytes, the file "
                                  f"has {size}", path=path)
            header = json.loads(f.read(length).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError("missing", path=path) from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"unreadable safetensors header ({type(err).__name__}: {err})", path=path) from None
    if not isinstance(header, dict):
        raise ConfigError("unreadable safetensors header (not a JSON object)", path=path)
    tensors, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
            start, stop = int(start), int(stop)
        except (KeyError, TypeError, ValueError):
            raise ConfigError("unreadable safetensors header entry", path=path, key=name) from None
        count = 1
        for n in shape:
            count *= n
        if dtype in FLOAT_DTYPES and stop - start != count * FLOAT_DTYPES[dtype]:
            raise ConfigError(f"header gives {stop - start} bytes for a {dtype} tensor of shape {list(shape)}",
                              path=path, key=name)
        ranges.append((start, stop, name))
        tensors[name] = TensorInfo(name, path, dtype, shape)
    end = 0  # the tensors' bytes follow each other from the data's start, as safetensors requires
    for start, stop, name in sorted(ranges):
        if start != end or stop < start:
            what = "overlaps the tensor before it" if start < end else "leaves a gap after the tensor before it"
            raise ConfigError(f"header gives it bytes {start} to {stop} of the data, which {what} (at {end}): not "
                              "a file safetensors reads", path=path, key=name)
        end = stop
    if size < 8 + length + end:
        raise ConfigError(f"truncated: {size} bytes, its header says {8 + length + end}", path=path)
    if size > 8 + length + end:
        raise ConfigError(f"{size} bytes, its header says {8 + length + end}: bytes after its last tensor (appended "
                          "to, or another file's header): not a file safetensors reads", path=path)
    return tensors


class SafetensorsFolder:
    """The tensors of a Hugging Face folder: ``model.safetensors.index.json`` and the shards it names,
    or one ``model.safetensors`` (or the folder's only ``*.safetensors``). Every header is read and
    checked when it is built (:func:`read_header`); tensor data is not read here."""

    def __init__(self, folder: str):
        self.folder = folder
        self.tensors: Dict[str, TensorInfo] = {}
        for path in self._files():
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise ConfigError(f"also in {self.tensors[name].file}: a tensor must be in one file", path=path,
                                      key=name)
                self.tensors[name] = info
        if self._index is not None:
            for name, file in self._index.items():
                got = self.tensors.get(name)
                if got is None or os.path.basename(got.file) != file:
                    raise ConfigError(f"the index names {file} for it, which does not hold it",
                                      path=os.path.join(folder, INDEX_FILE), key=name)

    def _files(self) -> List[str]:
        index_path = os.path.join(self.folder, INDEX_FILE)
        self._index = None
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError("weight_map is not an object of file names")
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"unreadable index ({type(err).__name__}: {err})", path=index_path) from None
            for file in weight_map.values():
                if os.path.basename(file) != file or file in ("", ".", ".."):
                    raise ConfigError(f"names {file!r}: expected a file name in the folder", path=index_path)
            self._index = weight_map
            return [os.path.join(self.folder, f) for f in sorted(set(weight_map.values()))]
        single = os.path.join(self.folder, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        found = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors")) if os.path.isdir(self.folder) else []
        if len(found) == 1:
            return [os.path.join(self.folder, found[0])]
        what = f"{len(found)} *.safetensors files and no {INDEX_FILE}" if found else "no *.safetensors file"
        raise ConfigError(f"{what}: expected {SINGLE_FILE}, or shards with their {INDEX_FILE}", path=self.folder)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def dtype(self) -> str:
        """The dtype name most of the weights are stored in (what an export writes by default)."""
        counts: Dict[str, int] = {}
        for info in self:
            counts[info.dtype] = counts.get(info.dtype, 0) + 1
        return DTYPE_NAMES.get(max(counts, key=counts.get), "float32") if counts else "float32"
