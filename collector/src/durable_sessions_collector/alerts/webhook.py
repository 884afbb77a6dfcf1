"""The ``webhook`` alert channel: POST each new violation as JSON, at least once.

Rows come from the store's outbox (written in the same transaction as the violation),
so an alert survives a crash or a restart and is delivered once it can be. Each alert
is POSTed to ``alerts.webhook.url`` with:

- ``Content-Type: application/json``; the body is the alert (session, rule, severity,
  action, message, the session's verdict, trace and span ids, detection time) — never
  a result or a prompt, which the sidecar does not even store;
- ``Idempotency-Key``: derived from session + rule + action only (:func:`idempotency_key`),
  the same on every attempt and after every restart, so a receiver can drop a repeat
  (a crash between a successful POST and marking it delivered sends it again);
- ``Authorization: Basic …`` when the URL has ``user:password@`` (removed from the URL).

A 2xx answer delivers the alert. A connection error, a timeout, 5xx, 408, 409, 425 or
429 is retried after ``backoff_s · 2^(attempt-1)`` (capped by ``max_backoff_s``, with
±50% jitter so that many sidecars do not retry in step; a ``Retry-After`` is honoured up
to the cap). Any other answer (a 4xx the receiver will give again, or a redirect) and
the ``max_attempts``-th failure move the alert to the dead letter: it stays in the
outbox with state ``dead`` and its last error, and is never sent again.

Metrics: ``durable_sessions_alert_deliveries_total{channel="webhook",outcome}``
(``delivered``, ``retry``, ``dead_letter``),
``durable_sessions_alert_outbox{channel="webhook",state}`` (``pending``, ``delivered``,
``dead``, read from the store), ``durable_sessions_alert_delivery_duration_seconds``
(one POST) and ``durable_sessions_alert_latency_seconds`` (detection to delivery).

The outbox loop (retries, backoff, dead letter, metrics) is :class:`.outbox.OutboxDelivery`,
shared with the ``otlp`` channel; this module says how one POST is made and judged.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import WEBHOOK, idempotency_key
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.alerts.outbox import (
    DEFAULT_POLICY,
    Attempt,
    DeliveryPolicy,
    OutboxDelivery,
    backoff_delay,
)
from durable_sessions_collector.config import redact_url
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert, Store

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
__all__ = ["Attempt", "WebhookAlerts", "backoff_delay", "idempotency_key"]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None  # a redirect is answered as the 3xx it is: the URL is wrong


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²".isdigit() is true, and float() refuses it
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class WebhookAlerts(OutboxDelivery):
    """Delivers the ``webhook`` outbox rows from a thread of its own."""

    channel = WEBHOOK
    thread_name = "webhook-alerts"

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        metrics: Metrics,
        url: str,
        *,
        policy: DeliveryPolicy = DEFAULT_POLICY,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(store, log, metrics, policy, rng=rng)
        self.shown_url = redact_url(url)
        parts = urlsplit(url)
        self._headers = {
            "Content-Type": "application/json",
            "User-Agent": f"durable-sessions-collector/{__version__}",
        }
        if parts.username is not None or parts.password is not None:
            credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self._headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
            host = parts.hostname or ""
            netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
            url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        self._url = url
        self._opener = urllib.request.build_opener(_NoRedirect())

    def send(self, alert: Alert) -> Attempt:
        return self.post(alert)

    def target(self) -> dict[str, Any]:
        return {"url": self.shown_url}

    def body(self, alert: Alert) -> dict[str, Any]:
        """The JSON document POSTed for ``alert``: the same on every attempt."""
        payload = alert.payload
        return {
            "event": "durable_sessions.violation",
            "idempotency_key": idempotency_key(payload),
            "session_id": payload.get("session_id"),
            "rule": payload.get("rule"),
            "severity": payload.get("severity"),
            "action_id": payload.get("action_id"),
            "message": payload.get("message"),
            "session_verdict": payload.get("session_verdict"),
            "trace_id": payload.get("trace_id"),
            "span_id": payload.get("span_id"),
            "violation_key": payload.get("key"),
            "detected_at": payload.get("detected_at"),
        }

    def post(self, alert: Alert) -> Attempt:
        """One POST of ``alert``."""
        data = json.dumps(self.body(alert), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        headers = dict(self._headers)
        headers["Idempotency-Key"] = idempotency_key(alert.payload)
        request = urllib.request.Request(self._url, data=data, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                response.read(64 * 1024)
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
            retry_after = _retry_after(error.headers.get("Retry-After") if error.headers else None)
            error.close()
            if status >= 500 or status in RETRYABLE_STATUS:
                return Attempt("retry", f"HTTP {status}", retry_after)
            return Attempt("rejected", f"HTTP {status}")
        except urllib.error.URLError as error:
            return Attempt("retry", f"cannot connect: {error.reason}")
        except (OSError, http.client.HTTPException) as error:
            return Attempt(
                "retry", f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            )
        if 200 <= status < 300:
            return Attempt("delivered")
        return Attempt("rejected", f"HTTP {status}")
