"""bridge_hpc.training.utils.train_utils: Megatron Bridge's norms, reports, model-parallel collectives,
model hooks and their wiring into the step log, with hand-computed expectations.

Single-rank tests run in this process (gloo, world size 1, megatron parallel_state TP=PP=1); one test
launches this file under torchrun with 2 ranks for the collectives (DP=2, TP=2, PP=2 and a DTensor mesh).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time

import pytest
import torch
from bridge_test_helpers import TINY, single_rank_world
from warm_ranks import run_ranks

from bridge_hpc.training.config import GPTModelConfig, ProfilingConfig, TrainingConfig
from bridge_hpc.training.state import GlobalState, TrainState
from bridge_hpc.training.utils.train_utils import (
    MEMORY_KEYS,
    LinearForLastLayer,
    ModelHook,
    ModelList,
    calc_dtensor_params_l2_norm,
    calc_params_l2_norm,
    create_value_head_hook,
    freeze_moe_router,
    logical_and_across_model_parallel_group,
    make_value_model,
    reduce_max_memory_across_pp_group,
    reduce_max_stat_across_model_parallel_group,
    report_l2_norm_grad,
    report_memory,
    report_runtime,
    report_throughput,
    start_memory_history_recording,
    training_log,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Toy(torch.nn.Module):
    """Known weights: w = [[1, 2], [3, 4]], b = [1, 1] (|.|^2 = 30 + 2 = 32), and a tied copy of w
    marked ``shared`` as megatron marks the last stage's output-layer weight (counted once: skipped)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        self.b = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
        self.tied = torch.nn.Parameter(torch.tensor([100.0]))
        self.tied.shared = True


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_world()


def _tiny_gpt(**overrides):
    from bridge_hpc.training.engine.model import gpt_model_provider

    cfg = GPTModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8,
                         hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    cfg.finalize()
    return gpt_model_provider(cfg)


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------


def test_params_l2_norm_by_hand(single_rank):
    fp32 = GPTModelConfig()
    assert calc_params_l2_norm(Toy(), fp32) == pytest.approx(math.sqrt(32))  # the shared copy is not counted
    assert calc_params_l2_norm([Toy(), Toy()], fp32) == pytest.approx(math.sqrt(64))  # chunks add up

    bf16 = GPTModelConfig(bf16=True)
    model = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 4.0]]))
    assert calc_params_l2_norm(model, bf16) == 5.0  # an fp32 copy of the bf16 values
    # bf16 with the optimizer's fp32 main copy: that one is read, unless an fp32 copy is forced
    model.weight.main_param = torch.tensor([[6.0, 8.0]])
    assert calc_params_l2_norm(model, bf16) == 10.0
    assert calc_params_l2_norm(model, bf16, force_create_fp32_copy=True) == 5.0


def test_params_l2_norm_of_a_megatron_gpt(single_rank):
    model = _tiny_gpt()
    by_hand = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    assert calc_params_l2_norm([model], GPTModelConfig()) == pytest.approx(by_hand, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def test_report_throughput_by_hand():
    train = TrainingConfig(global_batch_size=8, micro_batch_size=2)
    history = [10.0, 12.0, 14.0, 16.0, 18.0]  # seconds since start at the end of steps 6..10
    # window 3: the last 3 times (14, 16, 18) span 2 steps in 4 s
    got = report_throughput(train, iteration=10, seq_length=32, history_wct=history, window_size=3)
    assert got == {
        "throughput/batches_per_sec": 0.5, "throughput/samples_per_sec": 4.0, "throughput/tokens_per_sec": 128.0,
        "throughput/device/batches_per_sec": 0.5, "throughput/device/samples_per_sec": 4.0,
        "throughput/device/tokens_per_sec": 128.0,
        "throughput/micro_batch_size": 2, "throughput/global_batch_size": 8,
    }
    # the whole window: 5 times, 4 steps in 8 s
    assert report_throughput(train, 10, 32, history, 5)["throughput/samples_per_sec"] == 4.0
    assert report_throughput(train, 10, 32, history[:2], 3) == {}  # window not full yet
    assert report_throughput(train, 10, 32, [5.0, 5.0, 5.0], 3) == {}  # times did not advance


def test_report_runtime_by_hand():
    ts = TrainState(step=25, consumed_train_samples=200)
    got = report_runtime(ts, start_time=time.time() - 100.0, seq_length=32, train_iters=100, time_unit="minutes")
    # 25 % done in 100 s -> 300 s to go
    assert got["time/remaining_estimate"] == pytest.approx(300.0 / 60, abs=0.05)
    assert got["time/total"] == pytest.approx(100.0 / 60, abs=0.05)
    assert (got["time/tokens"], got["time/samples"], got["time/batches"]) == (6400, 200, 25)
    with pytest.raises(ValueError, match="time_unit"):
        report_runtime(ts, time.time(), 32, 100, time_unit="weeks")


def test_report_l2_norm_grad_by_hand():
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2))
    model.b = torch.nn.Parameter(torch.zeros(2))
    model.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    model.a.grad = torch.tensor([3.0, 4.0])
    model.b.grad = torch.tensor([1.0, 1.0])  # megatron-core DDP's main_grad wins over .grad
    model.b.main_grad = torch.tensor([5.0, 12.0])
    got = report_l2_norm_grad([model])
    assert got == {"l2_norm/grad/a": 5.0, "l2_norm/grad/b": 13.0,
                   "l2_norm/grad/global": pytest.approx(math.sqrt(25 + 169))}


