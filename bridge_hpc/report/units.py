"""Units a person can read: time in seconds, minutes or hours by the span shown, rates scaled by k or M.

A demo run on CPU lasts a minute and trains thousands of tokens per second; a production run lasts days
and trains millions. One fixed unit reads as 0.0030 h or 0.0 for the one and as huge numbers for the
other, so the table and the plot pick the unit from the values they show.
"""

from __future__ import annotations

from typing import Optional, Tuple

#: (name, seconds): the largest unit in which the span is still at least 2 of it.
TIME_UNITS = (("h", 3600.0), ("min", 60.0), ("s", 1.0))
#: (prefix, factor) for rates, largest first.
RATE_PREFIXES = (("M", 1e6), ("k", 1e3), ("", 1.0))


def time_unit(span_s: float) -> Tuple[str, float]:
    """``("s", 1)`` for spans under 2 minutes, ``("min", 60)`` under 2 hours, else ``("h", 3600)``."""
    for name, seconds in TIME_UNITS:
        if span_s >= 2 * seconds:
            return name, seconds
    return TIME_UNITS[-1]


def rate_prefix(largest: float) -> Tuple[str, float]:
    """The SI prefix under which ``largest`` reads between 1 and 1000: ``("k", 1e3)`` for 11 900."""
    for prefix, factor in RATE_PREFIXES:
        if abs(largest) >= factor:
            return prefix, factor
    return RATE_PREFIXES[-1]


def format_rate(value: Optional[float]) -> Optional[str]:
    """Three significant digits: ``0.50``, ``850``, ``12.3k``, ``1.25M`` (None stays None: the caller
    says what unknown looks like)."""
    if value is None:
        return None
    prefix, factor = rate_prefix(value)
    scaled = value / factor
    digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 100 else 0  # 3 significant digits
    return f"{scaled:.{digits}f}{prefix}"
