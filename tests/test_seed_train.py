"""The seed page of ``bridge.training.train`` (shared/seeds/002_*): the progress-log functions and the
forward pre-hook functions, under ``bridge_hpc.training.train``, with hand-computed expectations.

The pre-hook tests use real megatron-core ``DistributedDataParallel`` chunks on gloo, world size 1.
megatron-core allocates DDP's parameter and gradient buffers on ``torch.cuda.current_device()``; on
this CPU-only machine the fixture points that at the CPU while the chunks are built (and only then),
so the chunks, their bucket groups and their hooks are megatron's own. (megatron-core's optimizer
cannot be built on CPU at all: it allocates on 'cuda' unconditionally, which is why pretrain uses torch
DDP there and why the whole save path is tested on the GPU: tests/test_gpu_forward_pre_hook.py.)
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
from bridge_test_helpers import TINY, free_port

torch = pytest.importorskip("torch")

from bridge_hpc.contracts.progress_log import ProgressLog, parse_events  # noqa: E402
from bridge_hpc.training import train  # noqa: E402
from bridge_hpc.training.state import GlobalState  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _line(epoch: float, job: int, world: int, event: str, *fields: str) -> str:
    return "\t".join([_stamp(epoch), f"Job ID: {job}", f"# GPUs: {world}", event, *fields]) + "\n"


def _saved(epoch: float, job: int, world: int, iteration: int, flops: float) -> str:
    return _line(epoch, job, world, "Saved checkpoint", f"Iteration: {iteration}", "Job throughput: 1.0 TFLOP/s/GPU",
                 "Cumulative throughput: 1.0 TFLOP/s/GPU", f"Floating-point operations: {flops:.2e}",
                 "Tokens (in billions): 0.10")


def _config(tmp_path: Path, *overrides: str):
    from bridge_hpc.rank import build_config

    return build_config(str(TINY), [f"job.run_dir={tmp_path}", *overrides])


@pytest.fixture
def launcher_world(monkeypatch):
    """No torch.distributed; the launcher's world size is what the functions see (torchrun variables)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    for key in [k for k in os.environ if k.startswith("SLURM_") or k == "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(key)

    def set_world(size: int) -> None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(size))

    return set_world


T0 = time.mktime((2024, 3, 1, 10, 0, 0, 0, 0, -1))  # local time, whole seconds, as the log stores it
HOUR = 3600.0


def _write_log(path: Path) -> None:
    """8 GPUs, then 16, then 8 again twice; an async-save line that must not count as saved."""
    path.write_text(
        _line(T0, 1, 8, "Starting job", "Restart count: 0")
        + _saved(T0 + 1 * HOUR, 1, 8, 100, 1.0e18)
        + _line(T0 + 2 * HOUR, 2, 16, "Starting job", "Restart count: 0")
        + _saved(T0 + 3 * HOUR, 2, 16, 200, 3.0e18)
        + _line(T0 + 4 * HOUR, 3, 8, "Starting job", "Restart count: 0")
        + _saved(T0 + 5 * HOUR, 3, 8, 300, 4.0e18)
        + _line(T0 + 6 * HOUR, 4, 8, "Starting job", "Restart count: 0")
        + _line(T0 + 6.5 * HOUR, 4, 8, "Saving async checkpoint", "Iteration: 400",
                "Job throughput: 1.0 TFLOP/s/GPU", "Cumulative throughput: 1.0 TFLOP/s/GPU",
                "Floating-point operations: 9.00e+18", "Tokens (in billions): 0.40"))


def test_start_time_is_the_first_job_of_the_world_size_since_it_last_changed(tmp_path, launcher_world):
    cfg = _config(tmp_path)
    os.makedirs(cfg.checkpoint.save, exist_ok=True)
    _write_log(Path(cfg.checkpoint.save) / "progress.txt")

    # 8 GPUs: the 16-GPU lines restart the search, so job 3 (T0 + 4 h) is the start; its baseline is
    # the last saved checkpoint before it, job 2's 3e18 (saved at another world size: still the
    # model's FLOPs count), not job 1's 1e18; job 4's async line is after it and not a save anyway.
    launcher_world(8)
    assert train.get_start_time_from_progress_log(cfg) == (datetime.datetime.fromtimestamp(T0 + 4 * HOUR), 3.0e18)

    # 16 GPUs: its only run is followed by 8-GPU lines, so there is no start of this size to count from.
    launcher_world(16)
    with pytest.raises(ValueError, match="# GPUs: 16"):
        train.get_start_time_from_progress_log(cfg)

    # The first run alone: its own start, nothing saved before it.
    (Path(cfg.checkpoint.save) / "progress.txt").write_text(_line(T0, 1, 8, "Starting job", "Restart count: 0")
                                                            + _saved(T0 + HOUR, 1, 8, 100, 1.0e18))
    launcher_world(8)
    assert train.get_start_time_from_progress_log(cfg) == (datetime.datetime.fromtimestamp(T0), 0.0)