def test_report_memory_without_cuda_is_empty():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour (tests/test_gpu_train_utils.py covers CUDA)")
    assert report_memory(None) == {} and report_memory({"allocated_bytes.all.current": "x-bytes"}) == {}
    assert MEMORY_KEYS["allocated_bytes.all.peak"] == "mem-max-allocated-bytes"


def test_reduce_max_memory_is_a_no_op_on_one_stage(single_rank):
    from megatron.core import parallel_state

    report = {"mem-allocated-gigabytes": 1.5, "mem-alloc-retires": 2}
    assert reduce_max_memory_across_pp_group(report, parallel_state.get_pipeline_model_parallel_group()) is report
    assert reduce_max_memory_across_pp_group({}, None) == {}


def test_memory_history_on_cpu_logs_and_records_nothing(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour (tests/test_gpu_train_utils.py covers CUDA)")
    snapshot = str(tmp_path / "snap.pickle")
    with caplog.at_level(logging.INFO, logger="bridge_hpc.training.utils.train_utils"):
        start_memory_history_recording(None)
        start_memory_history_recording(ProfilingConfig(memory_snapshot_path=snapshot))  # off
        start_memory_history_recording(ProfilingConfig(record_memory_history=True, profile_ranks=[5],
                                                       memory_snapshot_path=snapshot))  # not this rank
        assert caplog.records == []
        start_memory_history_recording(ProfilingConfig(record_memory_history=True, memory_snapshot_path=snapshot))
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "no CUDA device" in caplog.text and "no snapshot will be written" in caplog.text
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Model hooks
# ---------------------------------------------------------------------------------------------


def test_linear_for_last_layer_by_hand():
    head = LinearForLastLayer(input_size=2, output_size=1, sequence_parallel=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[3.0, 4.0]]))
    out, bias = head(torch.tensor([[1.0, 2.0]]), weight=torch.ones(5, 2), runtime_gather_output=True)
    assert bias is None and out.dtype == torch.float32 and out.tolist() == [[11.0]]  # 1*3 + 2*4
    assert head.bias is None
    assert getattr(LinearForLastLayer(2, 1, sequence_parallel=True).weight, "sequence_parallel", False)


def test_value_head_hook_on_a_megatron_gpt(single_rank):
    model = _tiny_gpt()
    hook: ModelHook = make_value_model(hidden_size=16, sequence_parallel=False)
    chunks: ModelList = hook(model)  # a single module is normalized to a list
    assert chunks == [model] and isinstance(model.output_layer, LinearForLastLayer)
    assert model.output_layer.out_features == 1
    tokens = torch.randint(0, 32, (3, 8))
    positions = torch.arange(8).expand(3, 8)
    values = model(tokens, positions, None)
    assert values.shape == (3, 8, 1)
    # the head on the final hidden states: capture them and apply the weight by hand
    captured = {}
    model.output_layer.register_forward_pre_hook(lambda mod, args: captured.update(h=args[0]))
    values = model(tokens, positions, None)
    expected = (captured["h"].float() @ model.output_layer.weight.t()).transpose(0, 1)
    assert torch.allclose(values, expected)

    wide = _tiny_gpt()
    create_value_head_hook(hidden_size=16, sequence_parallel=False, output_size=3)([wide])
    assert wide(tokens, positions, None).shape == (3, 8, 3)
    with pytest.raises(ValueError, match="2 model chunks and 1 post-process flags"):
        make_value_model(16, False)([_tiny_gpt(), _tiny_gpt()])


