"""A job file's sources: the TOML files, the profiles they ``extend``, the ``--set`` overrides, and where
each key came from.

Why a module of its own: reading and merging text is one concern, done before any section has a
meaning; :mod:`bridge_hpc.jobfile.jobconfig` then types and checks the merged document, and names
in each error the file a key came from (:class:`_Where`: the job file, a profile or the command
line). Every limit here keeps a hostile or broken file from costing more than a small read: its
size, how deeply it nests, how many profiles it pulls in. Torch-free: the login node reads it.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import toml

try:  # TOML 1.0 as the standard library reads it (Python >= 3.11); the toml package before
    import tomllib as _tomllib
except ImportError:  # pragma: no cover - Python 3.10
    _tomllib = None

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.text import has_control_chars

#: A ``--set`` key's parts (applied with fullmatch: ``$`` would also match before a final newline).
_KEY_PART_RE = re.compile(r"[A-Za-z0-9_-]+")
#: The largest job file or profile read (a profile pointing at /proc/kcore must not be read whole).
MAX_CONFIG_BYTES = 1 << 20
#: How deeply tables and arrays may nest (the checks below walk them; no job config needs more).
MAX_DEPTH = 16
#: How many files one job may read through ``extends`` (profiles that extend each other several
#: times over would otherwise be read exponentially often).
MAX_PROFILES = 32


_NO_CONTROL = "must not contain newlines or control characters"
_KEY_NOT_PRINTABLE = "a key must not contain newlines, control characters or invisible ones"


def _bad_key(key: str) -> bool:
    """Keys are shown in messages: one with newlines, control, format (bidi overrides, zero-width)
    or space characters other than ' ' is named by its repr and refused (no known key has any)."""
    return not key.isprintable()


def _expanduser(text: str) -> Path:
    """``Path(text).expanduser()``; ValueError (not RuntimeError) for ``~nosuchuser``."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ValueError(f"{text!r}: no such user's home folder") from None


def _resolve(path: Path) -> Path:
    """``path.resolve()``; ValueError (not RuntimeError or OSError) for a symlink loop or a name the
    file system refuses (too long, ...)."""
    try:
        return path.resolve()
    except RuntimeError:
        raise ValueError(f"{str(path)!r}: symbolic links loop") from None
    except OSError as err:
        raise ValueError(f"{str(path)!r}: {err.strerror or err}") from None


def _is_file(path: Path) -> bool:
    """``path.is_file()``; ValueError for an error other than "no such file" (name too long, ...)."""
    try:
        return path.is_file()
    except OSError as err:
        raise ValueError(f"{str(path)!r}: {err.strerror or err}") from None


def _too_deep(value: Any, limit: int = MAX_DEPTH, prefix: str = "") -> Optional[str]:
    """The dotted key under which tables and arrays in ``value`` nest more than ``limit`` levels
    (``prefix`` when it is ``value`` itself or an array in it), else None. Walked without recursion."""
    stack: List[Tuple[Any, int, str]] = [(value, 0, prefix)]
    while stack:
        item, depth, dotted = stack.pop()
        if isinstance(item, dict):
            children = [(v, f"{dotted}.{k}" if dotted else str(k)) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(v, dotted) for v in item]
        else:
            continue
        if depth >= limit:
            return dotted
        stack.extend((child, depth + 1, key) for child, key in children)
    return None


class TomlError(ValueError):
    """Text that is not TOML; the message says where (line and column) and what is wrong."""


def parse_toml(text: str) -> Dict[str, Any]:
    """TOML text to a dict: tomllib (TOML 1.0) where Python has it, else the toml package, whose
    reader misreads valid input (escapes in table names, ``}`` in strings of inline tables).
    Raises TomlError, or RecursionError for arrays or tables nested thousands deep."""
    if _tomllib is not None:
        try:
            return _tomllib.loads(text)
        except _tomllib.TOMLDecodeError as err:
            raise TomlError(str(err)) from None
    try:  # pragma: no cover - Python 3.10
        return toml.loads(text)
    except toml.TomlDecodeError as err:  # pragma: no cover
        raise TomlError(f"{err.msg} (at line {err.lineno}, column {err.colno})") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as err:  # pragma: no cover
        raise TomlError(str(err)) from None


