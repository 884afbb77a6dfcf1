"""Alerts: each new violation is raised once per channel, also across restarts.

A new violation (one whose key the store did not hold) is written to the store's outbox
for every enabled channel in the same transaction as the violation itself. After the
commit, each channel delivers its pending outbox rows and marks them delivered; rows
left pending by a crash are delivered at the next start. The channels:

- ``log``: one JSON line per violation on standard error (``"event": "violation"``);
- metrics: ``durable_sessions_violations_total{rule,severity}`` (see :mod:`.metrics`);
- ``webhook``: POST JSON with an ``Idempotency-Key``, bounded retries with backoff and
  jitter, dead letter after the cap (see :mod:`.webhook`);
- ``otlp``: an OpenTelemetry log record over OTLP/gRPC to a downstream endpoint (an
  OpenTelemetry Collector), with the same retries and dead letter (see :mod:`.otlp`).

``webhook`` and ``otlp`` share the outbox delivery loop of :mod:`.outbox`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from durable_sessions.violation import Violation

LOG = "log"
WEBHOOK = "webhook"
OTLP = "otlp"


def alert_payload(violation: Violation, verdict: str | None, detected_at: float) -> dict[str, Any]:
    """What every channel reports about a violation."""
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
    }


def idempotency_key(payload: dict[str, Any]) -> str:
    """``ds-alert-`` and 32 hex digits of SHA-256 over session + rule + action.

    The same violation gives the same key on every attempt, after every restart and on
    every replica, so a receiver can drop repeats. A violation without an action id
    (an unreadable line) adds its location, so that two of them stay distinct.
    """
    parts = [str(payload.get("session_id")), str(payload.get("rule")), str(payload.get("action_id"))]
    if payload.get("action_id") is None:
        parts.append(str(payload.get("key")))
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
    return "ds-alert-" + digest[:32]
