"""Alerts: each new violation is raised once per channel, also across restarts.

A new violation (one whose key the store did not hold) is written to the store's outbox
for every enabled channel in the same transaction as the violation itself. After the
commit, each channel delivers its pending outbox rows and marks them delivered; rows
left pending by a crash are delivered at the next start. The channels:

- ``log``: one JSON line per violation on standard error (``"event": "violation"``);
- metrics: ``durable_sessions_violations_total{rule,severity}`` (see :mod:`.metrics`);
- ``webhook`` (to come): POST JSON with an ``Idempotency-Key``, bounded retries with
  backoff, dead letter after the cap — its rows are already queued in the outbox.
"""

from __future__ import annotations

from typing import Any

from durable_sessions.violation import Violation

LOG = "log"
WEBHOOK = "webhook"


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
    """Stable per session + rule + action (+ span): the same alert always has the same key."""
    return str(payload["key"])
