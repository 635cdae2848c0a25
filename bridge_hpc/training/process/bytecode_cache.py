"""A bytecode cache for the ranks' imports, where the installed packages have none.

Every rank of every run imports torch and megatron-core (thousands of modules) before its first
step, and a requeued run pays for that inside the time a preemption loses. Python keeps compiled
modules next to their sources (``__pycache__``), except where it cannot: an install that is
read-only and came without them (container images, software stacks installed with
``pip --no-compile``), or ``PYTHONDONTWRITEBYTECODE`` set (a common container default). Then every
process compiles every module from source again. On an H200 host of the device tool (read-only
torch install without bytecode, ``PYTHONDONTWRITEBYTECODE=1``) importing the training core took
15.8-17.8 s that way (3 runs) and 6.9 s with a cache (2026-11-26).

:func:`ensure_bytecode_cache` runs before torch is imported (``python -m bridge_hpc.rank``).
It detects that case from the packages themselves and points Python's ``pycache_prefix`` at a
writable folder (``[job] bytecode_cache``), for this process and the processes it starts (the
checkpoint worker, data-loader workers). The first run fills the cache and every later start reads
it. Where the packages have their bytecode, or where Python will write it, nothing changes. A
prefix the user set (``PYTHONPYCACHEPREFIX``) is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Sequence

from bridge_hpc.contracts.bytecode_cache import AUTO, OFF

#: The packages whose import dominates a rank's start-up; their ``__init__`` is probed (finding
#: ``megatron.core`` imports only the namespace package ``megatron``, which has no code).
PROBED_PACKAGES = ("torch", "megatron.core")
#: The folder :func:`ensure_bytecode_cache` put in use in this process, for the start-up log line.
in_use: Optional[str] = None


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/bridge_hpc/pycache`` (``~/.cache/...`` by default): per user, shared by
    the nodes where the home folder is, so a requeued run on another node finds it filled."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bridge_hpc", "pycache")


def compiles_every_time(packages: Sequence[str] = PROBED_PACKAGES) -> bool:
    """Whether importing one of ``packages`` compiles it from source in every process: no
    bytecode is found for its ``__init__``, and Python would not write it (writing switched off,
    or the folder not writable)."""
    for name in packages:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            continue  # not installed, a namespace package, or an extension module
        cached = importlib.util.cache_from_source(origin)
        if os.path.exists(cached):
            continue
        folder = os.path.dirname(cached)
        writable = os.access(folder if os.path.isdir(folder) else os.path.dirname(folder), os.W_OK)
        if sys.dont_write_bytecode or not writable:
            return True
    return False


def ensure_bytecode_cache(setting: str, packages: Sequence[str] = PROBED_PACKAGES) -> Optional[str]:
    """Point this process's bytecode cache, and its children's, at a writable folder where
    ``packages`` would otherwise be compiled at every start. ``setting``: ``[job] bytecode_cache``
    (``auto``, ``off`` or an absolute folder: :mod:`bridge_hpc.contracts.bytecode_cache`). Returns
    the folder now in use, or None when nothing was changed (off, not needed, a prefix already
    set, or the folder cannot be made)."""
    if setting == OFF or sys.pycache_prefix is not None or not compiles_every_time(packages):
        return None
    folder = default_cache_dir() if setting == AUTO else os.path.expanduser(setting)
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError("not writable")
    except OSError as err:
        print(f"warning: no bytecode cache in {folder} ([job] bytecode_cache; {err}): torch and megatron-core "
              f"are compiled from source at every start", file=sys.stderr, flush=True)
        return None
    global in_use
    in_use = sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = folder  # the processes this one starts
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
