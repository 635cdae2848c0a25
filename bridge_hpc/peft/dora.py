"""``DoRA`` at Megatron Bridge's path (``megatron.bridge.peft.dora``).

DoRA splits each targeted weight into a magnitude and a direction: ``y = m * (W + s B A) x / ||W + s B A||``
(row norms, ``s = alpha / dim``), with the magnitude ``m`` (one per output feature) starting at
``||W||`` so that the transformed model computes what the base does; ``A``, ``B`` and ``m`` train. As in
Bridge (and the DoRA paper, section 4.3) the norm is treated as a constant in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.peft.base import PEFT, check_low_rank_fields
from bridge_hpc.peft.module_matcher import ModuleMatcher, _default_targets


@dataclass
class DoRA(PEFT, ModuleMatcher):
    """Bridge's DoRA: LoRA's fields with ``alpha`` 64 by default; dropout only before the adapter
    (``dropout_position = "pre"``), as in Bridge."""

    target_modules: List[str] = field(default_factory=_default_targets)
    dim: int = 32
    alpha: int = 64
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"

    def finalize(self) -> None:
        self.check_targets("peft")
        check_low_rank_fields(self, "peft")
        _check(self.dropout_position == "pre", "peft.dropout_position",
               "DoRA applies dropout only before the adapter (\"pre\"), as Megatron Bridge does")

    def transform(self, module, name: Optional[str] = None, prefix: Optional[str] = None):
        """``module`` wrapped with a DoRA adapter (:class:`~bridge_hpc.peft.dora_layers.DoRALinear`) where it is
        a targeted linear layer; otherwise ``module``."""
        from bridge_hpc.peft.dora_layers import DoRALinear, ParallelLinearDoRAAdapter
        from bridge_hpc.peft.lora_layers import adapter_for

        if isinstance(module, DoRALinear):
            return module
        found = adapter_for(self, module, name, prefix, ParallelLinearDoRAAdapter)
        return module if found is None else DoRALinear(module, found)
