"""LoRA's fused layer (issue 35): ``LoRALinear`` without tensor or sequence parallelism runs the base's
matrix multiply and the adapter's as one ``FusedLoRALinear`` (the scale on the rank-wide intermediate, the
adapter's output and input gradient accumulated by the GEMMs into the base's), and computes what the
unfused path (the base's forward plus the adapter's) computes, within fp32 rounding.

The reference is the unfused expression itself (``to_wrap(x)`` plus ``adapter(x)``), or a model whose
wrappers were built with the fusion ruled out (``layout_allows_fusion`` patched to say no); that the
fused path runs is read from the autograd graph (its ``FusedLoRALinearBackward`` nodes).
"""

from __future__ import annotations

import pytest
import torch
from bridge_test_helpers import single_rank_world
from test_peft import _batch, _model_cfg

from bridge_hpc.peft import lora_layers

#: fp32 rounding: the fused path scales ``A x`` before ``B`` and adds in the GEMM, the unfused one after.
RTOL = 1e-5
FUSED_NODE = "FusedLoRALinearBackward"
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture
def world():
    yield from single_rank_world()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal within ``RTOL`` of the expected tensor's largest entry."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    bound = RTOL * max(float(expected.abs().max()), 1e-30)
    diff = float((actual - expected).abs().max())
    assert diff <= bound, f"{what}: max difference {diff:.3g} > {bound:.3g}"


def _graph_names(tensor: torch.Tensor) -> list:
    """The names of every node of ``tensor``'s autograd graph (each node once)."""
    names, seen, todo = [], set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _lora_model(activation: str = "gelu", bias: bool = True, fusion: bool = True, monkeypatch=None, **lora):
    from bridge_hpc.peft.base import apply_peft
    from bridge_hpc.peft.lora import LoRA
    from bridge_hpc.training.engine.model import gpt_model_provider

    if not fusion:
        monkeypatch.setattr(lora_layers, "layout_allows_fusion", lambda base, adapter: False)
    torch.manual_seed(0)
    model = gpt_model_provider(_model_cfg(activation_func=activation, add_bias_linear=bias))
    # B drawn (not zero) so that the adapters' share of every output and gradient is there from step 0
    apply_peft(LoRA(target_modules=TARGETS, dim=4, alpha=8, lora_B_init_method="normal", **lora), [model], seed=7,
               base_folder=None)
    return model


def _wrapped(model) -> dict:
    return {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules()
            if isinstance(module, lora_layers.LoRALinear) and ".layers.0." in name}


def _run(layer, x: torch.Tensor, weights: torch.Tensor, fused: bool, seed: int):
    """Output, returned bias and the gradients of x, A and B of ``layer`` on ``x`` (a fresh leaf), through the
    fused path (the layer's forward) or the unfused expression; the loss weighs the output by ``weights``."""
    x = x.clone().requires_grad_()
    a, b = layer.adapter.linear_in.weight, layer.adapter.linear_out.weight
    a.grad = b.grad = None
    torch.manual_seed(seed)  # the same dropout mask on both paths
    if fused:
        out, bias = layer(x)
        assert FUSED_NODE in _graph_names(out), _graph_names(out)
    else:
        out, bias = layer.to_wrap(x)
        out = out + layer.adapter(x)
        assert FUSED_NODE not in _graph_names(out)
    (out * weights).sum().backward()
    return out.detach(), bias, x.grad, a.grad.clone(), b.grad.clone()


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])  # swiglu: a gated linear_fc1 (two halves)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("flip_skip_bias_add", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])  # 0.3: dropout before the adapter, in training
def test_the_fused_layer_computes_the_unfused_output_and_gradients(world, activation, bias, flip_skip_bias_add,
                                                                   dropout):
    """Every base kind (column: linear_qkv, linear_fc1; row: linear_proj, linear_fc2), with and without bias,
    the bias added or returned apart (``skip_bias_add`` as the GPT builds it and the other way)."""
    model = _lora_model(activation, bias, dropout=dropout, dropout_position="pre")
    model.train()
    layers = _wrapped(model)
    assert sorted(layers) == sorted(TARGETS)
    g = torch.Generator().manual_seed(3)
    for name, layer in layers.items():
        base = layer.to_wrap
        assert layer.fusable_layout and not base.weight.requires_grad
        if flip_skip_bias_add:
            base.skip_bias_add = not base.skip_bias_add
        x = torch.randn(5, 3, base.input_size, generator=g)
        weights = torch.randn(5, 3, base.output_size, generator=g)
        fused = _run(layer, x, weights, True, seed=11)
        unfused = _run(layer, x, weights, False, seed=11)
        for what, f, u in zip(("output", "grad x", "grad A", "grad B"), fused[:1] + fused[2:], unfused[:1] + unfused[2:]):
            _close(f, u, f"{name} {what}")
        assert fused[1] is unfused[1]  # the bias returned apart: the base's own parameter, or None
        assert (fused[1] is not None) == (bias and base.skip_bias_add)
        assert base.weight.grad is None and (base.bias is None or base.bias.grad is None)


