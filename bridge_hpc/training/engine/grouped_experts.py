"""The local layers' experts as one grouped GEMM per linear (``model.moe_grouped_gemm`` on
``model.transformer_impl = "local"``).

Why: megatron-core's ``SequentialMLP`` runs a rank's experts one after another, two GEMMs each way per
expert; with 16 experts the step is bound by the host's launches (benchmarks/README.md: 1683 matrix
multiplies a step for the 16-layer MoE GPT, 83 ms of GPU time in a 0.36 s step), and Transformer Engine's
grouped linear still launches one GEMM per expert from Python. ``torch._grouped_mm`` multiplies every
expert's tokens by its own weight in one kernel, the group boundaries a device tensor.

:class:`GroupedSequentialMLP` keeps ``SequentialMLP``'s parameters (each expert's
``local_experts.<i>.linear_fc1.weight`` and ``linear_fc2.weight``), so checkpoints, expert-parallel
resharding, the Hugging Face mapping and the layout moves are those of the sequential experts; only the
forward differs. It runs megatron-core's own ``MLP.forward`` once over every token (the activation, the
gated unit and the routing probabilities as the experts apply them) with the two linears replaced by
grouped ones (:class:`_GroupedLinearFunction`): forward ``y_e = x_e W_e^T``, backward ``dx_e = dy_e W_e``
and ``dW_e = dy_e^T x_e`` (the grouped GEMM over the token dimension), each one kernel. The weights are
stacked for each GEMM, not kept stacked: the step's memory is the sequential experts' plus a transient copy
of the rank's expert weights per linear (and their gradients in one buffer until each is accumulated).

What it does not do, refused at submission: biases in the experts, expert tensor parallelism, fp32 or fp16
on GPUs (``MoEFields.local_grouped_experts_refusal``), adapters on the experts' own linears (those wrap
each expert's layer: ``peft.config.check_peft``). FP8 needs Transformer Engine's layers, whose grouped
experts are TE's. The fast path (``speed_defaults.GROUPED_EXPERTS``) takes it for an MoE job on GPUs where
none of these holds; measured 2.7x the sequential experts' tokens/s on one H200 (benchmarks/README.md).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP


class _GroupedLinearFunction(torch.autograd.Function):
    """``x`` [tokens, in] (the experts' tokens one group after another, ``offsets`` their ends) times each
    group's weight [out, in] transposed: [tokens, out]. The weights stay separate parameters; each GEMM
    stacks them (a copy of the weights, not of the activations)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, offsets, *weights)
        stacked = torch.stack(weights)  # [experts, out, in]
        return torch._grouped_mm(x, stacked.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        stacked = torch.stack(weights)
        grad_x = torch._grouped_mm(grad, stacked, offs=offsets) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):  # frozen experts: no weight gradients at all
            return (grad_x, None, *(None for _ in weights))
        grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)  # [experts, out, in]: dy_e^T x_e
        # An expert without tokens has a zero gradient; the kernel leaves its output unwritten on some cards
        # (pytorch/pytorch#172439, B200), so it is zeroed here, on the device, without a sync.
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        grad_w.masked_fill_((counts == 0).view(-1, 1, 1), 0)  # (not a product: unwritten memory may hold NaN)
        return (grad_x, None, *grad_w.unbind(0))


class _GroupedLinear(torch.nn.Module):
    """A linear layer's call (``(output, bias)``, as megatron-core's parallel linears return) over the
    experts' stacked tokens. A module (holding no parameters of its own: the experts' stay theirs),
    since megatron-core 0.19's ``MLP.forward`` calls its linears through ``apply_module``, which checks."""

    def __init__(self, weights: List[torch.Tensor], offsets: torch.Tensor) -> None:
        super().__init__()
        self._weights = tuple(weights)  # a tuple: not registered, not in any state dict
        self._offsets = offsets

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _GroupedLinearFunction.apply(x, self._offsets, *self._weights), None


class _GroupedExperts:
    """What ``MLP.forward`` reads of its module: the config, the activation, and the two linears (here
    grouped over the experts)."""

    def __init__(self, expert: MLP, fc1: _GroupedLinear, fc2: _GroupedLinear) -> None:
        self.config = expert.config
        self.activation_func = expert.activation_func
        self.linear_fc1 = fc1
        self.linear_fc2 = fc2


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP``'s experts and parameters, computed with one grouped GEMM per linear (see the
    module docstring)."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if self.num_local_experts == 1 or self.config.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden = permuted_local_hidden_states
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert), 0).to(device=hidden.device, dtype=torch.int32,
                                                                          non_blocking=True)
        experts = list(self.local_experts)
        fc1 = _GroupedLinear([e.linear_fc1.weight for e in experts], offsets)
        fc2 = _GroupedLinear([e.linear_fc2.weight for e in experts], offsets)
        output, _ = MLP.forward(_GroupedExperts(experts[0], fc1, fc2), hidden, per_token_scale=permuted_probs)
        return output, None
