"""Mixture-of-Experts layers on megatron-core: the decoder's spec, a CPU rank's router and dispatcher,
the auxiliary losses, and the expert parameters' own data parallelism.

megatron-core builds the MoE layer (``MoELayer``: router, experts, optional shared expert, token
dispatcher); what is here only wires it as Megatron-LM does:

- :func:`decoder_block_spec`: each layer dense or MoE as ``model.moe_layer_freq`` says, over the local
  layers (the experts a ``SequentialMLP`` of megatron-core's MLPs; with ``moe_grouped_gemm`` the same
  experts as torch's grouped GEMM, :mod:`bridge_hpc.training.engine.grouped_experts`) or Transformer
  Engine's (with ``moe_grouped_gemm``, TE's grouped linear);
- on a CPU rank megatron-core's router moves its weight to ``torch.cuda.current_device()`` and its
  gating GEMM needs Transformer Engine, and its all-gather dispatcher allocates on CUDA:
  :class:`HostTopKRouter` and :class:`HostAllGatherDispatcher` compute the same where the tensors are
  (:func:`to_host` swaps them in after building, as ``HostRotaryEmbedding`` does for the rotary
  embedding);
- the load-balancing and z losses are backpropagated by megatron-core's ``MoEAuxLossAutoScaler``, whose
  scale the step sets (:func:`set_aux_loss_scale`, as megatron-core's schedules do), and logged per step
  from its tracker (:func:`aux_losses`, megatron-core's ``track_moe_metrics``);
- expert parameters (megatron-core marks them ``allreduce = False``) are data-parallel over the
  expert-data-parallel group only: on CPU ranks torch DDP leaves them out
  (:func:`expert_param_names`) and :func:`reduce_expert_grads` reduces them as megatron-core's DDP does.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

#: A local expert's parameter name: ``...mlp.experts.local_experts.<i>.<rest>`` (SequentialMLP) or
#: ``...mlp.experts.linear_fc1.weight<i>`` (Transformer Engine's grouped MLP).
_LOCAL_EXPERT = re.compile(r"(.*\.experts\.local_experts\.)(\d+)(\..*)")
_GROUPED_EXPERT = re.compile(r"(.*\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)")


def decoder_block_spec(cfg, config, vp_stage: Optional[int], dense_layer_spec, te: bool):
    """The decoder's submodules for an MoE model: this stage's layers, each ``dense_layer_spec`` or
    megatron-core's MoE layer spec (with the dense spec's attention), as ``moe_layer_freq`` says."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if te:
        moe_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=cfg.moe_grouped_gemm, qk_layernorm=cfg.qk_layernorm)
    else:
        moe_spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
            normalization=cfg.normalization)
    moe_spec = copy.deepcopy(moe_spec)
    if not te and cfg.moe_grouped_gemm:  # the sequential experts' parameters, one grouped GEMM per linear
        from bridge_hpc.training.engine.grouped_experts import GroupedSequentialMLP

        _set_experts_class(moe_spec.submodules, GroupedSequentialMLP)
    moe_spec.submodules.self_attention = dense_layer_spec.submodules.self_attention
    moe_spec.submodules.input_layernorm = dense_layer_spec.submodules.input_layernorm
    pattern = cfg.moe_layer_pattern()
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [moe_spec if pattern[i] else dense_layer_spec for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)


def _set_experts_class(layer_submodules, cls) -> None:
    """Build the MoE layer's experts as ``cls`` (same arguments): megatron-core 0.16's spec holds the MoE
    layer and its experts as ``ModuleSpec`` s, 0.19's as ``functools.partial`` builders."""
    mlp = layer_submodules.mlp
    moe_submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    experts = moe_submodules.experts
    if isinstance(experts, functools.partial):
        moe_submodules.experts = functools.partial(cls, *experts.args, **experts.keywords)
    else:
        experts.module = cls


# ---------------------------------------------------------------------------------------------
# A CPU rank's router and dispatcher
# ---------------------------------------------------------------------------------------------


