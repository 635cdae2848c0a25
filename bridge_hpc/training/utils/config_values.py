"""What a config sets other than the defaults, as a log line shows it, and which of its values are secrets.

Why a module of its own: these helpers compare a section with a baseline and word the difference,
which is a matter of reading a config, not of its sections' rules; :mod:`bridge_hpc.training.config`
keeps the sections and their checks, and its ``ConfigContainer`` uses these for
:meth:`~bridge_hpc.training.config.ConfigContainer.log_non_default_values` and ``to_dict``. The
``_get_*`` helpers are Megatron Bridge's private ones of ``bridge.training.config`` (its pages
document them) and are re-exported there under those names. Torch-free at module level:
:func:`_get_mcore_transformer_parent` imports megatron-core when it is called (ranks only)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Iterable, Tuple

#: Fields that hold secrets: never logged, never saved (what stands in for them: :data:`REDACTED`).
SECRET_FIELDS = (("logger", "comet_api_key"),)
REDACTED = "<redacted>"

#: The longest value :meth:`~bridge_hpc.training.config.ConfigContainer.log_non_default_values` writes whole.
LOGGED_VALUE_CHARS = 200
#: Stands for "no default" in :func:`_non_default_values`.
_REQUIRED = object()


def _non_default_values(section: Any) -> Dict[str, Tuple[Any, Any]]:
    """``{field: (value, default)}`` for the init fields of a dataclass ``section`` whose value is not
    the default (``default`` is :data:`_REQUIRED` for a field without one)."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for f in dataclasses.fields(section):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = _REQUIRED
        value = getattr(section, f.name)
        if default is _REQUIRED or value != default:
            out[f.name] = (value, default)
    return out


def shown_value(value: Any) -> str:
    """``repr(value)``, cut to :data:`LOGGED_VALUE_CHARS` with its length said: a blend of a thousand
    shards must not make a line of megabytes."""
    text = repr(value)
    return text if len(text) <= LOGGED_VALUE_CHARS else text[:LOGGED_VALUE_CHARS] + f"... ({len(text)} chars)"


def log_changed_fields(sections: Iterable[Tuple[str, Any]], log: logging.Logger) -> None:
    """One INFO line on ``log`` for each ``(name, section)`` whose fields differ from their defaults
    (:func:`_non_default_values`), a secret's value shown as :data:`REDACTED`."""
    for name, section in sections:
        changed = _non_default_values(section)
        for section_name, key in SECRET_FIELDS:
            if section_name == name and key in changed:
                changed[key] = (REDACTED, changed[key][1])
        if changed:
            log.info("config [%s] differs from the defaults: %s", name, ", ".join(
                f"{key} = {shown_value(value)}" if default is _REQUIRED
                else f"{key} = {shown_value(value)} (default {shown_value(default)})"
                for key, (value, default) in changed.items()))


def _get_mcore_transformer_parent(model_config: Any) -> type:
    """megatron-core's TransformerConfig class to compare ``model_config`` with (Bridge's helper):
    ``MLATransformerConfig`` for an MLA model, else ``TransformerConfig``. bridge_hpc's
    :class:`GPTModelConfig` is a GPT without MLA, so it gets ``TransformerConfig``. Imports megatron-core
    (ranks only)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if isinstance(model_config, MLATransformerConfig) else TransformerConfig


def _same_value(a: Any, b: Any) -> bool:
    """Equal, or the same dtype spelled as a torch dtype on one side and as its name on the other
    (bridge_hpc's sections keep dtype names, megatron-core's defaults are torch dtypes)."""
    return a == b or str(a).replace("torch.", "") == str(b).replace("torch.", "")


def _get_non_default_values(config_obj: Any, mcore_class: type) -> Dict[str, Tuple[Any, Any]]:
    """``{field: (current value, megatron-core default)}`` for the fields of dataclass ``mcore_class``
    (megatron-core's parent class, e.g. its ``OptimizerConfig``) that ``config_obj`` sets to something
    else (Bridge's helper for :meth:`ConfigContainer.log_non_default_values`). Fields without a default
    in ``mcore_class``, and ones ``config_obj`` lacks, are skipped."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for f in dataclasses.fields(mcore_class):
        if f.name not in {g.name for g in dataclasses.fields(config_obj)}:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        value = getattr(config_obj, f.name)
        if not _same_value(value, default):
            out[f.name] = (value, default)
    return out


def _get_key_config_values(config_obj: Any) -> Dict[str, Any]:
    """``{field: value}`` of dataclass ``config_obj``'s fields, leaving out None values and callables
    (Bridge's helper: what is logged of a section that has no megatron-core parent to compare with)."""
    return {f.name: getattr(config_obj, f.name) for f in dataclasses.fields(config_obj)
            if getattr(config_obj, f.name) is not None and not callable(getattr(config_obj, f.name))}
