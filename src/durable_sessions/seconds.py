"""Durations in seconds, as the CLI's flags, the span processor's settings and the
sidecar's configuration take them: a finite number above 0 (or 0 too, where 0 turns
something off), of at most :data:`MAX_SECONDS`. One validator, so that
``durable-sessions check --key-window-s``, ``DurabilitySpanProcessor(key_window_s=...)``
and the sidecar's ``evaluation.key_window_s`` accept the same values.

It raises :class:`SecondsError`, whose message is the reason alone, to follow the name
and value as the caller shows them (``key_window_s=inf must be a positive number of
seconds``); a caller with wording of its own (the sidecar's ``expected a positive
number, got …``) words it by the error's :attr:`~SecondsError.kind`."""

from __future__ import annotations

import math
import numbers

MAX_SECONDS = 1e9
"""Longest duration, about 31 years. A thread cannot wait much longer
(``threading.TIMEOUT_MAX``, about 292 years): the sidecar's ``pipeline.ack_timeout_s:
1e12``, meant as "never", was accepted and then failed every Export with an
``OverflowError``."""

NOT_A_NUMBER = "is not a number"
NOT_POSITIVE = "must be a positive number of seconds"
NEGATIVE = "must be a number of seconds, 0 or more"
TOO_LONG = f"must be at most {MAX_SECONDS:.0f} seconds (about 31 years)"


class SecondsError(ValueError):
    """Why a value is not a duration: its message is one of the reasons above, its
    :attr:`kind` one of ``not-a-number``, ``not-finite``, ``out-of-range`` (0 or below
    where 0 is not allowed, below 0 where it is) and ``too-long``."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def positive_seconds(value: object, *, zero: bool = False) -> float:
    """``value`` as a float when it is a real number (not a bool), finite, above 0 (or 0,
    with ``zero``) and at most :data:`MAX_SECONDS`; otherwise :class:`SecondsError`."""
    low = NEGATIVE if zero else NOT_POSITIVE
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SecondsError("not-a-number", NOT_A_NUMBER)
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range: its sign says which end
        if value > 0:
            raise SecondsError("too-long", TOO_LONG) from None
        raise SecondsError("out-of-range", low) from None
    if math.isnan(number) or math.isinf(number):
        raise SecondsError("not-finite", low)
    if number < 0 or (number == 0 and not zero):
        raise SecondsError("out-of-range", low)
    if number > MAX_SECONDS:
        raise SecondsError("too-long", TOO_LONG)
    return number


def positive_seconds_from_text(text: str, *, zero: bool = False) -> float:
    """:func:`positive_seconds` of a flag's, an environment variable's or a configuration
    file's text, in ASCII (``float`` reads other scripts' digits, ``١٠`` or ``６４``, which
    no other tool does; ``1e400`` and ``inf`` parse as infinite, and are refused as such)."""
    try:
        number = float(text) if text.isascii() else None
    except ValueError:
        number = None
    if number is None:
        raise SecondsError("not-a-number", NOT_A_NUMBER)
    return positive_seconds(number, zero=zero)