def _read_toml(path: Path, referenced_by: Optional[Tuple[Path, str]] = None) -> Dict[str, Any]:
    """Parse one TOML file. A file reached through ``extends`` that cannot be read or parsed blames
    that key of the file that named it (``referenced_by``); tables nested too deeply are named in the
    file that holds them."""
    def error(message: str) -> ConfigError:
        if referenced_by:
            return ConfigError(f"{str(path)!r}: {message}", path=str(referenced_by[0]), key=referenced_by[1])
        return ConfigError(message, path=str(path))

    if has_control_chars(str(path)):
        if referenced_by:
            raise ConfigError(f"{str(path)!r}: a file name {_NO_CONTROL}", path=str(referenced_by[0]), key=referenced_by[1])
        raise ConfigError(f"a file name {_NO_CONTROL}", path=repr(str(path)))
    try:
        if not path.is_file():
            raise error("file does not exist" if not path.exists() else "not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise error(f"cannot read file: {err.strerror or err}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise error(f"larger than {MAX_CONFIG_BYTES} bytes: not a job config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise error("not a text file (not UTF-8)") from None
    if "\0" in text:
        raise error("not a text file (contains NUL bytes)")
    try:
        doc = parse_toml(text)
    except TomlError as err:
        raise error(f"not valid TOML: {err}") from None
    except RecursionError:
        raise error(f"tables or arrays nested too deeply (more than {MAX_DEPTH} levels)") from None
    deep = _too_deep(doc)
    if deep is not None:
        raise ConfigError(f"tables or arrays nested too deeply (more than {MAX_DEPTH} levels)", path=str(path),
                          key=deep or None)
    return doc


def deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    """Tables merge key by key; any other value in ``override`` replaces the base's."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_with_profiles(path: Path, chain: Tuple[Path, ...] = (),
                        referenced_by: Optional[Tuple[Path, str]] = None,
                        read: Optional[List[Path]] = None) -> Tuple[Dict[str, Any], Dict[Tuple[str, ...], Path]]:
    """Read ``path`` after the profiles it ``extends`` (in order); later values win.

    Returns the merged document and, for every leaf key, the file it came from, so that an error in
    an inherited key names the profile, not the job file. ``read`` counts the files read so far.
    """
    read = [] if read is None else read
    read.append(path)
    if len(read) > MAX_PROFILES:
        raise ConfigError(f"more than {MAX_PROFILES} files read through extends (profiles that extend each other "
                          "over and over?)", path=str(referenced_by[0] if referenced_by else path), key="extends")
    doc = _read_toml(path, referenced_by)
    extends = doc.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise ConfigError("expected a file name or a list of file names", path=str(path), key="extends")
    merged: Dict[str, Any] = {}
    origin: Dict[Tuple[str, ...], Path] = {}
    for rel in extends:
        if has_control_chars(rel):
            raise ConfigError(f"{rel!r}: a file name {_NO_CONTROL}", path=str(path), key="extends")
        if not rel.strip():
            raise ConfigError("expected a file name, got an empty string", path=str(path), key="extends")
        try:
            parent = _resolve(path.parent / _expanduser(rel))
            is_file = _is_file(parent)
        except ValueError as err:
            raise ConfigError(f"profile {rel!r}: {err}", path=str(path), key="extends") from None
        if parent in chain or parent == path:
            raise ConfigError(f"profiles extend each other in a cycle through {str(parent)!r}", path=str(path), key="extends")
        if not is_file:
            what = "not found" if not os.path.lexists(parent) else "is not a regular file"
            raise ConfigError(f"profile {rel!r} {what} (looked for {str(parent)!r})", path=str(path), key="extends")
        pdoc, porigin = _load_with_profiles(parent, chain + (path,), (path, "extends"), read)
        merged = deep_merge(merged, pdoc)
        origin.update(porigin)
    merged = deep_merge(merged, doc)
    for keypath in _leaf_paths(doc):
        origin[keypath] = path
    return merged, origin


def _leaf_paths(doc: Dict[str, Any], prefix: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    out = []
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            out.extend(_leaf_paths(value, prefix + (key,)))
        else:
            out.append(prefix + (key,))
    return out


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``section.key=value`` -> (["section", "key"], value). The value is read as a TOML value when it
    is one (numbers, booleans, quoted strings, arrays), else taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    if has_control_chars(key) or _bad_key(key.strip()):
        raise ConfigError(f"--set {text!r}: {_KEY_NOT_PRINTABLE}", key=key.strip())
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(_KEY_PART_RE.fullmatch(p) for p in parts):
        raise ConfigError(f"--set {text!r}: expected a dotted key of letters, digits, '_' and '-' "
                          "such as train.train_iters", key=key.strip())
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"--set {key.strip()}: more than {MAX_DEPTH} levels of keys", key=key.strip())
    try:
        value = parse_toml(f"v = {raw}")["v"]
    except RecursionError:
        raise ConfigError(f"--set {key.strip()}: the value is nested too deeply", key=key.strip()) from None
    except (TomlError, KeyError):
        value = raw
    if _too_deep(value, MAX_DEPTH - len(parts)) is not None:
        raise ConfigError(f"--set {key.strip()}: the value is nested too deeply", key=key.strip())
    if isinstance(value, (datetime.date, datetime.time)):
        value = raw  # slurm.time=02:00:00 means the string, not a TOML time of day
    return parts, value


@dataclass
class _Where:
    """Maps a dotted key to the file it was set in (the job file, a profile or the command line)."""

    path: Path
    origin: Dict[Tuple[str, ...], Path]
    overridden: Tuple[Tuple[str, ...], ...]

    def file_of(self, dotted: str, parts: Optional[Tuple[str, ...]] = None) -> str:
        """The file that set ``dotted`` (``parts``: the same key path, where a key holds a dot)."""
        parts = parts if parts is not None else tuple(dotted.split("."))
        for n in range(len(parts), 0, -1):  # the key itself, or a table above it set as a whole
            if parts[:n] in self.overridden:
                return f"{self.path} (--set {'.'.join(parts[:n])})"
            if parts[:n] in self.origin:
                return str(self.origin[parts[:n]])
        for keypath in self.overridden:  # a table that a --set (which came last) put keys into
            if keypath[:len(parts)] == parts:
                return f"{self.path} (--set {'.'.join(keypath)})"
        for keypath, origin in self.origin.items():  # a table, or a key that holds a dot
            joined = ".".join(keypath)
            if keypath[:len(parts)] == parts or joined == dotted or joined.startswith(dotted + "."):
                return str(origin)
        # A key missing from its table: whoever set what is in the nearest table above it; where a
        # --set and files both did, the --set, which came last.
        for n in range(len(parts) - 1, 0, -1):
            for keypath in self.overridden:
                if keypath[:n] == parts[:n]:
                    return f"{self.path} (--set {'.'.join(keypath)})"
            for keypath, origin in self.origin.items():
                if keypath[:n] == parts[:n]:
                    return str(origin)
        return str(self.path)

    def error(self, dotted: str, message: str, parts: Optional[Tuple[str, ...]] = None) -> ConfigError:
        return ConfigError(message, path=self.file_of(dotted, parts), key=dotted)