def _moe_gpt():
    """A 2-layer megatron-core GPT with 2 experts, a top-2 router and a gated shared expert (CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=2,
                            moe_router_topk=2, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                            add_bias_linear=False, use_cpu_initialization=True)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False),
                    vocab_size=32, max_sequence_length=8)


def test_freeze_moe_router(single_rank):
    moe = _moe_gpt()
    chunks = freeze_moe_router(moe)
    assert chunks == [moe]
    frozen = sorted(name for name, p in moe.named_parameters() if not p.requires_grad)
    assert frozen == ["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.gate_weight",
                      "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.shared_experts.gate_weight"]
    # through a wrapper (.module), as the loop's chunks are
    wrapped = torch.nn.Module()
    wrapped.module = _moe_gpt()
    freeze_moe_router([wrapped])
    assert sum(not p.requires_grad for p in wrapped.parameters()) == 4
    # no router: nothing changes
    dense = _tiny_gpt()
    assert freeze_moe_router([dense]) == [dense] and all(p.requires_grad for p in dense.parameters())
    assert freeze_moe_router(torch.nn.Linear(2, 2))[0].weight.requires_grad


# ---------------------------------------------------------------------------------------------
# The step log: reports on log steps only, into metrics.jsonl and TensorBoard
# ---------------------------------------------------------------------------------------------


def test_training_log_reports_on_log_steps(single_rank, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bridge_hpc.rank import build_config
    from bridge_hpc.training.engine.metrics import MetricsLogger, RunStart, read_metrics

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    cfg = build_config(str(job), [f"job.run_dir={tmp_path / 'run'}", "logger.log_interval=2",
                                  "logger.log_params_norm=true", "logger.log_throughput_to_tensorboard=true",
                                  "logger.throughput_window_size=3", "logger.log_runtime_to_tensorboard=true",
                                  "logger.log_l2_norm_grad_to_tensorboard=true",
                                  "logger.log_memory_to_tensorboard=true"])
    state = GlobalState()
    state.cfg = cfg
    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"), 0, 1, str(tmp_path / "tb"), 1)
    metrics.open(0, RunStart(restart_count=0, load_s=None, started_at=time.time()))
    model = Toy()
    model.w.grad = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    history = []
    for step in range(1, 5):
        state.train_state.step = step
        state.train_state.consumed_train_samples = 8 * step
        history.append(2.0 * step)  # a step every 2 s
        training_log({"lm loss": torch.tensor(1.0)}, {}, 1e-3, None, 1.0, False, 0, 0.5, None, None, cfg, state,
                     history, [model], step_time_s=2.0, metrics=metrics)
    metrics.close()

    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert "params_norm" not in records[1] and not any("/" in key for key in records[1])  # not a log step
    assert "params_norm" not in records[3]
    for step in (2, 4):
        assert records[step]["params_norm"] == pytest.approx(math.sqrt(32))
        assert records[step]["l2_norm/grad/w"] == 5.0 and records[step]["l2_norm/grad/global"] == 5.0
        assert records[step]["time/batches"] == step and records[step]["time/samples"] == 8 * step
    assert "throughput/samples_per_sec" not in records[2]  # 2 times < window of 3
    # steps 2..4: 2 steps of 8 samples x 32 tokens in 4 s
    assert records[4]["throughput/samples_per_sec"] == 4.0 and records[4]["throughput/tokens_per_sec"] == 128.0
    assert not any(key.startswith("memory/") for key in records[4])  # no CUDA memory to report on CPU

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("params-norm")] == [(2, pytest.approx(math.sqrt(32))),
                                                                          (4, pytest.approx(math.sqrt(32)))]
    assert [e.value for e in events.Scalars("throughput/tokens_per_sec") if e.step == 4] == [128.0]
    assert [e.step for e in events.Scalars("l2_norm/grad/global")] == [2, 4]
    out = capsys.readouterr().out
    assert out.count("params norm: 5.657") == 2 and "iteration        4/" in out


# ---------------------------------------------------------------------------------------------
# Two ranks: the collectives
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What :func:`_two_rank_worker` found on each of two gloo ranks (one torchrun for the tests below)."""
    out = tmp_path_factory.mktemp("two_ranks")
    done = run_ranks([str(out)], cwd=str(out), script=os.path.abspath(__file__), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]


def test_training_log_takes_the_learning_rate_over_pg_collections_mp_group(two_ranks):
    """Bridge's ``pg_collection`` (an ordinary parameter, after ``model``): the groups of the logging
    reductions. Rank 0 has no learning rate (no trainable parameters); over the collection's ``mp`` group
    (both ranks) it logs rank 1's, to the last bit; without one, over its own model-parallel group
    (TP = PP = 1: itself), none."""
    for got in two_ranks:
        assert got["lr_pg_collection"] == 3e-4
        assert got["lr_own_group"] == (None if got["rank"] == 0 else 3e-4)


