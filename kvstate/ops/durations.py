"""Durations in one format, read and written by one library: Go's duration syntax
(``250ms``, ``12.3s``, ``1m15s``, ``2h10m``, ``1d``), through ``durationpy``.

One rule for every duration the CLI takes (``ls --older-than``, ``top --interval``,
``demo --hold``...): a duration with its unit, in any case (``30s``, ``30S``,
``1m30s``), or a plain number of seconds (``30``, ``1.5``), the unit kvstate's API
takes (``room_ttl=900.0``). What ``ls`` prints as an age, ``--older-than`` accepts
as it is printed.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click
import durationpy

from kvstate.errors import DurationSyntaxError

if TYPE_CHECKING:  # generic since click 8.2; a subscript would fail at run time on 8.1
    _ParamType = click.ParamType[float, Any]
else:
    _ParamType = click.ParamType


def parse_seconds(text: str) -> float:
    """``1m30s`` -> 90.0, ``30`` -> 30.0 (a plain number is seconds). Raises
    DurationSyntaxError for anything else: a negative, infinite or NaN value, or what
    durationpy does not read."""
    clean = text.strip().lower()
    try:
        number = float(clean)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number) or number < 0:
            raise DurationSyntaxError(f"{text!r} is not a duration: give 0 or more seconds")
        return number
    try:
        seconds = float(durationpy.from_str(clean).total_seconds())
    except durationpy.DurationError:
        raise DurationSyntaxError(
            f"{text!r} is not a duration (examples: 250ms, 30s, 1m30s, 2h, 1d, or 30 for seconds)"
        ) from None
    if seconds < 0:
        raise DurationSyntaxError(f"{text!r} is negative: durations are 0 or more")
    return seconds


class Duration(_ParamType):
    """A click option's duration, read by :func:`parse_seconds` (``30s``, ``1m30s``,
    ``250ms``, or ``30`` for seconds): the one rule of every duration option.
    ``minimum`` (seconds) refuses periods that would hammer Redis (``--interval 0`` is
    a busy loop) or that cannot work (a lease under 100 ms)."""

    name = "duration"

    def __init__(self, minimum: float = 0.0) -> None:
        self.minimum = minimum

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):  # a default, in seconds
            seconds = float(value)
        else:
            try:
                seconds = parse_seconds(str(value))
            except DurationSyntaxError as exc:
                self.fail(str(exc), param, ctx)
        if seconds < self.minimum:
            self.fail(
                f"{value!r} is too short: at least {fmt_ms(int(self.minimum * 1000))}", param, ctx
            )
        return seconds


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
