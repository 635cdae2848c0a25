"""The ``[optimizer]`` fields megatron-core acts on, on one GPU (skipped without CUDA; the lead runs it on
the device): fp16 dynamic loss scaling (``initial_loss_scale``, ``loss_scale_window``, ``hysteresis``,
``min_loss_scale``), ``decoupled_lr`` for the embedding and output layer, ``log_num_zeros_in_grad``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def one_gpu():
    from bridge_test_helpers import single_rank_world

    yield from single_rank_world("nccl")


def _build(optimizer: dict, precision: str = "fp16"):
    from bridge_hpc.training.config import ConfigContainer
    from bridge_hpc.training.engine.optimizer import setup_optimizer
    from bridge_hpc.training.pretrain import set_random_seed, setup_model

    sections = {
        "train": {"train_iters": 20, "micro_batch_size": 2, "global_batch_size": 2},
        "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "seq_length": 32,
                  precision: True, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "optimizer": {"lr": 1e-3, precision: True, **optimizer},
        "dataset": {"seq_length": 32},
    }
    cfg = ConfigContainer.from_sections(sections, source="test_gpu_optimizer_fields")
    cfg.validate(world_size=1)
    set_random_seed(0)
    model = setup_model(cfg)
    return model, setup_optimizer(cfg, model)


def _step(model, optimizer, grad: float):
    for chunk in model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.main_grad.fill_(grad)
    optimizer.zero_grad()
    return optimizer.step()


def test_fp16_dynamic_loss_scaling_follows_the_optimizer_section(one_gpu):
    model, optimizer = _build({"initial_loss_scale": 1024.0, "loss_scale_window": 2, "hysteresis": 1,
                               "min_loss_scale": 64.0})
    assert optimizer.get_loss_scale().item() == 1024.0
    ok, _, _ = _step(model, optimizer, float("inf"))  # an overflow: step skipped, scale halved (hysteresis 1)
    assert not ok and optimizer.get_loss_scale().item() == 512.0
    for _ in range(2):  # loss_scale_window good steps: the scale doubles again
        ok, _, _ = _step(model, optimizer, 1e-3)
        assert ok
    assert optimizer.get_loss_scale().item() == 1024.0
    for _ in range(8):  # overflows halve it down to min_loss_scale, never below
        _step(model, optimizer, float("inf"))
    assert optimizer.get_loss_scale().item() == 64.0


def test_a_fixed_loss_scale_never_moves(one_gpu):
    model, optimizer = _build({"loss_scale": 128.0})
    _step(model, optimizer, float("inf"))
    assert optimizer.get_loss_scale().item() == 128.0


def test_decoupled_lr_and_num_zeros(one_gpu):
    model, optimizer = _build({"decoupled_lr": 5e-3, "decoupled_min_lr": 5e-4, "log_num_zeros_in_grad": True},
                              precision="bf16")
    groups = optimizer.param_groups
    decoupled = [g for g in groups if g["max_lr"] == 5e-3]
    assert decoupled and all(g["min_lr"] == 5e-4 for g in decoupled)
    marked = sum(p.numel() for chunk in model for p in chunk.parameters()
                 if getattr(p, "is_embedding_or_output_parameter", False))
    total = sum(p.numel() for chunk in model for p in chunk.parameters())
    in_decoupled = sum(p.numel() for g in decoupled for p in g["params"])  # their fp32 main copies
    assert 0 < marked == in_decoupled < total
    _, _, zeros = _step(model, optimizer, 0.0)
    assert zeros is not None and zeros > 0