def test_collectives_on_two_ranks(two_ranks):
    for got in two_ranks:
        # DP=2 (TP=PP=1): replicated parameters are not summed over data-parallel ranks
        assert got["dp_norm"] == pytest.approx(math.sqrt(32))
        # TP=2: rank r holds slice [1, 2] / [3, 4] (summed over TP) and a replicated [2] (counted once)
        assert got["tp_norm"] == pytest.approx(math.sqrt(1 + 4 + 9 + 16 + 4))
        assert got["max_one_none"] == 2.5 and got["max_all_none"] is None and got["max_negative"] == -3.0
        assert got["and_true"] is True and got["and_mixed"] is False
        assert got["and_dp_group"] is (got["rank"] == 0)  # TP=PP=1: each rank's own model-parallel group
        # PP=2: the max of each metric over the two stages; counters stay int
        assert got["pp_memory"] == {"mem-allocated-gigabytes": 3.0, "mem-alloc-retires": 5}
        assert got["pp_memory_types"] == ["float", "int"]
        # DTensors: Shard(0) of [1, 2, 3, 4] summed over the mesh, Replicate [2, 2] once
        assert got["dtensor_norm"] == pytest.approx(math.sqrt(30 + 8))
        assert got["fsdp_norm"] == pytest.approx(math.sqrt(30 + 8))


def _learning_rates_logged(out_dir: str, rank: int):
    """The learning rate training_log records on this rank (None on rank 0, 3e-4 on rank 1) without a
    pg_collection and with one whose ``mp`` group is both ranks, passed where Bridge's signature has it."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from bridge_hpc.rank import build_config

    cfg = build_config(str(TINY), [f"job.run_dir={os.path.join(out_dir, 'run')}", "logger.log_interval=1000"])
    logged = []
    for pg_collection in (None, ProcessGroupCollection(mp=dist.group.WORLD)):
        state = GlobalState()
        state.cfg, state.rank, state.world_size = cfg, rank, 2
        state.train_state.step = 1

        class Records:
            def log(self, record):
                logged.append(record["lr"])

        training_log({"lm loss": torch.tensor(1.0)}, {}, None if rank == 0 else 3e-4, None, 1.0, False, 0, None,
                     None, None, cfg, state, [0.0, 1.0], None, pg_collection, metrics=Records())
    return logged


def _two_rank_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = {"rank": rank}
    fp32 = GPTModelConfig()

    parallel_state.initialize_model_parallel(1, 1)
    mp = parallel_state.get_model_parallel_group()
    got["dp_norm"] = calc_params_l2_norm([Toy()], fp32)
    got["and_dp_group"] = logical_and_across_model_parallel_group(rank == 0, mp)
    got["lr_own_group"], got["lr_pg_collection"] = _learning_rates_logged(out_dir, rank)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(2, 1)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor([[1.0, 2.0]]) if rank == 0 else torch.tensor([[3.0, 4.0]]))
    model.w.tensor_model_parallel = True
    model.b = torch.nn.Parameter(torch.tensor([2.0]))
    got["tp_norm"] = calc_params_l2_norm([model], fp32)
    mp = parallel_state.get_model_parallel_group()
    got["max_one_none"] = reduce_max_stat_across_model_parallel_group(None if rank == 0 else 2.5, mp)
    got["max_all_none"] = reduce_max_stat_across_model_parallel_group(None, mp)
    got["max_negative"] = reduce_max_stat_across_model_parallel_group(-3.0 if rank == 0 else -7.0, mp)
    got["and_true"] = logical_and_across_model_parallel_group(True, mp)
    got["and_mixed"] = logical_and_across_model_parallel_group(rank == 0, mp)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 2)
    report = {"mem-allocated-gigabytes": 1.5 if rank == 0 else 3.0, "mem-alloc-retires": 5 if rank == 0 else 2}
    reduced = reduce_max_memory_across_pp_group(report, parallel_state.get_pipeline_model_parallel_group())
    got["pp_memory"] = reduced
    got["pp_memory_types"] = [type(v).__name__ for v in reduced.values()]
    parallel_state.destroy_model_parallel()

    mesh = init_device_mesh("cpu", (2,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.tensor([1.0, 2.0, 3.0, 4.0]), mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(distribute_tensor(torch.tensor([2.0, 2.0]), mesh, [Replicate()]))
    got["dtensor_norm"] = calc_dtensor_params_l2_norm([sharded, replicated])

    class FsdpChunk(torch.nn.Module):  # the interface calc_params_l2_norm uses with Megatron FSDP
        def __init__(self):
            super().__init__()
            self.s, self.r = sharded, replicated

        def stop_communication(self):
            pass

    got["fsdp_norm"] = calc_params_l2_norm([FsdpChunk()], fp32, use_megatron_fsdp=True)
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _two_rank_worker(sys.argv[1])
