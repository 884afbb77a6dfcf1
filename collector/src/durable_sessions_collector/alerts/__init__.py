"""Alerts: each new violation is raised once per channel, also across restarts.

A new violation (one whose key the store did not hold) is written to the store's outbox
for every enabled channel in the same transaction as the violation itself. After the
commit, each channel delivers its pending outbox rows and marks them delivered; rows
left pending by a crash are delivered at the next start. The channels:

- ``log``: one JSON line per violation on standard error (``"event": "violation"``;
  ``"violation-resolved"`` for a resolution, below);
- metrics: ``durable_sessions_violations_total{rule,severity}`` (see :mod:`.metrics`);
- ``webhook``: POST JSON with an ``Idempotency-Key``, bounded retries with backoff and
  jitter, dead letter after the cap (see :mod:`.webhook`);
- ``otlp``: an OpenTelemetry log record over OTLP/gRPC to a downstream endpoint (an
  OpenTelemetry Collector), with the same retries and dead letter (see :mod:`.otlp`).

``webhook`` and ``otlp`` share the outbox delivery loop of :mod:`.outbox`.

An end-of-session violation can change its status later (see
:meth:`~durable_sessions_collector.store.base.Writer.resolve_end_violations`): spans that
settle it make the session's next end mark it resolved, and if a later end finds it
again it holds once more. Each such change is raised like a new violation, once per
channel, from rows written in the transaction that makes it: ``"status": "resolved"``,
or ``"firing"`` again. A change is named by its status and the time it was found
(:func:`change_payload`), so that each has an outbox row and an ``Idempotency-Key`` of
its own, however often the violation comes and goes.
"""

from __future__ import annotations

import hashlib
from typing import Any

from durable_sessions.violation import Violation

LOG = "log"
WEBHOOK = "webhook"
OTLP = "otlp"

FIRING = "firing"
RESOLVED = "resolved"
"""The ``status`` of an alert: the violation holds, or later spans settled it."""

VIOLATION_FIELDS = ("key", "rule", "severity", "session_id", "action_id", "trace_id", "span_id", "message")
"""The fields of an alert that describe its violation (as a stored violation names them)."""


def alert_payload(violation: Violation, verdict: str | None, detected_at: float) -> dict[str, Any]:
    """What every channel reports about a new violation."""
    return {
        "key": violation.key,
        "rule": violation.rule,
        "severity": violation.severity.value,
        "session_id": violation.session_id,
        "action_id": violation.action_id,
        "trace_id": violation.trace_id,
        "span_id": violation.span_id,
        "message": violation.message,
        "session_verdict": verdict,
        "detected_at": detected_at,
        "status": FIRING,
    }


def change_payload(
    violation: dict[str, Any], status: str, verdict: str | None, detected_at: float
) -> dict[str, Any]:
    """What every channel reports when a stored violation (its :data:`VIOLATION_FIELDS`)
    changes to ``status`` at ``detected_at``, the session's verdict being ``verdict`` after it.

    ``transition`` (the status and ``detected_at`` in whole microseconds) sets the alert
    apart from the violation's first alert and from its other changes: it is part of its
    outbox key (:func:`outbox_key`) and of its ``Idempotency-Key``. A violation changes
    status at most once per end of its session, and two ends are apart by at least a
    span's arrival and ``idle_s``: no two of its changes share a time."""
    return {
        **{name: violation.get(name) for name in VIOLATION_FIELDS},
        "session_verdict": verdict,
        "detected_at": detected_at,
        "status": status,
        "transition": f"{status}:{round(detected_at * 1_000_000)}",
    }


def outbox_key(payload: dict[str, Any]) -> str:
    """The key of an alert's outbox rows (unique per channel): its violation's key, and
    for a change of status (:func:`change_payload`) the change."""
    transition = payload.get("transition")
    return str(payload.get("key")) + (f":{transition}" if transition else "")


def idempotency_key(payload: dict[str, Any]) -> str:
    """``ds-alert-`` and 32 hex digits of SHA-256 over session + rule + action.

    The same violation gives the same key on every attempt, after every restart and on
    every replica, so a receiver can drop repeats. A violation without an action id
    (an unreadable line) adds its location, so that two of them stay distinct. A change
    of status (:func:`change_payload`) adds ``:`` and the change, e.g.
    ``ds-alert-…:resolved:1767225600123456``: a receiver drops repeats of each change,
    not the change as a repeat of the first alert.
    """
    parts = [str(payload.get("session_id")), str(payload.get("rule")), str(payload.get("action_id"))]
    if payload.get("action_id") is None:
        parts.append(str(payload.get("key")))
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
    transition = payload.get("transition")
    return "ds-alert-" + digest[:32] + (f":{transition}" if transition else "")
