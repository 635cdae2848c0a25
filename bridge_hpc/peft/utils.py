"""Torch-free helpers of the PEFT configs: the wildcard match of ``target_modules`` and the adapter key
rule that every checkpoint path applies."""

from __future__ import annotations

import re
from functools import lru_cache

#: The linear layers of megatron-core's GPT layer that adapters can wrap (Bridge's target names).
LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

#: The adapter's attribute inside a wrapped layer: every adapter parameter's key holds ``.adapter.``
#: (Bridge's rule), so a checkpoint's model state is told apart from the base's by name alone.
ADAPTER_ATTRIBUTE = "adapter"


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> "re.Pattern[str]":
    return re.compile("^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$")


def wildcard_match(pattern: str, key: str) -> bool:
    """Whether module name ``key`` matches ``pattern``, where ``*`` stands for any characters (dots
    included), as Bridge matches ``target_modules``: ``"*.linear_qkv"``, ``"decoder.layers.0.*"``."""
    return _compiled(pattern).match(key) is not None


def is_adapter_key(key: str) -> bool:
    """Whether a model state key (``decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight``) belongs to
    an adapter: what a PEFT checkpoint saves and loads (Bridge's ``adapter_key_filter`` on strings)."""
    return f".{ADAPTER_ATTRIBUTE}." in f".{key}"
