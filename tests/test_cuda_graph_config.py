"""``model.cuda_graph_impl = "full_iteration"``'s limits, refused with the key that sets them (the
graph itself runs on GPUs: tests/test_gpu_cuda_graph.py)."""

from __future__ import annotations

import shutil

import pytest
from bridge_test_helpers import TINY, direct_rank_env
from warm_ranks import run_module

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import ConfigContainer, GPTModelConfig


@pytest.mark.parametrize("fields, key, words", [
    ({"tensor_model_parallel_size": 2}, "model.cuda_graph_impl", "data parallelism only"),
    ({"pipeline_model_parallel_size": 2}, "model.cuda_graph_impl", "data parallelism only"),
    ({"cuda_graph_warmup_steps": 0}, "model.cuda_graph_warmup_steps", "must be an integer >= 1"),
])
def test_what_the_graph_cannot_run_is_refused_naming_the_key(fields, key, words):
    cfg = GPTModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                         cuda_graph_impl="full_iteration", **fields)
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == key and words in err.value.message


def test_per_layer_graphs_are_not_offered():
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections({"train": {"train_iters": 4}, "model": {"cuda_graph_impl": "local"}}, "job.toml")
    assert err.value.key == "model.cuda_graph_impl" and "'full_iteration'" in err.value.message


def test_overlapped_param_gather_is_refused_with_the_graph():
    cfg = ConfigContainer.from_sections({
        "train": {"train_iters": 4, "micro_batch_size": 1, "global_batch_size": 1}, "optimizer": {"lr": 1e-3},
        "model": {"cuda_graph_impl": "full_iteration"},
        "ddp": {"use_distributed_optimizer": True, "overlap_param_gather": True, "overlap_grad_reduce": True},
        }, "job.toml")
    with pytest.raises(ConfigError) as err:
        cfg.validate(world_size=1)
    assert err.value.key == "model.cuda_graph_impl" and "overlap_param_gather" in err.value.message


def test_the_graph_is_refused_on_a_rank_without_a_gpu(tmp_path):
    """A CPU rank ends with one line naming the key, status 2, before it builds anything."""
    shutil.copy(TINY, tmp_path / "job.toml")
    proc = run_module("bridge_hpc.rank", ["job.toml", "--set", 'model.cuda_graph_impl="full_iteration"'], cwd=tmp_path,
                      env=direct_rank_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: job.toml: key 'model.cuda_graph_impl': CUDA graphs need GPUs" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "runs" / "tiny" / "checkpoints" / "iter_0000000").exists()
