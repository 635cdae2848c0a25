"""One error type for bad input, and one way to report it.

Every command-line tool turns a :class:`ConfigError` into a single message on stderr and exit
status 2 — no traceback — so that a user sees which file and which key is wrong and what was expected.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Optional, TypeVar

from bridge_hpc.contracts.text import one_line

EXIT_BAD_INPUT = 2

F = TypeVar("F", bound=Callable[..., int])


class ConfigError(ValueError, AssertionError):
    """Bad user input: names the file, the key (dotted, e.g. ``slurm.time``) and what was expected.

    A ValueError and an AssertionError too, because Megatron Bridge's config validation raises those
    (``finalize`` and ``validate`` assert, or raise ValueError): a user's ``except ValueError`` or
    ``pytest.raises(AssertionError)`` written against Bridge catches this one the same way, while the
    command-line tools still turn it into one line and exit status 2 (:func:`exits_on_config_error`).
    """

    def __init__(self, message: str, *, path: Optional[str] = None, key: Optional[str] = None):
        self.path = path
        self.key = key
        self.message = message
        super().__init__(self.format())

    def format(self) -> str:
        where = []
        if self.path:
            where.append(str(self.path))
        if self.key:
            where.append(f"key '{self.key}'")
        prefix = ": ".join(where)
        return one_line(f"{prefix}: {self.message}" if prefix else self.message)


class MissingPackageError(ConfigError, ModuleNotFoundError):
    """A config turns on something whose package is not installed: a :class:`ConfigError` naming the key,
    and the ModuleNotFoundError Megatron Bridge raises there (``LoggerConfig.finalize`` for MLflow and
    Comet ML), so ``except ModuleNotFoundError`` written against Bridge catches it. ``name`` is the package."""

    def __init__(self, message: str, *, package: str, path: Optional[str] = None, key: Optional[str] = None):
        super().__init__(message, path=path, key=key)
        self.name = package


class UnexpectedKeywordError(ConfigError, TypeError):
    """A config given a field its type does not take: a :class:`ConfigError` naming the key, and the
    TypeError Megatron Bridge raises there (``MockGPTDatasetConfig.finalize`` with a ``blend``)."""


def exits_on_config_error(main: F) -> F:
    """Decorate a CLI ``main`` so that a ConfigError becomes one line on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as err:
            print(f"error: {err.format()}", file=sys.stderr)
            return EXIT_BAD_INPUT

    return wrapper  # type: ignore[return-value]
