"""Durations in one format, read and written by one library: Go's duration syntax
(``250ms``, ``12.3s``, ``1m15s``, ``2h10m``, ``1d``), through ``durationpy``.

What ``ls`` prints as an age, ``--older-than`` accepts as it is printed. Units are read
in any case (``30S``); a number without a unit is refused with the spelling to use,
except ``0``, which needs none.
"""

from __future__ import annotations

from datetime import timedelta

import durationpy

from kvstate.errors import DurationSyntaxError


def parse_seconds(text: str) -> float:
    """``1m30s`` -> 90.0. Raises DurationSyntaxError for a bare number (``30``: seconds
    or minutes?) and for anything durationpy does not read."""
    clean = text.strip().lower()
    try:
        number = float(clean)
    except ValueError:
        number = None
    if number is not None:
        if number:
            raise DurationSyntaxError(f"{text!r} has no unit: write {text.strip()}s (or m, h, ms)")
        return 0.0
    try:
        return float(durationpy.from_str(clean).total_seconds())
    except durationpy.DurationError:
        raise DurationSyntaxError(
            f"{text!r} is not a duration (examples: 250ms, 30s, 1m30s, 2h, 1d)"
        ) from None


def fmt_ms(ms: int | None) -> str:
    """A duration for people, in the syntax ``parse_seconds`` reads: 850ms, 12.3s, 4m5s,
    2h10m. Rounded to what a person reads: 0.1 s under a minute, whole seconds under an
    hour, whole minutes above. PTTL's -1 / -2 read ``none`` / ``gone``."""
    if ms is None:
        return "-"
    if ms < 0:
        return {-1: "none", -2: "gone"}.get(ms, str(ms))
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        rounded = round(ms / 100) * 100
    elif ms < 3_600_000:
        rounded = round(ms / 1000) * 1000
    else:
        rounded = round(ms / 60_000) * 60_000
    return str(durationpy.to_str(timedelta(milliseconds=rounded)))
