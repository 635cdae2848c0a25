"""Model parallelism's pieces that run on CPU (gloo): the last pipeline stage's losses and the stop
observations shared in one all-reduce, a micro-batch broadcast within the tensor-parallel group,
the virtual-stage views of one data iterator, the config's checks, and the refusal of model
parallelism on a rank without a GPU. The GPU runs (TP2/PP2 training, exact resume, a TP2 checkpoint at
TP1 x DP2) are tests/test_gpu_parallel.py and benchmarks/parallel.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from bridge_test_helpers import TINY, direct_rank_env, free_port, run_gloo_ranks

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import GPTModelConfig
from bridge_hpc.training.datasets.builders import PositionIterator
from bridge_hpc.training.engine.parallel import ChunkViews


def test_chunk_views_read_each_micro_batch_once_in_order_for_every_chunk():
    source = iter(range(100))
    views = ChunkViews(source, 3)
    chunks = [views.view(c) for c in range(3)]
    got = {c: [] for c in range(3)}
    # the interleaved schedule's order: chunk 0 runs ahead of the others by up to a few micro-batches
    for k in range(6):
        got[0].append(next(chunks[0]))
        if k >= 1:
            got[1].append(next(chunks[1]))
        if k >= 2:
            got[2].append(next(chunks[2]))
    assert got == {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3]}
    assert next(source) == 6  # the one iterator was read exactly 6 times
    assert views.buffer == [4, 5] and views.offset == 4  # what the slowest chunk still needs, no more


def test_position_iterator_keeps_the_readers_position():
    it = PositionIterator(consumed_samples=16, micro_batch_size=4, dp_size=2)
    assert [next(it) for _ in range(3)] == [None, None, None]
    assert it.state_dict() == {"consumed_samples": 16 + 3 * 8}


@pytest.mark.parametrize("sizes, key, words", [
    ({"tensor_model_parallel_size": 3}, "model.tensor_model_parallel_size", "must divide model.num_attention_heads"),
    ({"pipeline_model_parallel_size": 3}, "model.pipeline_model_parallel_size", "must divide model.num_layers"),
    ({"sequence_parallel": True}, "model.sequence_parallel", "needs model.tensor_model_parallel_size > 1"),
    ({"virtual_pipeline_model_parallel_size": 2}, "model.virtual_pipeline_model_parallel_size",
     "needs model.pipeline_model_parallel_size > 1"),
    ({"context_parallel_size": 2}, "model.context_parallel_size", "transformer_engine"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "model.sequence_parallel",
     "needs model.transformer_impl = \"transformer_engine\""),
    ({"tensor_model_parallel_size": 0}, "model.tensor_model_parallel_size", "must be an integer >= 1"),
])
def test_parallel_sizes_are_checked_naming_the_key(sizes, key, words):
    cfg = GPTModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, **sizes)
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == key and words in err.value.message


def test_valid_parallel_sizes_are_accepted():
    cfg = GPTModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                         tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, sequence_parallel=True,
                         transformer_impl="transformer_engine")
    cfg.finalize()
    assert cfg.model_parallel_size == 4


@pytest.mark.parametrize("sizes, key", [
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "model.sequence_parallel"),
    ({"context_parallel_size": 2}, "model.context_parallel_size"),
])
def test_what_only_transformer_engine_does_is_refused_on_a_rank_without_it(sizes, key):
    """transformer_impl = "transformer_engine" passes the login-side check; a rank without Transformer
    Engine (or without CUDA, as here) would build megatron-core's local layers, whose torch LayerNorm
    asserts on a split sequence (a traceback on an H200): it names the key instead."""
    from bridge_hpc.training.engine.model import _layer_spec

    cfg = GPTModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         transformer_impl="transformer_engine", **sizes)
    cfg.finalize()
    with pytest.raises(ConfigError) as err:
        _layer_spec(cfg)
    assert err.value.key == key and "needs Transformer Engine on the ranks' GPUs" in err.value.message


def test_model_parallelism_is_refused_on_a_rank_without_a_gpu(tmp_path):
    """On CPU ranks a model-parallel size above 1 ends the job with one line naming the key, status 2."""
    shutil.copy(TINY, tmp_path / "job.toml")
    port = free_port()
    procs = []
    for rank in range(2):  # the ranks started directly, as srun starts them
        procs.append(subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", "job.toml",
                                       "--set", "model.pipeline_model_parallel_size=2"],
                                      cwd=tmp_path, env=direct_rank_env(rank, 2, port), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert ("error: job.toml: key 'model.pipeline_model_parallel_size': model parallelism needs GPUs"
                in err), err[-3000:]
    assert not (tmp_path / "runs" / "tiny" / "checkpoints" / "progress.txt").exists()


def _two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training.engine import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    # Two pipeline stages: the loss exists on the last one; rank 0 (first stage) saw the stop signal.
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    reduced = {"lm loss": torch.tensor(2.5), "aux": torch.tensor(0.5)} if last else {}
    flags = {"signal received": rank == 0, "time limit": False}
    for step in range(2):  # the second step reuses the keys learnt in the first
        shared, agreed = parallel.share_last_stage_values(reduced, flags, "train", torch.device("cpu"))
        result[f"step{step}"] = {"shared": {k: float(v) for k, v in shared.items()}, "agreed": agreed}
    parallel_state.destroy_model_parallel()
    # Two tensor-parallel ranks: the first reads the micro-batch, the other receives it.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    batch = {"tokens": torch.arange(8).view(2, 4), "loss_mask": torch.ones(2, 4, dtype=torch.float32)}
    got = parallel.broadcast_batch_within_tp(batch if rank == 0 else None, torch.device("cpu"))
    result["batch"] = {k: [str(v.dtype), v.tolist()] for k, v in got.items()}
    result["reads"] = parallel.reads_data()
    parallel_state.destroy_model_parallel()
    # No destroy_process_group: the rank leaves through os._exit (run_gloo_ranks), as the toolkit's ranks do.
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def test_last_stage_values_reach_every_rank_with_the_stop_flags_and_tp_ranks_get_one_batch(tmp_path):
    run_gloo_ranks(_two_ranks, free_port(), str(tmp_path))
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r in results:
        for step in ("step0", "step1"):
            assert r[step]["shared"] == {"aux": 0.5, "lm loss": 2.5}
            assert r[step]["agreed"] == {"signal received": True, "time limit": False}
        assert r["batch"] == {"tokens": ["torch.int64", [[0, 1, 2, 3], [4, 5, 6, 7]]],
                              "loss_mask": ["torch.float32", [[1.0] * 4] * 2]}
    assert [r["reads"] for r in results] == [True, False]


def test_distributed_optimizer_load_keeps_torch_adams_step():
    """megatron-core's distributed optimizer copies loaded state into every tensor of torch Adam's
    state, ``step`` included, which the loaded state never holds (KeyError 'step' without Apex/TE,
    seen on 2 H100s); the loader's patch keeps ``step`` and copies the rest."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from bridge_hpc.training.checkpoint.megatron import _torch_adam_step_kept

    main, model_param = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    adam = torch.optim.Adam([main])
    adam.state[main] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    opt = DistributedOptimizer.__new__(DistributedOptimizer)  # the state-copy method alone, on CPU
    opt.model_param_group_index_map = {model_param: (0, 0)}
    opt.optimizer = adam
    opt.config = SimpleNamespace(use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    loaded = {"param": torch.full((4,), 1.0), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.full((4,), 3.0)}
    with torch.no_grad():  # as megatron's load runs it
        with pytest.raises(KeyError):
            opt._set_main_param_and_optimizer_states(model_param, loaded)
        with _torch_adam_step_kept(opt):
            opt._set_main_param_and_optimizer_states(model_param, loaded)
    state = adam.state[main]
    assert main.tolist() == [1.0] * 4 and state["exp_avg"].tolist() == [2.0] * 4
    assert state["exp_avg_sq"].tolist() == [3.0] * 4 and float(state["step"]) == 7.0
    assert "_set_main_param_and_optimizer_states" not in vars(opt)  # the class's method again