def test_start_time_errors_name_what_is_missing(tmp_path, launcher_world):
    launcher_world(8)
    cfg = _config(tmp_path)
    with pytest.raises(FileNotFoundError):
        train.get_start_time_from_progress_log(cfg)
    cfg.checkpoint.save = None
    with pytest.raises(ValueError, match="checkpoint.save"):
        train.get_start_time_from_progress_log(cfg)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_throughputs_line_by_hand(tmp_path, launcher_world):
    """A requeued 8-GPU job after a 16-GPU one: job throughput counts from this process's start and the
    FLOPs of the loaded checkpoint, cumulative throughput from this world size's first start."""
    launcher_world(8)
    cfg = _config(tmp_path)
    path = Path(cfg.checkpoint.save) / "progress.txt"
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(_line(T0, 1, 16, "Starting job", "Restart count: 0") + _saved(T0 + HOUR, 1, 16, 50, 2.0e18))

    t1 = T0 + 2 * HOUR
    clock = Clock(t1)
    state = GlobalState()
    state.cfg = cfg
    state.progress = ProgressLog(str(path), "2", 8, clock=clock)
    state.progress.starting_job(startup_s=100.0)           # process started at t1 - 100 s
    state.progress.loaded_checkpoint(50, 5.0, flops_so_far=2.0e18)
    ts = state.train_state
    ts.step, ts.consumed_train_samples = 150, 5_000_000     # tokens = 5e6 x seq_length 32 = 1.6e8
    state.last_save_s = 12.5
    clock.t = t1 + 900.0

    assert train.compute_throughputs_and_append_to_progress_log(state, 1.0e19) is None

    line = path.read_text().splitlines()[-1].split("\t")
    # job: (1e19 - 2e18) / ((900 + 100) s x 1e12 x 8) = 8e18 / 8e15 = 1000.0
    # cumulative: (1e19 - 2e18) / (900 s x 1e12 x 8) = 8e18 / 7.2e15 = 1111.1 (this run's line is the
    # first 8-GPU start; the baseline is the 16-GPU job's save, 2e18)
    assert line[1:] == ["Job ID: 2", "# GPUs: 8", "Saved checkpoint", "Iteration: 150",
                        "Job throughput: 1000.0 TFLOP/s/GPU", "Cumulative throughput: 1111.1 TFLOP/s/GPU",
                        "Floating-point operations: 1.00e+19", "Tokens (in billions): 0.16", "Save seconds: 12.5"]
    assert line[0] == _stamp(t1 + 900.0)
    # Megatron reads the FLOPs positionally (8th token); the parsers read the line back.
    assert line[7] == "Floating-point operations: 1.00e+19"
    assert parse_events(str(path))[-1].number("Floating-point operations") == 1.0e19
    # The same baseline as the seed's start-time function reads from the file now.
    assert train.get_start_time_from_progress_log(cfg) == (datetime.datetime.fromtimestamp(t1), 2.0e18)

    # No progress log (logger.log_progress off, or not rank 0): nothing is written.
    before = path.read_text()
    state.progress = None
    train.compute_throughputs_and_append_to_progress_log(state, 2.0e19)
    assert path.read_text() == before


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("dist_opt", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_should_disable_forward_pre_hook_truth_table(fsdp, dist_opt, overlap):
    assert train.should_disable_forward_pre_hook(fsdp, dist_opt, overlap) is (not fsdp and dist_opt and overlap)


# ---------------------------------------------------------------------------------------------
# Real megatron-core DDP chunks on CPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ddp_chunks(monkeypatch):
    """Two megatron-core DDP chunks (distributed optimizer + overlapped param gather) on gloo, world 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class TwoLayers(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.second(self.first(x))

    chunks = []
    with monkeypatch.context() as m:  # DDP's buffers go to the current CUDA device: the CPU, here
        m.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        for _ in range(2):
            ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True,
                                                       overlap_grad_reduce=True)
            chunks.append(DistributedDataParallel(config, ddp_config, TwoLayers()))
    try:
        yield chunks
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _hooks(chunk) -> list:
    """Forward pre-hooks on each submodule of the chunk's module (megatron registers one on each)."""
    return [len(module._forward_pre_hooks) for module in chunk.module.modules()]


def test_disable_and_enable_reach_every_chunk(ddp_chunks, monkeypatch):
    assert [_hooks(c) for c in ddp_chunks] == [[1, 1, 1], [1, 1, 1]]  # registered by the DDP constructor

    syncs = []
    for i, chunk in enumerate(ddp_chunks):  # megatron's own start_param_sync runs; we note each call
        real = chunk.start_param_sync
        monkeypatch.setattr(chunk, "start_param_sync",
                            lambda *a, _i=i, _real=real, **k: (syncs.append((_i, k)), _real(*a, **k))[1])

    train.disable_forward_pre_hook(ddp_chunks, param_sync=False)
    assert [_hooks(c) for c in ddp_chunks] == [[0, 0, 0], [0, 0, 0]]
    assert syncs == []
    train.enable_forward_pre_hook(ddp_chunks)
    assert [_hooks(c) for c in ddp_chunks] == [[1, 1, 1], [1, 1, 1]]

    train.disable_forward_pre_hook(ddp_chunks)  # param_sync defaults to True: a synchronous all-gather
    assert syncs == [(0, {"force_sync": True}), (1, {"force_sync": True})]
    assert [_hooks(c) for c in ddp_chunks] == [[0, 0, 0], [0, 0, 0]]
    train.enable_forward_pre_hook(ddp_chunks)
    for chunk in ddp_chunks:  # the re-registered hooks run megatron's gather wait in a real forward
        chunk.zero_grad_buffer()
        assert chunk(torch.ones(3, 8)).shape == (3, 2)


def test_chunks_that_are_not_megatron_ddp_are_refused(ddp_chunks):
    with pytest.raises(TypeError, match="megatron-core DistributedDataParallel.*Linear"):
        train.disable_forward_pre_hook([ddp_chunks[0], torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="Linear"):
        train.enable_forward_pre_hook([torch.nn.Linear(2, 2)])


def test_saves_toggle_the_hooks_only_when_the_config_asks(ddp_chunks, tmp_path):
    """The context the save path and evaluation run in (save_checkpoint_and_time, the async save)."""
    state = GlobalState()
    state.cfg = _config(tmp_path, "ddp.use_distributed_optimizer=true", "ddp.overlap_param_gather=true",
                        "optimizer.use_distributed_optimizer=true")
    with train.forward_pre_hooks_off(state, ddp_chunks):
        assert [_hooks(c) for c in ddp_chunks] == [[0, 0, 0], [0, 0, 0]]
    assert [_hooks(c) for c in ddp_chunks] == [[1, 1, 1], [1, 1, 1]]
    with pytest.raises(RuntimeError, match="save failed"):  # a failed save leaves training as it was
        with train.forward_pre_hooks_off(state, ddp_chunks):
            raise RuntimeError("save failed")
    assert [_hooks(c) for c in ddp_chunks] == [[1, 1, 1], [1, 1, 1]]

    state.cfg.ddp.overlap_param_gather = False  # no overlap: nothing to toggle
    with train.forward_pre_hooks_off(state, ddp_chunks):
        assert [_hooks(c) for c in ddp_chunks] == [[1, 1, 1], [1, 1, 1]]

    # CPU training (torch DDP): the flags are accepted and have no effect; nothing is toggled.
    state.cfg.ddp.overlap_param_gather = True
    with train.forward_pre_hooks_off(state, [torch.nn.Linear(2, 2)]):
        pass


# ---------------------------------------------------------------------------------------------
# post_training_step_callbacks and TNvtxContext
# ---------------------------------------------------------------------------------------------


class _Cycle:
    """An object only the cycle collector frees: it refers to itself."""

    def __init__(self):
        self.me = self


def test_post_training_step_callbacks_collect_garbage_every_manual_gc_interval(tmp_path):
    import gc
    import weakref

    cfg = _config(tmp_path, "train.manual_gc=true", "train.manual_gc_interval=3")
    gc.disable()  # as megatron does under manual_gc: only the callback collects
    try:
        for iteration, collected in [(4, False), (5, False), (6, True), (7, False), (9, True)]:
            probe = _Cycle()
            alive = weakref.ref(probe)
            del probe
            train.post_training_step_callbacks([], 0.0, None, iteration, None, cfg, False)
            assert (alive() is None) is collected, iteration
            gc.collect()
        off = _config(tmp_path, "train.manual_gc=false", "train.manual_gc_interval=3")
        probe = _Cycle()
        alive = weakref.ref(probe)
        del probe
        train.post_training_step_callbacks([], 0.0, None, 6, None, off, False)
        assert alive() is not None  # manual_gc off: the interval alone does nothing
    finally:
        gc.enable()
        gc.collect()


def test_post_training_step_callbacks_close_the_profiler_window_and_the_nvtx_context(tmp_path):
    from bridge_hpc.training.profiling import TNvtxContext

    assert TNvtxContext is torch.autograd.profiler.emit_nvtx  # Bridge's alias: the context nsys records
    cfg = _config(tmp_path, "profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2",
                  "profiling.profile_step_end=4")
    traces = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  # active longer than the window: only prof.stop() writes the trace
                                  schedule=torch.profiler.schedule(wait=0, warmup=0, active=10, repeat=1),
                                  on_trace_ready=lambda p: traces.append(len(p.events())))

    class Context:  # stands for an entered emit_nvtx, whose __exit__ needs a CUDA build of torch
        exits = []

        def __exit__(self, *exc):
            self.exits.append(exc)

    nvtx = Context()
    prof.start()
    for iteration in (2, 3):
        torch.ones(8).sum()
        train.post_training_step_callbacks([], 0.0, None, iteration, prof, cfg, False, nsys_nvtx_context=nvtx)
        assert not nvtx.exits and not traces
    torch.ones(8).sum()
    train.post_training_step_callbacks([], 0.0, None, 4, prof, cfg, False, nsys_nvtx_context=nvtx)
    assert nvtx.exits == [(None, None, None)]  # exited once, at profile_step_end
    assert len(traces) == 1 and traces[0] > 0  # prof.stop() at profile_step_end wrote the window's trace


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("manual_gc", [True, False])
def test_manual_gc_turns_automatic_collection_off_for_the_steps_only(tmp_path, manual_gc):
    """Megatron's and Bridge's ``train.manual_gc``: garbage is collected only by the loop (every
    ``manual_gc_interval`` steps), never by Python's own trigger on one rank in the middle of a step;
    the process gets its automatic collection back when training returns."""
    import gc

    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain

    seen = []

    def recording_forward_step(state, data_iterator, model):
        seen.append(gc.isenabled())
        return forward_step(state, data_iterator, model)

    cfg = _config(tmp_path, f"job.run_dir={tmp_path / 'run'}", "train.train_iters=6", "train.global_batch_size=4",
                  "train.eval_interval=0", f"train.manual_gc={str(manual_gc).lower()}", "train.manual_gc_interval=2")
    assert gc.isenabled()
    pretrain(cfg, recording_forward_step)
    assert len(seen) == 6 * 4 // 2 and set(seen) == {not manual_gc}, seen  # every micro-batch of every step
    assert gc.isenabled()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("manual_gc", [True, False])
def test_the_start_up_heap_is_frozen_for_the_steps_and_their_cycles_are_still_collected(tmp_path, manual_gc, monkeypatch):
    """The objects start-up left (imports, model, optimizer) are out of the collector's walks while the
    steps run (``gc.freeze``, bridge_hpc.training.process.heap), so a full collection no longer stalls a rank for
    tenths of a second; a reference cycle the steps make is still collected; a cycle dropped before
    ``pretrain`` (frozen with the imports, without a walk) is freed by the first full collection after
    training returns, when the heap is unfrozen (the process's first run: a later one collects first,
    tests/test_heap.py)."""
    import gc
    import weakref

    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain
    from bridge_hpc.training.process import heap

    monkeypatch.setattr(heap, "_runs_started", 0)  # as in a fresh process, whatever ran in this one before

    frozen, cycles_freed, earlier_cycle_alive = [], [], []
    earlier_garbage = _Cycle()
    earlier = weakref.ref(earlier_garbage)
    del earlier_garbage

    def recording_forward_step(state, data_iterator, model):
        frozen.append(gc.get_freeze_count())
        probe = _Cycle()
        alive = weakref.ref(probe)
        del probe
        gc.collect()
        cycles_freed.append(alive() is None)
        earlier_cycle_alive.append(earlier() is not None)
        return forward_step(state, data_iterator, model)

    cfg = _config(tmp_path, f"job.run_dir={tmp_path / 'run'}", "train.train_iters=6", "train.global_batch_size=4",
                  "train.eval_interval=0", f"train.manual_gc={str(manual_gc).lower()}")
    assert gc.get_freeze_count() == 0
    pretrain(cfg, recording_forward_step)
    assert len(frozen) == 6 * 4 // 2 and min(frozen) > 10_000, frozen  # torch's and megatron's objects at least
    assert all(cycles_freed), cycles_freed
    assert all(earlier_cycle_alive), earlier_cycle_alive  # frozen: no collection during the steps walks it
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.collect()
    assert earlier() is None


def test_a_negative_manual_gc_interval_is_refused_naming_the_key(tmp_path):
    from bridge_hpc.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="train.manual_gc_interval"):
        _config(tmp_path, "train.manual_gc=true", "train.manual_gc_interval=-1")
