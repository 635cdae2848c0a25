"""Packages megatron-core imports when it is imported, made to load at their first use instead.

megatron-core imports Weights & Biases at its own import, in two modules (the inference context's
metrics writer and the timers' W&B output), and touches it only when it is handed a W&B writer,
which a training rank here never does: this toolkit's own W&B backend
(:mod:`bridge_hpc.training.utils.log_backends`) imports it when ``logger.wandb_project`` is set. The
import is 0.6 s of an idle 2-core machine's 3.7-4.0 s of the rank's imports (``python -X importtime``,
2026-12-03), paid by every rank at every start and requeue.

:func:`install` puts a stand-in module for each package of :data:`LOADED_AT_FIRST_USE` into
``sys.modules`` before megatron-core is imported. ``import wandb`` then binds the stand-in at once. The
stand-in carries what the import system and ``inspect`` read of every module without using it
(``__name__``, ``__file__``, ``__spec__``, ...: ``inspect.getmodule``, which torch calls when it registers
a custom operator, reads ``__file__`` of everything in ``sys.modules``), and anything else
(``wandb.init``, ``wandb.__version__``, ``__path__`` for a submodule) imports the real package then and
is read from it; the real package takes its place in ``sys.modules``. A run that logs to W&B gets the
whole package at its first call. A package that is not installed gets no stand-in: megatron-core's
``try: import wandb / except ImportError`` sees it missing, as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Iterable, List

#: Imported by megatron-core at its import, used by a training rank only through this toolkit's backends.
LOADED_AT_FIRST_USE = ("wandb",)

_LOCK = threading.RLock()


class _ImportedAtFirstUse(types.ModuleType):
    """A package's stand-in until an attribute it does not carry is read: that imports the package."""

    def __getattr__(self, attr: str):  # only for attributes not in the stand-in's own __dict__
        real = self.__dict__.get("_bridge_real")
        if real is None:
            with _LOCK:
                real = self.__dict__.get("_bridge_real")
                if real is None:
                    if sys.modules.get(self.__name__) is self:
                        del sys.modules[self.__name__]
                    real = importlib.import_module(self.__name__)
                    self.__dict__["_bridge_real"] = real
        return getattr(real, attr)


def install(names: Iterable[str] = LOADED_AT_FIRST_USE) -> List[str]:
    """A stand-in in ``sys.modules`` for each installed, not yet imported package of ``names``; returns
    the names it put there."""
    installed = []
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        stand_in = _ImportedAtFirstUse(name)
        stand_in.__file__ = spec.origin
        stand_in.__spec__ = spec
        stand_in.__loader__ = spec.loader
        stand_in.__package__ = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
        sys.modules[name] = stand_in
        installed.append(name)
    return installed
