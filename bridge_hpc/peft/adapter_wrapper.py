"""The wrapper of a frozen base linear layer and its adapter (Bridge's
``megatron.bridge.peft.adapter_wrapper.AdapterWrapper``): what LoRA's and DoRA's layers share."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule


class AdapterWrapper(MegatronModule):
    """A base linear layer (``to_wrap``, frozen) and its adapter (``adapter``). In megatron-core's
    checkpoint keys the wrapper is transparent: the base keeps its keys, the adapter's are under
    ``<layer>.adapter.`` (``adapter``: a ``lora_layers.ParallelLinearAdapter`` or its DoRA subclass)."""

    def __init__(self, to_wrap, adapter: MegatronModule):
        super().__init__(config=to_wrap.config)
        self.to_wrap = to_wrap
        self.adapter = adapter

    def base_linear_forward(self, x: torch.Tensor, *args, **kwargs):
        """``(output, bias, the adapter's input)`` of the base layer (Bridge's method): the input is ``x``,
        or for Transformer Engine's layer-norm linear (``return_layernorm_output``, which the wrapper
        sets) the normalized ``x`` that the base multiplied. The base returns ``(out, bias)``,
        ``((out, ln_out), bias)`` or ``(out, bias, ln_out)``."""
        result = self.to_wrap(x, *args, **kwargs)
        if len(result) == 3:
            return result
        output, bias = result
        if isinstance(output, tuple):
            output, x = output
        return output, bias, x

    def base_bias_in_output(self) -> Optional[torch.Tensor]:
        """The base's bias where its output includes it (not ``skip_bias_add``), else None."""
        bias = getattr(self.to_wrap, "bias", None)
        if bias is not None and bias.numel() == 0:  # Transformer Engine's layers without a bias
            return None
        if hasattr(self.to_wrap, "te_return_bias"):  # megatron-core's Transformer Engine layers
            return None if self.to_wrap.te_return_bias else bias
        return None if getattr(self.to_wrap, "skip_bias_add", True) else bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        out = self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
        return out
