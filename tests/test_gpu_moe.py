"""Mixture-of-Experts on one GPU, on both layer implementations; skipped without CUDA (and the TE
cases without transformer_engine).

Each run is a real 1-rank torchrun job of configs/local-tiny-moe.toml's MoE GPT (8 experts, top-2, a
shared expert; EP1 on one GPU) with megatron-core's DDP, optimizer and sharded checkpoints. An exit at
step 6 and the resumed run reproduce the losses of a run in one go bit for bit, the auxiliary losses
included; the TE case also runs the experts as one grouped GEMM, and the local grouped case as torch's
(whose losses also follow the sequential experts' in bf16).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from bridge_test_helpers import ROOT, run_one_gpu_rank

from bridge_hpc.training.engine.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
ITERS = 12
LAYERS = {
    "local": ("model.transformer_impl=\"local\"",),
    "te-grouped-gemm": ("model.transformer_impl=\"transformer_engine\"", "model.moe_grouped_gemm=true",
                        "model.moe_token_dispatcher_type=\"alltoall\""),
    # the local layers' experts as torch's grouped GEMM (bf16 on CUDA), the fast path's choice for MoE
    "local-grouped-gemm": ("model.transformer_impl=\"local\"", "model.moe_grouped_gemm=true",
                           "mixed_precision.bf16=true"),
}


def _run(folder, layers, *extra: str) -> dict:
    job = os.path.join(folder, "job.toml")
    if not os.path.exists(job):
        os.makedirs(folder, exist_ok=True)
        text = (ROOT / "configs" / "local-tiny-moe.toml").read_text()  # without the CPU cluster's profile
        with open(job, "w", encoding="utf-8") as f:
            f.write(text.replace('extends = "clusters/local.toml"\n', ""))
    run_one_gpu_rank(job, "job.run_dir=\"run\"", "slurm.gpus_per_node=1", f"train.train_iters={ITERS}",
                     "model.expert_model_parallel_size=1",
                     "checkpoint.save_interval=6", "train.eval_interval=6", "model.hidden_dropout=0.0",
                     "model.attention_dropout=0.0", "model.deterministic_mode=true", *LAYERS[layers], *extra)
    return read_metrics(os.path.join(folder, "run", "metrics.jsonl"))


@pytest.mark.parametrize("layers", list(LAYERS))
def test_moe_trains_and_resumes_bit_exactly_on_gpu(layers, tmp_path):
    if layers.startswith("te") and not HAS_TE:
        pytest.skip("needs transformer_engine")
    straight = _run(str(tmp_path / "straight"), layers)
    assert sorted(straight) == list(range(1, ITERS + 1))
    assert all(r["load_balancing_loss"] > 0 and r["z_loss"] > 0 for r in straight.values())
    assert straight[ITERS]["loss"] < straight[1]["loss"]
    _run(str(tmp_path / "resumed"), layers, "train.exit_interval=6")
    resumed = _run(str(tmp_path / "resumed"), layers)
    for step in straight:
        for key in ("loss", "load_balancing_loss", "z_loss"):
            assert resumed[step][key] == straight[step][key], (layers, step, key)


def test_local_grouped_experts_train_as_the_sequential_experts_in_bf16(tmp_path):
    """The same parameters, one grouped GEMM per linear instead of two GEMMs per expert: bf16 rounding
    apart, the same training (relative loss difference over 12 steps within 2e-2)."""
    grouped = _run(str(tmp_path / "grouped"), "local-grouped-gemm")
    sequential = _run(str(tmp_path / "sequential"), "local-grouped-gemm", "model.moe_grouped_gemm=false")
    worst = max(abs(grouped[s]["loss"] - sequential[s]["loss"]) / abs(sequential[s]["loss"]) for s in sequential)
    assert worst < 2e-2, worst
    assert grouped[1]["loss"] == pytest.approx(sequential[1]["loss"], rel=1e-2)