class HostTopKRouter(TopKRouter):
    """megatron-core's top-k router where its weight is: the same logits (``moe_router_dtype``'s
    precision) from a plain linear, instead of moving the weight to CUDA and calling Transformer
    Engine's GEMM (megatron-core 0.16's fallback refers to a name it never imported)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (backward: each rank's slice of the summed gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = torch.distributed.get_world_size(group)
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """Sum over ``group``, each rank keeping its slice of dim 0 (backward: all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherTokens.forward(ctx, grad, ctx.group), None


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """gloo has no reduce-scatter: an all-reduce, then this rank's slice."""
    summed = x.contiguous().clone()
    torch.distributed.all_reduce(summed, group=group)
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return summed.chunk(size, dim=0)[rank].contiguous()


class HostAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's all-gather dispatcher with its two collectives (gather the tokens, routing map
    and probabilities over the tensor x expert parallel group; reduce-scatter the experts' outputs) done
    where the tensors are, instead of in buffers on ``torch.cuda.current_device()``."""

    def token_dispatch(self, hidden_states, probs):
        if self.tp_size > 1 or self.ep_size > 1:
            with torch.no_grad():
                self.routing_map = _GatherTokens.apply(self.routing_map, self.tp_ep_group)
            probs = _GatherTokens.apply(probs, self.tp_ep_group)
            hidden_states = _GatherTokens.apply(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            dtype = hidden_states.dtype
            hidden_states = _ScatterTokens.apply(hidden_states.to(self.local_probs.dtype), self.tp_ep_group).to(dtype)
        return hidden_states


def to_host(model: torch.nn.Module) -> None:
    """On a rank without CUDA: the routers and dispatchers of ``model`` become the host ones (same
    state, same parameters; only the methods that assume CUDA differ)."""
    for module in model.modules():
        if type(module) is TopKRouter:
            module.__class__ = HostTopKRouter
        token_dispatcher = getattr(module, "token_dispatcher", None)
        if type(token_dispatcher) is MoEAllGatherTokenDispatcher:
            token_dispatcher.__class__ = HostAllGatherDispatcher


# ---------------------------------------------------------------------------------------------
# The auxiliary losses
# ---------------------------------------------------------------------------------------------


def set_aux_loss_scale(optimizer, num_microbatches: int, device: torch.device) -> None:
    """The gradient scale of the load-balancing and z losses for this step: the optimizer's loss scale
    over the micro-batches, as megatron-core's schedules set it (each micro-batch's language-model loss
    is divided by their number too)."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    one = torch.ones(1, device=device)
    scale = optimizer.scale_loss(one) if optimizer is not None else one
    MoEAuxLossAutoScaler.set_loss_scale(scale.detach() / num_microbatches)


def aux_losses(cfg, num_microbatches: int) -> Dict[str, torch.Tensor]:
    """This step's MoE losses (``load_balancing_loss``, ``z_loss``, ... as megatron-core names them), each
    averaged over the MoE layers and micro-batches and reduced over the ranks as megatron-core's
    ``track_moe_metrics`` does; its tracker is cleared for the next step. A collective: every rank calls it
    after each training step. Empty when no loss is tracked (coefficients 0)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    if not get_moe_layer_wise_logging_tracker():
        return {}
    totals: Dict[str, torch.Tensor] = {}
    track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0, writer=None, total_loss_dict=totals,
                      num_layers=cfg.num_layers, moe_layer_freq=cfg.moe_layer_freq)
    return {name: value.detach().float().reshape(()) for name, value in totals.items()}


def clear_aux_losses() -> None:
    """Forget what evaluation forwards (or an abandoned step) added to the tracker."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


# ---------------------------------------------------------------------------------------------
# Expert parameters: their own data parallelism, their global names
# ---------------------------------------------------------------------------------------------


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """megatron-core marks expert parameters ``allreduce = False``: they are reduced over the
    expert-data-parallel group, not the whole data-parallel group."""
    return getattr(param, "allreduce", True) is False


def expert_param_names(model: torch.nn.Module) -> List[str]:
    return [name for name, param in model.named_parameters() if is_expert_param(param)]


def reduce_expert_grads(model: torch.nn.Module) -> None:
    """The expert gradients of a CPU rank (which torch DDP left out), reduced as megatron-core's DDP
    reduces them: summed over the expert-data-parallel group and divided by the data-parallel size
    (each expert's gradient already holds the tokens of every rank in its expert-parallel group, which
    the dispatcher gathered)."""
    grads = [p.grad for p in model.parameters() if is_expert_param(p) and p.grad is not None]
    if not grads:
        return
    dp = parallel_state.get_data_parallel_world_size()
    edp_group = parallel_state.get_expert_data_parallel_group()
    flat = torch.cat([g.reshape(-1) for g in grads])
    if torch.distributed.get_world_size(edp_group) > 1:
        torch.distributed.all_reduce(flat, group=edp_group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def expert_sq_norm_group():
    """The group over which expert parameters differ (expert x expert-tensor parallel): a gradient norm
    sums their squares over it."""
    return parallel_state.get_expert_tensor_and_model_parallel_group()


def global_expert_name(name: str, to_global: bool, num_experts: Optional[int]) -> str:
    """A local expert parameter's name with its index made global (``to_global``) or local again: with
    expert parallelism rank r holds experts ``r*n .. r*n+n-1`` as ``0 .. n-1``, and a checkpoint names them
    by their global index so that it loads at any expert-parallel size. ``num_experts``: the model's
    (None: a dense model, names unchanged)."""
    match = _LOCAL_EXPERT.fullmatch(name) or _GROUPED_EXPERT.fullmatch(name)
    if match is None or num_experts is None or not parallel_state.model_parallel_is_initialized():
        return name
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return name
    offset = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep_size)
    index = int(match.group(2)) + (offset if to_global else -offset)
    return f"{match.group(1)}{index}{match.group(3) if match.lastindex == 3 else ''}"
