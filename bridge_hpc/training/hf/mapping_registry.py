"""A family's mappings as one registry (Megatron Bridge's ``MegatronMappingRegistry``; torch-free).

The registry holds a family's :class:`~bridge_hpc.training.hf.param_mapping.MegatronParamMapping`
templates and answers the two questions the conversions ask: which mapping makes a given megatron-core
parameter (the ranks' loader: :meth:`MegatronMappingRegistry.megatron_to_hf_lookup`), and every
mapping of the whole model, templates filled in (the login node's check of a folder's headers and
``bridge-hf export``: :meth:`MegatronMappingRegistry.resolved`).
"""

from __future__ import annotations

import re
from typing import Iterator, List, Optional

from bridge_hpc.training.hf.param_mapping import MegatronParamMapping

_FIELD = re.compile(r"\\\{([ie])\\\}")


class MegatronMappingRegistry:
    """The mappings of one model (``num_layers`` layers), looked up by megatron-core parameter name."""

    def __init__(self, *mappings: MegatronParamMapping, num_layers: int):
        self.mappings, self.num_layers = list(mappings), num_layers
        names = [m.megatron_param for m in self.mappings]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise ValueError(f"more than one mapping for {sorted(twice)}")
        self._patterns = [(re.compile(_FIELD.sub(r"(?P<\1>\\d+)", re.escape(m.megatron_param))), m)
                          for m in self.mappings]

    def __iter__(self) -> Iterator[MegatronParamMapping]:
        return iter(self.mappings)

    def _layers(self, mapping: MegatronParamMapping) -> range:
        return mapping.layers if mapping.layers is not None else range(self.num_layers)

    def megatron_to_hf_lookup(self, megatron_param: str) -> Optional[MegatronParamMapping]:
        """The mapping of ``megatron_param`` (a local-spec name, layer and expert counted over the whole
        model), its templates filled in; None when no mapping of the family makes it."""
        for pattern, mapping in self._patterns:
            match = pattern.fullmatch(megatron_param)
            if match is None:
                continue
            fields = {k: int(v) for k, v in match.groupdict().items()}
            if "i" in fields and fields["i"] not in self._layers(mapping):
                continue
            if "e" in fields and fields["e"] >= mapping.num_experts:
                continue
            return mapping.resolve(**fields)
        return None

    def resolved(self) -> List[MegatronParamMapping]:
        """Every mapping of the model: each template once per layer it covers and expert it has."""
        out = []
        for mapping in self.mappings:
            for i in self._layers(mapping) if mapping.is_layer else [None]:
                for e in range(mapping.num_experts) if "{e}" in mapping.megatron_param else [None]:
                    out.append(mapping.resolve(i, e))
        return out
