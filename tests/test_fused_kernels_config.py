"""``model.fused_kernels``'s limits, refused with the key (the kernels themselves run on GPUs:
tests/test_gpu_fused_kernels.py)."""

from __future__ import annotations

import shutil

import pytest
from bridge_test_helpers import TINY, direct_rank_env
from warm_ranks import run_module

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import FUSED_NORM_MAX_WIDTH, GPTModelConfig


@pytest.mark.parametrize("fields, words", [
    ({"hidden_size": 2 * FUSED_NORM_MAX_WIDTH}, f"normalizes rows of up to {FUSED_NORM_MAX_WIDTH} values"),
])
def test_what_the_fused_kernels_cannot_run_is_refused_naming_the_key(fields, words):
    cfg = GPTModelConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                            "fused_kernels": True, **fields})
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == "model.fused_kernels" and words in err.value.message


def test_on_te_layers_only_the_cross_entropy_is_fused_so_any_width_is_accepted():
    GPTModelConfig(num_layers=2, hidden_size=2 * FUSED_NORM_MAX_WIDTH, num_attention_heads=4, seq_length=32,
                   fused_kernels=True, transformer_impl="transformer_engine").finalize()


def test_the_widest_norm_is_accepted():
    GPTModelConfig(num_layers=2, hidden_size=FUSED_NORM_MAX_WIDTH, num_attention_heads=4, seq_length=32,
                   fused_kernels=True).finalize()


def test_the_fused_kernels_are_refused_on_a_rank_without_a_gpu(tmp_path):
    """A CPU rank ends with one line naming the key, status 2, before it builds anything."""
    shutil.copy(TINY, tmp_path / "job.toml")
    proc = run_module("bridge_hpc.rank", ["job.toml", "--set", "model.fused_kernels=true"], cwd=tmp_path,
                      env=direct_rank_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: job.toml: key 'model.fused_kernels': the fused kernels run on GPUs" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "runs" / "tiny" / "checkpoints" / "iter_0000000").exists()
