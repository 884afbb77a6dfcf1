"""Payments whose spans have OTLP's unset start time (``start_time=0``), for the tests
that hold every front end (the span processor, ``durable-sessions check``, the sidecar)
to dating such a span by its end."""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode, Tracer

from durable_sessions import semconv as sc

T0 = 1_767_225_600 * 10**9
"""2026-01-01T00:00:00Z, in ns."""
DAY = 86_400 * 10**9

EXPECTED = [("s-a", "invalid-field"), ("s-b", "invalid-field"), ("s-b", "key-outlived-window")]
"""What :func:`end_undated_payments` makes every front end find, by (session, rule): each
missing start reported, and the retry two days on past the key's window."""


def end_undated_payments(tracer: Tracer) -> None:
    """Two sessions, each a keyed payment and its retry. In ``s-a`` the first try has no
    start time and the retry comes 10 s after it ended (dated 1970, the key's first use
    was decades before: a false key-outlived-window); in ``s-b`` the retry has none and
    ended two days on (dated 1970, it was re-sent before its first use: no warning)."""
    _payment(tracer, "s-a", 0, T0, 1)
    _payment(tracer, "s-a", T0 + 10 * 10**9, T0 + 11 * 10**9, 2)
    _payment(tracer, "s-b", T0, T0 + 10**9, 1)
    _payment(tracer, "s-b", 0, T0 + 2 * DAY, 2)


def _payment(tracer: Tracer, session_id: str, start: int, end: int, attempt: int) -> None:
    attributes = {
        sc.SESSION_ID: session_id,
        sc.ACTION_ID: "p1",
        sc.ACTION_KIND: "payment",
        sc.attribute("idempotency_key"): f"pay-{session_id}-p1",
        sc.attribute("retryable"): True,
        sc.attribute("max_attempts"): 3,
        sc.attribute("attempts"): attempt,
    }
    span = tracer.start_span("pay", attributes=attributes, start_time=start)
    if attempt == 1:
        span.set_status(Status(StatusCode.ERROR))
    span.end(end_time=end)
