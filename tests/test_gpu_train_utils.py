"""train_utils on a CUDA device: the memory history snapshot for pytorch.org/memory_viz, report_memory's
numbers against the allocator's, and the parameter norm of bf16 parameters under NCCL. Skipped without CUDA."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from bridge_hpc.training.config import GPTModelConfig, ProfilingConfig  # noqa: E402
from bridge_hpc.training.utils.train_utils import (  # noqa: E402
    _maybe_dump_memory_snapshot,
    calc_params_l2_norm,
    reduce_max_stat_across_model_parallel_group,
    report_memory,
    start_memory_history_recording,
)

MIB = 1 << 20


def test_memory_history_snapshot(tmp_path):
    profiling = ProfilingConfig(record_memory_history=True, memory_snapshot_path=str(tmp_path / "snap.pickle"),
                                profile_ranks=[0], profile_step_start=1, profile_step_end=3)
    start_memory_history_recording(profiling)
    try:
        marker = torch.empty(37 * MIB, dtype=torch.uint8, device="cuda")  # an allocation to find in the trace
        assert _maybe_dump_memory_snapshot(profiling, step=2) is None  # only at profile_step_end
        path = _maybe_dump_memory_snapshot(profiling, step=3)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert path == str(tmp_path / "snap_0.pickle") and os.path.getsize(path) > 0
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"], "no live segments in the snapshot"
    events = [e for trace in snapshot["device_traces"] for e in trace]
    allocs = [e for e in events if e["action"] == "alloc" and e["size"] == 37 * MIB]
    assert allocs, "the 37 MiB allocation is not in the history"
    assert allocs[-1]["frames"], "no call site recorded (memory_viz shows none)"
    del marker


def test_report_memory_numbers():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()["allocated_bytes.all.current"]
    block = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()
    got = report_memory(None)
    after = stats["allocated_bytes.all.current"]
    assert after - before == 256 * MIB

    def gb(n):  # 10^9 bytes, 5 significant digits
        return round(n / 1e9, -int(math.floor(math.log10(n / 1e9))) + 4)

    assert got["mem-allocated-gigabytes"] == gb(after)
    assert got["mem-max-allocated-gigabytes"] == gb(stats["allocated_bytes.all.peak"]) >= gb(after)
    assert got["mem-reserved-gigabytes"] >= got["mem-allocated-gigabytes"]
    assert got["mem-alloc-retires"] == stats["num_alloc_retries"] and isinstance(got["mem-alloc-retires"], int)
    assert set(got) == {"mem-allocated-gigabytes", "mem-active-gigabytes", "mem-inactive-gigabytes",
                        "mem-reserved-gigabytes", "mem-max-allocated-gigabytes", "mem-max-active-gigabytes",
                        "mem-max-inactive-gigabytes", "mem-max-reserved-gigabytes", "mem-alloc-retires",
                        "mem-allocated-count"}
    assert report_memory({"allocated_bytes.all.current": "x-bytes"}) == {"x-gigabytes": gb(after)}
    del block


def test_params_norm_and_stat_under_nccl():
    import torch.distributed as dist
    from bridge_test_helpers import free_port
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.skip("another test left a process group up in this process")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        layer = torch.nn.Linear(2, 1, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[3.0, 4.0]]))
        assert calc_params_l2_norm([layer], GPTModelConfig(bf16=True)) == 5.0
        mp = parallel_state.get_model_parallel_group()
        assert reduce_max_stat_across_model_parallel_group(1.25, mp) == 1.25
        assert reduce_max_stat_across_model_parallel_group(None, mp) is None
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
