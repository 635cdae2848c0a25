"""Megatron Bridge compatibility: model hooks (a value head, a frozen MoE router) for external trainers.

The loop never calls them; they exist because Bridge's ``train_utils`` page documents them, and
:mod:`bridge_hpc.training.utils.train_utils` re-exports them at that path.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

#: Model chunks as the loop passes them around (one per virtual pipeline stage; one here).
ModelList = list[MegatronModule]
#: A hook applied to the model chunks before they are wrapped for data parallelism.
ModelHook = Callable[[ModelList], Optional[ModelList]]



class LinearForLastLayer(nn.Linear):
    """Final replicated projection head compatible with Megatron output-layer calls.

    megatron-core's ``GPTModel`` calls its output layer as ``output_layer(hidden, weight=...,
    runtime_gather_output=...)`` and unpacks ``(logits, bias)``; this head accepts (and ignores) those
    arguments so it can replace ``output_layer`` as a value/reward head: a plain replicated linear
    projection without bias, computed in fp32. With sequence parallelism the activations arrive split
    along the sequence, so the output is gathered back to the full sequence.
    """

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool) -> None:
        """Initialize a replicated final projection.

        Args:
            input_size: Hidden dimension of the transformer output.
            output_size: Output dimension of the value/reward head.
            sequence_parallel: Whether to gather sequence-parallel activations.
        """
        super().__init__(in_features=input_size, out_features=output_size, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            # megatron-core's DDP all-reduces the gradients of parameters marked so over the TP group.
            self.weight.sequence_parallel = True

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:
        """Run the final projection and return Megatron-style ``(output, bias)``."""
        del weight, runtime_gather_output
        logits = super().forward(input_).float()
        if self.sequence_parallel:
            logits = tensor_parallel.gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=False)
        return logits, None


def create_value_head_hook(hidden_size: int, sequence_parallel: bool, output_size: int = 1) -> ModelHook:
    """Create a pre-wrap hook that replaces the final pipeline stage output head.

    The hook sets ``output_layer`` of each chunk that holds the last pipeline stage (per virtual
    stage with interleaved pipelines) to a :class:`LinearForLastLayer`, so the model returns
    ``[batch, seq, output_size]`` values instead of vocabulary logits. Apply it before the model is
    wrapped for data parallelism (the wrapper registers the parameters it reduces).

    Args:
        hidden_size: Hidden dimension of the transformer output.
        sequence_parallel: Whether the model uses sequence parallelism.
        output_size: Number of outputs produced by the final head.

    Returns:
        A model hook suitable for external trainer provider construction.

    (Bridge also registers the head with its Hugging Face conversion mappings; this toolkit has no
    such conversion, so there is nothing to register.)
    """

    def hook(model: Union[ModelList, MegatronModule]) -> ModelList:
        model_chunks = _ensure_model_list(model)
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and vp_size is not None:
            post_process = [parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
                            for vp in range(vp_size)]
        else:
            post_process = [parallel_state.is_pipeline_last_stage()]
        if len(post_process) != len(model_chunks):
            raise ValueError("Model list length and pipeline post-process list length must match. "
                             f"Got {len(model_chunks)} model chunks and {len(post_process)} post-process flags.")
        for chunk, is_last in zip(model_chunks, post_process):
            if is_last:
                chunk.output_layer = LinearForLastLayer(input_size=hidden_size, output_size=output_size,
                                                        sequence_parallel=sequence_parallel)
        return model_chunks

    return hook


def make_value_model(hidden_size: int, sequence_parallel: bool) -> ModelHook:
    """Create a value-head hook compatible with existing external trainer code (one output)."""
    return create_value_head_hook(hidden_size=hidden_size, sequence_parallel=sequence_parallel)


def freeze_moe_router(model: Union[ModelList, MegatronModule]) -> ModelList:
    """Freeze MoE router and shared-expert gate parameters in model chunks.

    For every ``decoder.layers[i].mlp``: the router's ``weight`` and ``bias`` and the shared experts'
    ``gate_weight`` and ``gate_bias``, where present, get ``requires_grad = False``. A dense layer
    (no router) and a model without a decoder are left as they are. Chunks already wrapped (DDP,
    Float16Module) are looked into through ``.module`` (Bridge applies it before wrapping); note that
    a wrapper built before the freeze still holds gradient buffers for these parameters.

    Args:
        model: Single Megatron module or list of virtual-pipeline model chunks.

    Returns:
        The normalized model chunk list with router parameters frozen in place.
    """
    model_chunks = _ensure_model_list(model)
    for chunk in model_chunks:
        inner = chunk
        while not hasattr(inner, "decoder") and isinstance(getattr(inner, "module", None), nn.Module):
            inner = inner.module
        layers = getattr(getattr(inner, "decoder", None), "layers", None)
        if layers is None:
            continue
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None:
                continue
            router = getattr(mlp, "router", None)
            if router is not None:
                _freeze_parameter_if_present(router, "weight")
                _freeze_parameter_if_present(router, "bias")
            shared_experts = getattr(mlp, "shared_experts", None)
            if shared_experts is not None:
                _freeze_parameter_if_present(shared_experts, "gate_weight")
                _freeze_parameter_if_present(shared_experts, "gate_bias")
    return model_chunks


def _ensure_model_list(model: Union[ModelList, MegatronModule]) -> ModelList:
    return model if isinstance(model, list) else [model]


def _freeze_parameter_if_present(module: object, name: str) -> None:
    parameter = getattr(module, name, None)
    if isinstance(parameter, torch.Tensor):
        parameter.requires_grad = False
