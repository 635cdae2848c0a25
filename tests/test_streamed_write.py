"""bridge_hpc.training.checkpoint.streamed_write: a synchronous save's files, one thread each, tensors
staged one at a time, writeback started as bytes arrive.

On CPU the tensors are staged through the same host buffer as GPU tensors are (only the copy into
it differs: a CUDA stream there), so the files are checked here byte for byte against what
megatron-core's writer produces for the same bucket: torch's ``_write_item`` of each byte item and of
each tensor staged by ``tensor.to("cpu")`` (a contiguous tensor that views a larger storage is
cloned first, as megatron-core's planning does). The GPU path, inside a real save and resume, is
tests/test_gpu_checkpoint.py's.
"""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _write_item
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from bridge_hpc.training.checkpoint import streamed_write


def _write_one_for(folder):
    """torch's _write_item as megatron-core's writer calls it (its transforms, torch_save format)."""
    import inspect

    transforms = FileSystemWriter(str(folder)).transforms
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE

    def write_one(stream, data, item, key):
        return _write_item(transforms, stream, data, item, key, **extra)

    return write_one


def _tensor_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR)


def _bytes_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)


def _tensors():
    big = torch.randn(64, 33)
    return {
        "fp32": torch.randn(17, 5),
        "bf16": torch.randn(300).to(torch.bfloat16),
        "view at an offset": big[10:20],  # contiguous, but a view of a larger storage
        "transposed": torch.randn(6, 4).t(),  # not contiguous: staged with its strides
        "empty": torch.empty(0, 3),
        "int": torch.arange(1000, dtype=torch.int64),
        "largest": torch.randn(1000, 40),
    }


def _reference_file(path, key, byte_items, tensor_items, write_one):
    """What megatron-core's writer writes for one bucket: staging (clone of a view, ``.to("cpu")``),
    then each item in order, fsynced."""
    results = []
    with open(path, "wb") as stream:
        for item, data in byte_items:
            results.append(write_one(stream, data, item, key))
        for item, tensor in tensor_items:
            if tensor.untyped_storage().size() != tensor.numel() * tensor.itemsize:
                tensor = tensor.clone()
            results.append(write_one(stream, tensor.to("cpu"), item, key))
    return results


def _buckets(folder, tensors, files: int = 3):
    names = list(tensors)
    buckets = []
    for f in range(files):
        mine = names[f::files]
        byte_items = [(_bytes_item(f"obj{f}"), io.BytesIO(f"object {f}".encode()))]
        tensor_items = [(_tensor_item(n), tensors[n]) for n in mine]
        buckets.append((str(folder / f"__0_{f}.distcp"), f"__0_{f}.distcp", (byte_items, tensor_items)))
    return buckets


def test_files_are_byte_for_byte_what_megatrons_writer_writes(tmp_path):
    tensors = _tensors()
    write_one = _write_one_for(tmp_path)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    outcome = streamed_write.write_buckets(_buckets(ours, tensors), write_one)
    assert not isinstance(outcome, BaseException), outcome
    assert sorted(outcome) == [0, 1, 2]
    for index, (path, key, (byte_items, tensor_items)) in enumerate(_buckets(theirs, tensors)):
        expected = _reference_file(path, key, byte_items, tensor_items, write_one)
        got_path = ours / os.path.basename(path)
        assert got_path.read_bytes() == open(path, "rb").read(), os.path.basename(path)
        assert [(r.index, r.size_in_bytes, r.storage_data) for r in outcome[index]] == \
            [(r.index, r.size_in_bytes, r.storage_data) for r in expected]


def test_a_tensor_read_back_equals_the_one_written_with_its_shape_and_strides(tmp_path):
    tensors = _tensors()
    outcome = streamed_write.write_buckets(_buckets(tmp_path, tensors, files=1), _write_one_for(tmp_path))
    data = (tmp_path / "__0_0.distcp").read_bytes()
    for result in outcome[0][1:]:  # the first is the byte item
        info = result.storage_data
        loaded = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]), weights_only=True)
        original = tensors[result.index.fqn]
        assert torch.equal(loaded, original) and loaded.dtype == original.dtype
        assert loaded.stride() == original.to("cpu").stride()


def test_a_failed_file_is_the_outcome_named_by_its_path_and_the_others_are_still_written(tmp_path):
    tensors = _tensors()
    buckets = _buckets(tmp_path, tensors)
    bad = str(tmp_path / "missing-folder" / "__0_1.distcp")
    buckets[1] = (bad,) + buckets[1][1:]
    outcome = streamed_write.write_buckets(buckets, _write_one_for(tmp_path))
    assert isinstance(outcome, OSError) and outcome.errno == errno.ENOENT and outcome.filename == bad
    assert (tmp_path / "__0_0.distcp").stat().st_size > 0 and (tmp_path / "__0_2.distcp").stat().st_size > 0


def test_a_full_disk_behind_torchs_zip_writer_error_is_reported_as_the_oserror(tmp_path):
    def write_one(stream, data, item, key):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos") from exc

    path = str(tmp_path / "__0_0.distcp")
    outcome = streamed_write.write_buckets([(path, "__0_0.distcp", ([], [(_tensor_item("t"), torch.ones(3))]))],
                                           write_one)
    assert isinstance(outcome, OSError) and outcome.errno == errno.ENOSPC and outcome.filename == path


def test_writeback_is_started_chunk_by_chunk_over_the_whole_file(tmp_path, monkeypatch):
    ranges = []
    monkeypatch.setattr(streamed_write, "WRITEBACK_CHUNK", 4096)
    monkeypatch.setattr(streamed_write, "_sync_file_range",
                        lambda fd, offset, nbytes, flags: ranges.append((offset, nbytes, flags)) or 0)
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(6)}  # about 4 kB each
    outcome = streamed_write.write_buckets(_buckets(tmp_path, tensors, files=1), _write_one_for(tmp_path))
    assert not isinstance(outcome, BaseException), outcome
    assert len(ranges) >= 5 and all(flags == 2 for _, _, flags in ranges)
    assert [offset for offset, _, _ in ranges] == [0] + [o + n for o, n, _ in ranges[:-1]]  # back to back
    assert ranges[-1][0] + ranges[-1][1] <= (tmp_path / "__0_0.distcp").stat().st_size


@pytest.mark.skipif(streamed_write._libc_sync_file_range() is None, reason="no sync_file_range here")
def test_the_real_sync_file_range_accepts_the_files_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(streamed_write, "WRITEBACK_CHUNK", 1 << 16)
    tensors = {f"t{i}": torch.randn(50000) for i in range(3)}
    outcome = streamed_write.write_buckets(_buckets(tmp_path, tensors, files=1), _write_one_for(tmp_path))
    assert not isinstance(outcome, BaseException), outcome
