"""Which linear layers get adapters: Bridge's ``ModuleMatcher`` (``target_modules``, ``exclude_modules``).

A target is a layer name (``"linear_qkv"``: that layer in every transformer layer) or a wildcard pattern
over the full module name (``"*.linear_qkv"``, ``"decoder.layers.0.*"``, ``"*.layers.1.*.linear_fc2"``).
Full names count layers over the whole model (``decoder.layers.<global index>``), also under pipeline
parallelism where a stage's own modules are numbered from 0, so a pattern means the same layers at
any layout. Only megatron-core's linear layers are candidates: a pattern that matches a layer's norm
as well wraps only its linear layers. A target that matches nothing is refused by name
(:meth:`ModuleMatcher.unmatched_targets`), as Bridge does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.peft.utils import LINEAR_NAMES, wildcard_match


def _default_targets() -> List[str]:
    return list(LINEAR_NAMES)


@dataclass
class ModuleMatcher:
    """``target_modules`` (default: the four linear layers) or, with ``target_modules = []``,
    ``exclude_modules``: every linear layer but those."""

    target_modules: List[str] = field(default_factory=_default_targets)
    exclude_modules: List[str] = field(default_factory=list)

    def check_targets(self, section: str) -> None:
        """Refuse, naming ``<section>.target_modules`` / ``exclude_modules``, what Bridge asserts."""
        _check(isinstance(self.target_modules, list) and all(isinstance(t, str) and t for t in self.target_modules),
               f"{section}.target_modules", f"expected a list of module names or patterns, got {self.target_modules!r}")
        _check(isinstance(self.exclude_modules, list) and all(isinstance(t, str) and t for t in self.exclude_modules),
               f"{section}.exclude_modules", f"expected a list of module names or patterns, got {self.exclude_modules!r}")
        _check(not (self.target_modules and self.exclude_modules), f"{section}.exclude_modules",
               "must be empty when target_modules is set (set target_modules = [] to adapt every linear layer "
               "but the excluded ones)")
        for target in self.target_modules:
            _check("*" in target or "." in target or target in LINEAR_NAMES, f"{section}.target_modules",
                   f"{target!r} is neither one of {', '.join(LINEAR_NAMES)} nor a pattern over full module names "
                   "(e.g. \"*.linear_qkv\", \"decoder.layers.0.*\")")

    def match(self, name: str, full_name: str) -> Optional[Tuple[str, str]]:
        """``(the target that matched, full_name)`` for a linear layer called ``name`` at ``full_name``, or None."""
        if self.target_modules:
            for pattern in self.target_modules:
                if name == pattern or wildcard_match(pattern, full_name):
                    return pattern, full_name
            return None
        if name in self.exclude_modules or any(wildcard_match(p, full_name) for p in self.exclude_modules):
            return None
        return name, full_name

    def unmatched_targets(self, names: List[Tuple[str, str]]) -> List[str]:
        """The targets that match none of ``names`` (``(name, full_name)`` of every candidate layer)."""
        return [t for t in self.target_modules
                if not any(name == t or wildcard_match(t, full) for name, full in names)]
