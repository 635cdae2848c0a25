"""bridge_hpc.training.checkpoint.mapped_read through the toolkit's parallel DCP reader: tensors come
out of the mapped files equal to what was saved; byte items and unmappable files go to torch's own
read. (Loads inside training runs: tests/test_training_resume.py and the GPU tests.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bridge_hpc.training.checkpoint import mapped_read
from bridge_hpc.training.checkpoint.megatron import _parallel_reader

pytestmark = [pytest.mark.skipif(not mapped_read.available(), reason="this torch lacks the internals"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state():
    return {"fp32": torch.randn(300, 7), "bf16": torch.randn(1000).to(torch.bfloat16),
            "int": torch.arange(77, dtype=torch.int64), "nested": {"x": torch.randn(3, 2, 5)},
            "scalar": torch.tensor(2.5), "obj": [3, "adam"]}


def _zeros_like(state):
    return {k: _zeros_like(v) if isinstance(v, dict) and k != "obj" else
            (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}


def _assert_loaded(saved, loaded):
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, loaded[key]) and value.dtype == loaded[key].dtype, key
        elif key == "obj":
            assert loaded[key] == value
        else:
            _assert_loaded(value, loaded[key])


def _load(folder, target):
    dcp.load(target, storage_reader=_parallel_reader(dcp.FileSystemReader)(str(folder)))


def test_tensors_come_from_the_mapping_and_byte_items_from_torch(tmp_path, monkeypatch):
    saved = _state()
    dcp.save(saved, checkpoint_id=str(tmp_path))
    by_torch = []
    read_items = mapped_read.read_items

    def spy(reader, items, planner, read_with_torch):
        return read_items(reader, items, planner, lambda others: (by_torch.extend(others), read_with_torch(others)))

    monkeypatch.setattr(mapped_read, "read_items", spy)
    loaded = _zeros_like(saved)
    _load(tmp_path, loaded)
    _assert_loaded(saved, loaded)
    from torch.distributed.checkpoint.planner import LoadItemType

    assert by_torch and all(item.type == LoadItemType.BYTE_IO for item in by_torch)


def test_a_file_that_cannot_be_mapped_is_read_by_torch(tmp_path, monkeypatch):
    saved = _state()
    dcp.save(saved, checkpoint_id=str(tmp_path))

    def no_mapping(*args, **kwargs):
        raise RuntimeError("mmap failed")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", no_mapping)
    loaded = _zeros_like(saved)
    _load(tmp_path, loaded)
    _assert_loaded(saved, loaded)
