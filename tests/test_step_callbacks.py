"""What ``post_training_step_callbacks`` does for the GPU-side ``[train]`` / ``[profiling]`` fields, with torch's
CUDA calls recorded (the CPU machine has no GPU; tests/test_gpu_*.py run the real ones): nsys's capture range
(``profiling.use_nsys_profiler`` on ``profile_ranks``), ``train.train_sync_interval``,
``train.empty_unused_memory_level``; and the torch profiler's ``pytorch_profiler_collect_*`` options."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from bridge_hpc.training import train as train_module

sys.path.insert(0, os.path.dirname(__file__))
from test_seed_config import _python_built  # noqa: E402


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch's CUDA entry points the callbacks use, recorded instead of run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("profiler.start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("profiler.stop"))

    @contextlib.contextmanager
    def emit_nvtx(record_shapes=False):
        calls.append(f"nvtx(record_shapes={record_shapes})")
        yield
        calls.append("nvtx end")

    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", emit_nvtx)
    return calls


def _callbacks(cfg, steps):
    for step in steps:
        train_module.post_training_step_callbacks([], 0.0, None, step, None, cfg)


def test_nsys_capture_range_opens_at_start_and_closes_at_end(cuda_calls):
    cfg = _python_built()
    cfg.profiling.use_nsys_profiler, cfg.profiling.record_shapes = True, True
    cfg.profiling.profile_step_start, cfg.profiling.profile_step_end = 3, 5
    _callbacks(cfg, range(1, 8))
    assert cuda_calls == ["profiler.start", "nvtx(record_shapes=True)", "nvtx end", "profiler.stop"]


def test_nsys_only_on_profile_ranks(cuda_calls):
    cfg = _python_built()
    cfg.profiling.use_nsys_profiler, cfg.profiling.profile_ranks = True, [1]
    _callbacks(cfg, range(1, 20))  # this process is rank 0
    assert cuda_calls == []


@pytest.mark.parametrize("interval, level, expected", [
    (2, 0, ["synchronize", "synchronize"]),  # steps 2 and 4
    (None, 1, ["empty_cache"] * 4),
    (None, 0, []),
])
def test_sync_interval_and_empty_cache(cuda_calls, interval, level, expected):
    cfg = _python_built()
    cfg.train.train_sync_interval, cfg.train.empty_unused_memory_level = interval, level
    _callbacks(cfg, range(1, 5))
    assert cuda_calls == expected


def test_torch_profiler_collects_shapes_and_call_stacks(monkeypatch, tmp_path):
    from bridge_hpc.training.state import GlobalState

    seen = {}

    class Profile:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def start(self):
            seen["started"] = True

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    state = GlobalState()
    state.cfg = _python_built()
    p = state.cfg.profiling
    p.use_pytorch_profiler, p.pytorch_profiler_collect_shapes, p.pytorch_profiler_collect_callstack = True, True, True
    state.cfg.logger.tensorboard_dir = str(tmp_path)
    assert train_module._start_profiler(state) is not None
    assert seen["record_shapes"] is True and seen["with_stack"] is True and seen["started"]


@pytest.mark.parametrize("decoupled, expected", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_decoupled_weight_decay_picks_adamw_or_adam_on_cpu(decoupled, expected):
    from bridge_hpc.training.engine.optimizer import setup_optimizer

    cfg = _python_built(decoupled_weight_decay=decoupled, log_num_zeros_in_grad=True)
    cfg.optimizer.finalize()
    model = [torch.nn.Linear(4, 4)]
    optimizer = setup_optimizer(cfg, model)
    assert type(optimizer.optimizer) is expected
    model[0].weight.grad = torch.zeros(4, 4)
    model[0].bias.grad = torch.ones(4)
    _, _, zeros = optimizer.step()
    assert zeros == 16  # log_num_zeros_in_grad: counted on CPU too


def test_exit_signal_handler_for_training_adds_sigint_and_sigterm():
    from bridge_hpc.training.config import TrainingConfig

    t = TrainingConfig(train_iters=4, micro_batch_size=1, global_batch_size=1, exit_signal=["SIGUSR1"],
                       exit_signal_handler_for_training=True)
    t.finalize()
    assert t.exit_signal == ["SIGUSR1", "SIGINT", "SIGTERM"]


def test_manual_gc_eval_collects_around_each_evaluation(monkeypatch):
    import gc

    from bridge_hpc.training.state import GlobalState

    events = []
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect"))
    monkeypatch.setattr(train_module, "evaluate", lambda *a, **k: (events.append("evaluate"), ({}, None))[1])
    state = GlobalState()
    state.cfg = _python_built()
    state.cfg.train.manual_gc = True

    class Metrics:
        def validation(self, step, values, perplexity=False):
            events.append("logged")

    monkeypatch.setattr(GlobalState, "metrics", property(lambda self: Metrics()))
    train_module.evaluate_and_print_results(state, "x", None, None, [])
    assert events == ["collect", "evaluate", "collect", "logged"]
    events.clear()
    state.cfg.train.manual_gc_eval = False
    train_module.evaluate_and_print_results(state, "x", None, None, [])
    assert events == ["evaluate", "logged"]


def test_sharp_nccl_config_and_stream_priorities_reach_megatron_core(monkeypatch):
    from megatron.core import parallel_state

    from bridge_hpc.training.engine import parallel

    seen = {}
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: seen.update(kw))
    cfg = _python_built()
    d = cfg.dist
    d.use_sharp, d.sharp_enabled_group = True, "dp_replica"
    d.nccl_communicator_config_path, d.high_priority_stream_groups = "/etc/nccl.yaml", ["dp", "tp"]
    parallel.initialize(cfg)
    assert (seen["use_sharp"], seen["sharp_enabled_group"], seen["nccl_communicator_config_path"],
            seen["high_priority_stream_groups"]) == (True, "dp_replica", "/etc/nccl.yaml", ["dp", "tp"])
