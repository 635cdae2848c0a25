"""Typed TOML tables: build a dataclass from a table, or say exactly which key is wrong and why.

Shared by the launcher's sections (``bridge_hpc.jobfile.jobconfig``) and the training sections
(``bridge_hpc.training.config``), so both answer bad input the same way. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Callable, Dict, List, Literal, Sequence, Tuple, Union

from bridge_hpc.contracts.errors import ConfigError

#: A job file's own sections for the launcher (bridge_hpc.jobfile.jobconfig types them); every other
#: section belongs to the ranks' training config (bridge_hpc.training.config.SECTIONS), which skips these.
LAUNCHER_SECTIONS = ("job", "slurm", "env", "container", "setup", "cluster")


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a type hint (bools are not ints; ints are floats)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is Union:
        return any(matches(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, List, tuple, Tuple):
        return isinstance(value, (list, tuple)) and (not args or all(matches(v, args[0]) for v in value))
    if origin in (dict, Dict):
        vt = args[1] if args else Any
        return isinstance(value, dict) and all(isinstance(k, str) and matches(v, vt) for k, v in value.items())
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return " or ".join(type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, List, tuple, Tuple):
        return f"a list of {type_name(args[0])}s" if args else "a list"
    if origin in (dict, Dict):
        return "a table"
    names = {str: "a string", int: "an integer", bool: "true or false", float: "a number"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints`` once per class: it evaluates every annotation string each call, which
    was half the time of a ``--dry-run``."""
    return typing.get_type_hints(cls)


def build_dataclass(cls: type, section: str, body: Any, error: Callable[[str, str], ConfigError]) -> Any:
    """Instantiate ``cls`` from a TOML table. ``error(dotted_key, message)`` makes the exception, so
    the caller decides which file a key is blamed on (a job file, a profile, a --set)."""
    if not isinstance(body, dict):
        raise error(section, f"expected a table [{section}], got {body!r}")
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key, value in body.items():
        if key not in names:
            raise error(f"{section}.{key}", f"unknown key{did_you_mean(key, names)}; known keys: {', '.join(names)}")
        if not matches(value, hints[key]):
            raise error(f"{section}.{key}", f"expected {type_name(hints[key])}, got {value!r}")
    for f in dataclasses.fields(cls):
        required = f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in body:
            raise error(f"{section}.{f.name}", f"is required in [{section}] ({type_name(hints[f.name])})")
    return cls(**body)


def check(condition: bool, key: str, message: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``condition``: every section's ``finalize``
    checks its fields with this."""
    if not condition:
        raise ConfigError(message, key=key)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass field ``name`` of ``cls`` (a fresh one from its factory)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    raise KeyError(name)


def check_left_at_default(section: Any, section_name: str, reasons: Dict[str, str]) -> None:
    """Refuse, naming ``<section_name>.<field>``, every field of ``reasons`` whose value is not the
    field's default: the fields Megatron Bridge documents that this trainer cannot act on. Their
    default is always accepted (a Bridge config that spells it out runs unchanged); any other value
    would otherwise be silently ignored."""
    for name, why in reasons.items():
        default = field_default(type(section), name)
        value = getattr(section, name)
        if value != default:
            raise ConfigError(f"must be left at its default ({default!r}): {why}", key=f"{section_name}.{name}")


class DeferredPostInit:
    """Bridge's configs that derive from megatron-core's (DDP, optimizer, GPT dataset) skip its
    ``__post_init__`` at construction, so fields can still be changed; ``finalize()`` fills the
    derived fields and checks them. The same holds here."""

    def __post_init__(self) -> None:
        """Computes nothing: see ``finalize``."""
