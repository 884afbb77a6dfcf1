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
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import WEBHOOK, idempotency_key
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.config import redact_url
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert, Store

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
BATCH = 100
MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one POST came to."""

    outcome: str  # "delivered", "retry" or "rejected"
    error: str | None = None
    retry_after_s: float | None = None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None  # a redirect is answered as the 3xx it is: the URL is wrong


def backoff_delay(attempts: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Wait after the ``attempts``-th failure: exponential, capped, ±50% jitter."""
    delay = min(max_s, base_s * (2 ** max(0, attempts - 1)))
    return min(max_s, delay * rng.uniform(0.5, 1.5))


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class WebhookAlerts:
    """Delivers the ``webhook`` outbox rows from a thread of its own."""

    channel = WEBHOOK

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        metrics: Metrics,
        url: str,
        *,
        max_attempts: int = 8,
        timeout_s: float = 5.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.log = log
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
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
        self._rng = rng or random.Random()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_due: float | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start delivering, beginning with what an earlier run left pending."""
        self._thread = threading.Thread(target=self._run, name="webhook-alerts", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New alerts were committed: deliver them now."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 2)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.deliver_due()
            except Exception as error:  # the store is busy or gone: try again shortly
                self.log.error(
                    "alert-delivery-failed", channel=WEBHOOK, error=f"{type(error).__name__}: {error}"
                )
                self._next_due = time.time() + 1.0
            now = time.time()
            wait = 1.0 if self._next_due is None else min(1.0, max(0.01, self._next_due - now))
            self._wake.wait(wait)
            self._wake.clear()

    # --- delivery ----------------------------------------------------------------------

    def deliver_due(self) -> int:
        """POST every alert that is due now; return how many were delivered."""
        delivered = 0
        self._next_due = None
        while not self._stopping.is_set():
            now = time.time()
            due = self.store.pending_alerts(WEBHOOK, now, limit=BATCH)
            if not due:
                break
            for alert in due:
                if self._stopping.is_set():
                    break
                delivered += self._deliver(alert)
            if len(due) < BATCH:
                break
        return delivered

    def _deliver(self, alert: Alert) -> int:
        start = time.perf_counter()
        attempt = self.post(alert)
        self.metrics.alert_delivery_duration.labels(WEBHOOK).observe(time.perf_counter() - start)
        now = time.time()
        attempts = alert.attempts + 1
        key = idempotency_key(alert.payload)
        if attempt.outcome == "delivered":
            with self.store.writer() as writer:
                writer.mark_delivered([alert.id], now)
            self.metrics.alert_deliveries.labels(WEBHOOK, "delivered").inc()
            detected = alert.payload.get("detected_at")
            if isinstance(detected, int | float):
                self.metrics.alert_latency.labels(WEBHOOK).observe(max(0.0, now - detected))
            self.log.debug("alert-delivered", channel=WEBHOOK, idempotency_key=key, attempts=attempts)
            return 1
        error = (attempt.error or "failed")[:MAX_ERROR_CHARS]
        if attempt.outcome == "retry" and attempts < self.max_attempts:
            delay = backoff_delay(attempts, self.backoff_s, self.max_backoff_s, self._rng)
            if attempt.retry_after_s is not None:
                delay = min(self.max_backoff_s, max(delay, attempt.retry_after_s))
            retry_at = now + delay
            with self.store.writer() as writer:
                writer.mark_failed(alert.id, error, retry_at)
            self._next_due = retry_at if self._next_due is None else min(self._next_due, retry_at)
            self.metrics.alert_deliveries.labels(WEBHOOK, "retry").inc()
            self.log.warning(
                "alert-delivery-retry",
                channel=WEBHOOK,
                url=self.shown_url,
                idempotency_key=key,
                attempt=attempts,
                max_attempts=self.max_attempts,
                retry_in_s=round(delay, 3),
                error=error,
            )
            return 0
        with self.store.writer() as writer:
            writer.mark_failed(alert.id, error, None)
        self.metrics.alert_deliveries.labels(WEBHOOK, "dead_letter").inc()
        self.log.error(
            "alert-dead-letter",
            channel=WEBHOOK,
            url=self.shown_url,
            idempotency_key=key,
            violation_key=alert.violation_key,
            attempts=attempts,
            error=error,
            reason="rejected by the receiver" if attempt.outcome == "rejected" else "attempts exhausted",
        )
        return 0

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