def test_dropout_after_the_adapter_keeps_the_unfused_path_while_training(world):
    model = _lora_model(dropout=0.5, dropout_position="post")
    layer = _wrapped(model)["linear_fc1"]
    x = torch.randn(4, 2, layer.to_wrap.input_size)
    model.train()
    assert FUSED_NODE not in _graph_names(layer(x.requires_grad_())[0])
    model.eval()  # dropout is the identity: nothing stands between the adapter and the base
    assert FUSED_NODE in _graph_names(layer(x)[0])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_tiny_gpt_trains_with_the_fused_path_as_with_the_unfused_one(world, monkeypatch, dropout):
    """Four Adam steps of the adapters on all four targets (swiglu, biases): the same losses within fp32
    rounding, every wrapped layer on the fused path (and none on the reference's), the gradients on the
    adapters' own parameters (the keys checkpoints, merge and export read)."""
    def train(model) -> tuple:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.Adam(params.values(), lr=1e-2)
        losses, nodes = [], None
        torch.manual_seed(5)
        for step in range(4):
            tokens, positions, labels = _batch(step)
            optimizer.zero_grad()
            loss = model(tokens, positions, None, labels=labels).mean()
            if nodes is None:
                nodes = _graph_names(loss).count(FUSED_NODE)
            loss.backward()
            assert all(p.grad is not None for p in params.values())
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses, nodes, {n: p.detach().clone() for n, p in params.items()}

    fused = _lora_model("swiglu", dropout=dropout)
    fused.train()
    fused_losses, fused_nodes, fused_params = train(fused)
    reference = _lora_model("swiglu", fusion=False, monkeypatch=monkeypatch, dropout=dropout)
    reference.train()
    ref_losses, ref_nodes, ref_params = train(reference)
    assert fused_nodes == 2 * len(TARGETS) and ref_nodes == 0
    assert fused_losses == pytest.approx(ref_losses, rel=RTOL), (fused_losses, ref_losses)
    assert sorted(fused_params) == sorted(ref_params)
    assert all(name.endswith((".adapter.linear_in.weight", ".adapter.linear_out.weight")) for name in fused_params)
    for name in ref_params:
        # Adam's first steps move each entry by about lr whatever the gradient's size: compare to lr
        assert float((fused_params[name] - ref_params[name]).abs().max()) < 1e-4, name
    assert fused.state_dict().keys() == reference.state_dict().keys()


def test_the_fast_paths_bias_in_gemm_base_is_fused_and_an_unknown_forward_is_not():
    """The fast path's column layer (its own forward needs a trainable weight) declares that, frozen, it runs
    ColumnParallelLinear's forward; a subclass with a forward of its own that says nothing is not fused."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from bridge_hpc.training.engine.fused_kernels import BiasInGemmColumnParallelLinear

    class OwnForward(ColumnParallelLinear):
        def _forward_impl(self, input, weight, *args, **kwargs):
            return super()._forward_impl(input * 2, weight, *args, **kwargs)

    assert getattr(BiasInGemmColumnParallelLinear, lora_layers.FROZEN_FORWARD_IS_PLAIN) is True
    assert lora_layers._forward_is_plain(object.__new__(BiasInGemmColumnParallelLinear))
    assert lora_layers._forward_is_plain(object.__new__(ColumnParallelLinear))
    assert not lora_layers._forward_is_plain(object.__new__(OwnForward))
