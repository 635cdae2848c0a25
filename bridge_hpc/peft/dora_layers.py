"""DoRA's layer (Bridge's ``DoRALinear`` and ``ParallelLinearDoRAAdapter``, ``megatron.bridge.peft.dora_layers``).

``y = m / ||W + s B A|| * (W x + s B A x)`` per output feature (``s = alpha / dim``), the norm over each
row of the full weight: a column-parallel base holds whole rows (no collective); a row-parallel base
holds a slice of every row, whose squared sums are all-reduced over the tensor-parallel group. The
magnitude ``m`` has one entry per output feature, split like the base's output.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from bridge_hpc.peft.adapter_wrapper import AdapterWrapper
from bridge_hpc.peft.lora_layers import ParallelLinearAdapter, _swiglu_layout


def combined_weight(base_weight: torch.Tensor, adapter: ParallelLinearAdapter) -> torch.Tensor:
    """This rank's part of ``W + s B A`` (fp32), laid out as the base weight."""
    a, b = adapter.linear_in.weight.float(), adapter.linear_out.weight.float()
    return base_weight.float() + (adapter.alpha / adapter.dim) * (b @ a)


def row_norms(base_weight: torch.Tensor, adapter: ParallelLinearAdapter) -> torch.Tensor:
    """``||W + s B A||`` of each output feature this rank computes (fp32, no gradient)."""
    with torch.no_grad():
        squares = combined_weight(base_weight, adapter).pow(2).sum(dim=1)
        if adapter.input_is_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        return squares.sqrt()


class ParallelLinearDoRAAdapter(ParallelLinearAdapter):
    """LoRA's adapter plus DoRA's magnitude ``weight_magnitude`` (set by :class:`DoRALinear` from the base)."""

    def init_weight_magnitude(self, value: torch.Tensor, sequence_parallel: bool) -> None:
        self.weight_magnitude = torch.nn.Parameter(value)
        # Under sequence parallelism a row-parallel base's output is split by sequence: the replicated
        # magnitude's gradients are all-reduced over the tensor-parallel group then, as B's are.
        self.weight_magnitude.sequence_parallel = self.input_is_parallel and sequence_parallel

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {} if self.input_is_parallel else {"weight_magnitude": 0}
        out.update(make_sharded_tensors_for_checkpoint({"weight_magnitude": self.weight_magnitude}, prefix, axis,
                                                       sharded_offsets))
        if self.gated:
            _swiglu_layout(out, f"{prefix}weight_magnitude", sharded_offsets)
        return out


class DoRALinear(AdapterWrapper):
    """The base layer rescaled per output feature by the trained magnitude over the current norm."""

    def __init__(self, to_wrap, adapter: ParallelLinearDoRAAdapter):
        super().__init__(to_wrap, adapter)
        adapter.init_weight_magnitude(row_norms(to_wrap.weight, adapter).to(to_wrap.weight.dtype),
                                      bool(to_wrap.config.sequence_parallel))
        self.normalizes_input = hasattr(to_wrap, "return_layernorm_output")
        if self.normalizes_input:
            # Transformer Engine's layer-norm linear: the adapter (and the dropout correction) take the
            # normalized input that the base multiplied
            to_wrap.return_layernorm_output = True
            to_wrap.return_layernorm_output_gathered = bool(to_wrap.config.sequence_parallel)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias, adapter_x = self.base_linear_forward(x, *args, **kwargs)
        inner_bias = self.base_bias_in_output()
        if inner_bias is not None:  # the bias is not part of W: it is not rescaled
            output = output - inner_bias
        scale = (self.adapter.weight_magnitude / row_norms(self.to_wrap.weight, self.adapter).to(output.dtype))
        scale = scale.view(*([1] * (output.dim() - 1)), -1)
        result = scale * (output + self.adapter(adapter_x.contiguous()).reshape(output.shape))
        if self.training and self.adapter.dropout is not None:
            # Bridge's correction: the base's share of the output sees the dropped-out input as well.
            if self.normalizes_input:  # W (dropout(n) - n) of the normalized input, the bias left out
                dropped = torch.nn.functional.linear(self.adapter.dropout(adapter_x) - adapter_x, self.to_wrap.weight)
            else:
                dropped = self.to_wrap(self.adapter.dropout(x) - x, *args, **kwargs)[0]
                if inner_bias is not None:
                    dropped = dropped - inner_bias
            result = result + (scale - 1) * dropped
        if inner_bias is not None:
            result = result + inner_bias
        return result, bias
