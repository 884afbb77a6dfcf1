"""Durations in seconds, as the CLI's flags and the span processor's settings take them:
a finite number above 0. One validator, so that ``durable-sessions check --key-window-s``
and ``DurabilitySpanProcessor(key_window_s=...)`` accept the same values."""

from __future__ import annotations

import math
import numbers

NOT_A_NUMBER = "is not a number"
NOT_POSITIVE = "must be a positive number of seconds"


def positive_seconds(value: object) -> float:
    """``value`` as a float when it is a real number (not a bool), finite and above 0.
    Otherwise a :class:`ValueError` whose message is the reason alone, to follow the name
    and value as the caller shows them (``key_window_s=inf must be a positive number of
    seconds``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(NOT_A_NUMBER)
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        raise ValueError(NOT_POSITIVE) from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(NOT_POSITIVE)
    return number


def positive_seconds_from_text(text: str) -> float:
    """:func:`positive_seconds` of a flag's or an environment variable's text (``1e400``
    and ``inf`` parse as infinite, and are refused as such)."""
    try:
        number = float(text)
    except ValueError:
        raise ValueError(NOT_A_NUMBER) from None
    return positive_seconds(number)
