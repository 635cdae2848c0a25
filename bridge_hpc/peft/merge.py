"""Merged weights: what a model with adapters computes, as plain weights of its base layers (for export,
e.g. the Hugging Face writer, and for inference without adapters).

- LoRA: ``W + (alpha / dim) B A``;
- DoRA: ``m / ||W + s B A|| * (W + s B A)``, row by row (``s = alpha / dim``).

Three forms: :func:`merged_state_dict` (a model's state dict with merged weights, the model untouched),
:func:`merge_adapters` (the model changed in place into its plain form, what Bridge's ``LoRAMerge`` does)
and :func:`merge_state_dicts` (from checkpoints' state dicts: a base's and an adapter-only one, both at
tensor-parallel size 1, e.g. read from the pretrained checkpoint and a PEFT run's checkpoint).
Under tensor parallelism the first two give this rank's part of each weight, split as the base is.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from bridge_hpc.peft.adapter_wrapper import AdapterWrapper
from bridge_hpc.peft.base import _chunks, walk

#: A wrapper's base layer attribute, dropped from keys so that merged keys are the plain model's.
_WRAPPED = ".to_wrap."


def merged_weight(wrapper: AdapterWrapper) -> torch.Tensor:
    """This rank's part of the merged weight of one wrapped layer, in the base weight's dtype."""
    from bridge_hpc.peft.dora_layers import DoRALinear, combined_weight, row_norms

    base = wrapper.to_wrap.weight
    with torch.no_grad():
        merged = combined_weight(base, wrapper.adapter)
        if isinstance(wrapper, DoRALinear):
            scale = wrapper.adapter.weight_magnitude.float() / row_norms(base, wrapper.adapter)
            merged = merged * scale.unsqueeze(1)
    return merged.to(base.dtype)


def merged_state_dict(model) -> Dict[str, torch.Tensor]:
    """The state dict of ``model`` (a module or list of chunks with adapters) as the plain model's: every
    wrapped layer's ``weight`` merged, its other base entries under their plain keys, no adapter keys.
    With several chunks (virtual pipeline stages) keys are prefixed ``model<i>.`` as in checkpoints."""
    chunks = _chunks(model)
    out: Dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(chunks):
        prefix = "" if len(chunks) == 1 else f"model{i}."
        merged = {f"{name}.weight": merged_weight(module) for name, module in chunk.named_modules()
                  if isinstance(module, AdapterWrapper)}
        for key, value in chunk.state_dict().items():
            if ".adapter." in f".{key}" or value is None:
                continue
            plain = key.replace(_WRAPPED, ".")
            out[prefix + plain] = merged.get(plain, value)
    return out


def merged_module(module):
    """A wrapped layer's base layer with the merged weight in place (the base layer itself for any other module)."""
    if not isinstance(module, AdapterWrapper):
        return module
    weight = merged_weight(module)
    base = module.to_wrap
    with torch.no_grad():
        base.weight.copy_(weight)
    return base


def merge_adapters(model):
    """Fold every adapter of ``model`` into its base layer and put the base layer back in the wrapper's
    place (in place; returns ``model``): the plain model, computing what the adapted one did."""
    for chunk in _chunks(model):
        walk(chunk, lambda module, name, prefix: merged_module(module))
    return model


def merge_state_dicts(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], alpha: float,
                      dim: int) -> Dict[str, torch.Tensor]:
    """The plain model's state dict from a base state dict and an adapter-only one (full tensors, i.e. at
    tensor-parallel size 1; ``alpha`` and ``dim`` the PEFT's): ``base`` with each adapted ``<layer>.weight``
    merged (LoRA, or DoRA where ``<layer>.adapter.weight_magnitude`` is present)."""
    out = dict(base)
    suffix = ".adapter.linear_in.weight"
    for key in adapters:
        if not key.endswith(suffix):
            continue
        layer = key[: -len(suffix)]
        weight = base[f"{layer}.weight"]
        a = adapters[key].float()
        b = adapters[f"{layer}.adapter.linear_out.weight"].float()
        merged = weight.float() + (alpha / dim) * (b @ a)
        magnitude: Optional[torch.Tensor] = adapters.get(f"{layer}.adapter.weight_magnitude")
        if magnitude is not None:
            merged = merged * (magnitude.float() / merged.norm(dim=1)).unsqueeze(1)
        out[f"{layer}.weight"] = merged.to(weight.dtype)
    return out
