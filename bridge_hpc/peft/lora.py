"""``LoRA`` and ``LoRAMerge`` at Megatron Bridge's path (``megatron.bridge.peft.lora``).

LoRA adds to each targeted linear layer ``W`` a low-rank update: ``y = W x + (alpha / dim) B A x``,
``A`` [dim, in] and ``B`` [out, dim], ``B`` starting at zero so the transformed model computes what the
base does. Only ``A`` and ``B`` train. Under tensor parallelism they are split the way their layer is
(:mod:`bridge_hpc.peft.lora_layers`). On Transformer Engine's layers the adapter runs inside TE's fused
linear where one rank holds the layer (:mod:`bridge_hpc.peft.te_lora`), else beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional

from bridge_hpc.contracts.schema import check_left_at_default
from bridge_hpc.peft.base import PEFT, check_low_rank_fields
from bridge_hpc.peft.module_matcher import ModuleMatcher, _default_targets

#: The fields of Bridge's LoRA that need what this toolkit's dense GPTs do not have.
REFUSED_FIELDS = {
    "a2a_experimental": "the experts' adapters run inside megatron-core's expert layers, after its token "
                        "dispatcher: Bridge's experimental all-to-all of adapter inputs is not built",
    "normalize_moe_lora": "not built: an expert's adapter has the rank peft.dim, as every other adapter",
    "lora_dtype": "adapters take their base layer's parameter dtype (model.bf16 / fp16 / fp32)",
}


@dataclass
class LoRA(PEFT, ModuleMatcher):
    """Bridge's LoRA: ``target_modules`` (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` or
    wildcard patterns), ``dim`` (rank), ``alpha`` (the update is scaled by ``alpha / dim``), ``dropout`` with
    ``dropout_position`` (``"pre"``: on the adapter's input; ``"post"``: on its output), and the
    initializations of ``A`` and ``B`` (``"xavier"``, ``"normal"``, ``"kaiming"``, ``"zero"``)."""

    target_modules: List[str] = field(default_factory=_default_targets)
    dim: int = 32
    alpha: int = 32
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    a2a_experimental: bool = False
    lora_dtype: Optional[Any] = None
    normalize_moe_lora: bool = False

    def finalize(self) -> None:
        self.check_targets("peft")
        check_low_rank_fields(self, "peft")
        check_left_at_default(self, "peft", REFUSED_FIELDS)

    def transform(self, module, name: Optional[str] = None, prefix: Optional[str] = None):
        """``module`` wrapped with a LoRA adapter (:class:`~bridge_hpc.peft.lora_layers.LoRALinear`) where it is
        a targeted linear layer; otherwise ``module``."""
        from bridge_hpc.peft.lora_layers import LoRALinear, adapter_for, is_te_linear

        if isinstance(module, LoRALinear):
            return module
        found = adapter_for(self, module, name, prefix)
        if found is None:
            return module
        if is_te_linear(module):  # Transformer Engine's layer: the adapter inside its fused op where it can be
            from bridge_hpc.peft import te_lora

            if te_lora.fusable(module, found):
                return te_lora.TEFusedLoRALinear(module, found)
        return LoRALinear(module, found)


class LoRAMerge(PEFT):
    """Bridge's merge: ``LoRAMerge()(model, training=False)`` folds every adapter into its base weight
    (``W + alpha / dim B A``; for DoRA its magnitude-normalized form) and puts the base layer back in
    the wrapper's place, giving the plain model. See :func:`bridge_hpc.peft.merge.merge_adapters`."""

    def __call__(self, model, training: bool = False):
        from bridge_hpc.peft.merge import merge_adapters

        return merge_adapters(model)

    def transform(self, module, name: Optional[str] = None, prefix: Optional[str] = None):
        from bridge_hpc.peft.merge import merged_module

        return merged_module(module)
