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

    def base_bias_in_output(self) -> Optional[torch.Tensor]:
        """The base's bias where its output includes it (not ``skip_bias_add``), else None."""
        bias = getattr(self.to_wrap, "bias", None)
        return None if getattr(self.to_wrap, "skip_bias_add", True) else bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        out = self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
        return out
