"""The ``otlp`` alert channel: each new violation as an OpenTelemetry log record.

With ``alerts.otlp.endpoint`` set, every new violation is sent over OTLP/gRPC
(``opentelemetry.proto.collector.logs.v1.LogsService/Export``) to a downstream
endpoint, typically an OpenTelemetry Collector, which can route it to any logs backend.
One Export carries one log record:

- resource ``service.name=durable-sessions-collector`` (and ``service.version``), scope
  ``durable_sessions_collector``;
- ``severity_number``/``severity_text``: ``ERROR`` for an ``error`` violation (the session
  is unrecoverable), ``WARN`` for a ``warning`` (at risk), ``INFO`` for a resolution (an
  end-of-session violation that later spans settled);
- ``body``: the violation's message (``resolved: `` and the message for a resolution);
  ``event_name``: ``durable_sessions.violation``;
- attributes ``session.id``, ``durable_sessions.rule``, ``durable_sessions.severity``,
  ``agent.action.id``, ``durable_sessions.verdict`` (the session's verdict),
  ``durable_sessions.violation.key``, ``durable_sessions.alert.status`` (``firing`` or
  ``resolved``) and ``durable_sessions.alert.idempotency_key`` (the webhook's
  ``Idempotency-Key``: the same on every attempt, restart and replica);
- ``trace_id``/``span_id`` of the violating span when known, so that a backend links the
  alert to its trace; ``time_unix_nano`` and ``observed_time_unix_nano``: detection time.

Never a result or a prompt: the sidecar stores only their digests. Each attempt sends
the same bytes.

Why the request is built here, with ``opentelemetry.proto`` and ``grpc``, rather than
with the SDK's ``OTLPLogExporter`` and ``opentelemetry.sdk._logs`` records: the outbox
must know, for each alert, whether *that* alert was delivered, was refused for good, or
should be tried again later — and it owns the retry schedule, which survives restarts.
``OTLPLogExporter.export`` answers only SUCCESS or FAILURE for a whole batch, retries
internally with its own backoff for up to its timeout (blocking the delivery thread,
and doubling our bounded ``max_attempts``), and hides the gRPC status that tells a
retryable failure (``UNAVAILABLE``) from a permanent one (``INVALID_ARGUMENT``,
``UNAUTHENTICATED``), and a partial success's rejected count. The SDK's logs API is also
still private (``_logs``), and the SDK and exporters are not run-time dependencies of the
sidecar (``opentelemetry-proto`` and ``grpcio`` are). One gRPC call per alert gives an
exact answer per alert; alerts are few, so batching would buy little.

What an answer means (OTLP specification, "Failures" for gRPC): ``OK`` delivers, unless
``partial_success.rejected_log_records`` says the record was rejected (dead letter:
the receiver would reject it again). ``CANCELLED``, ``DEADLINE_EXCEEDED``, ``ABORTED``,
``OUT_OF_RANGE``, ``UNAVAILABLE``, ``DATA_LOSS`` — and ``RESOURCE_EXHAUSTED`` when the
receiver sends ``RetryInfo`` — are retried (a ``RetryInfo`` delay is honoured up to
``max_backoff_s``); any other status dead-letters the alert at once. ``UNAVAILABLE``,
``DEADLINE_EXCEEDED`` and ``RESOURCE_EXHAUSTED`` are the receiver's, not the alert's:
the channel pauses until that retry (:mod:`.outbox`). Retries, backoff,
dead letter and metrics are :class:`.outbox.OutboxDelivery`'s, as for the webhook.

TLS follows the SDK's ``OTLPLogExporter``: ``https://`` is always TLS; otherwise
``alerts.otlp.insecure`` decides, and when it is unset ``http://`` is plaintext (as in
the SDK) and a bare ``host:port`` is plaintext on loopback, TLS elsewhere. TLS verifies
the server against the system CAs (gRPC's ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` points
it at other roots).
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.proto.resource.v1 import resource_pb2

from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import FIRING, OTLP, RESOLVED, idempotency_key
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.alerts.outbox import DEFAULT_POLICY, Attempt, DeliveryPolicy, OutboxDelivery
from durable_sessions_collector.config import is_loopback
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert, Store

SERVICE_NAME = "durable-sessions-collector"
SCOPE_NAME = "durable_sessions_collector"
EVENT_NAME = "durable_sessions.violation"

INFO = (logs_pb2.SEVERITY_NUMBER_INFO, "INFO")
"""A resolution's severity, and an unknown one's."""
SEVERITIES = {
    "error": (logs_pb2.SEVERITY_NUMBER_ERROR, "ERROR"),
    "warning": (logs_pb2.SEVERITY_NUMBER_WARN, "WARN"),
}
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
UNAVAILABLE_CODES = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
"""Answers about the receiver, not the alert: the channel pauses (see :mod:`.outbox`)."""
ATTRIBUTES = (  # log record attribute <- alert payload field
    ("session.id", "session_id"),
    ("durable_sessions.rule", "rule"),
    ("durable_sessions.severity", "severity"),
    ("agent.action.id", "action_id"),
    ("durable_sessions.verdict", "session_verdict"),
    ("durable_sessions.violation.key", "key"),
)


def grpc_target(endpoint: str, insecure: bool | None) -> tuple[str, bool]:
    """The gRPC target of ``alerts.otlp.endpoint`` and whether to use TLS (see module docs)."""
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme == "https":
            return parts.netloc, True
        return parts.netloc, insecure is False
    if insecure is None:
        return endpoint, not is_loopback(endpoint)
    return endpoint, not insecure


def _id(value: Any, length: int) -> bytes:
    """A hex trace or span id as bytes; empty when unknown or not a valid id."""
    if not isinstance(value, str) or len(value) != 2 * length:
        return b""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return b""
    return b"" if raw == bytes(length) else raw


def log_record(payload: dict[str, Any]) -> logs_pb2.LogRecord:
    """The log record of one alert (its outbox payload)."""
    status = payload.get("status") or FIRING  # an alert queued before statuses fired
    # A resolution is news, not a problem: INFO whatever the violation's severity.
    severity = SEVERITIES.get(str(payload.get("severity") or ""), INFO)
    number, text = INFO if status == RESOLVED else severity
    detected = payload.get("detected_at")
    at = int(detected * 1e9) if isinstance(detected, int | float) and detected > 0 else 0
    attributes = [
        common_pb2.KeyValue(key=name, value=common_pb2.AnyValue(string_value=str(payload[field])))
        for name, field in ATTRIBUTES
        if payload.get(field) is not None
    ]
    for name, value in (
        ("durable_sessions.alert.status", str(status)),
        ("durable_sessions.alert.idempotency_key", idempotency_key(payload)),
    ):
        attributes.append(common_pb2.KeyValue(key=name, value=common_pb2.AnyValue(string_value=value)))
    message = str(payload.get("message") or "")
    record = logs_pb2.LogRecord(
        time_unix_nano=at,
        observed_time_unix_nano=at,
        severity_number=number,
        severity_text=text,
        body=common_pb2.AnyValue(string_value=f"resolved: {message}" if status == RESOLVED else message),
        attributes=attributes,
        trace_id=_id(payload.get("trace_id"), 16),
        span_id=_id(payload.get("span_id"), 8),
    )
    if "event_name" in logs_pb2.LogRecord.DESCRIPTOR.fields_by_name:  # opentelemetry-proto >= 1.32
        record.event_name = EVENT_NAME
    return record


def export_request(payload: dict[str, Any]) -> logs_service_pb2.ExportLogsServiceRequest:
    """One ``ExportLogsServiceRequest`` holding the log record of one alert."""
    resource = resource_pb2.Resource(
        attributes=[
            common_pb2.KeyValue(key="service.name", value=common_pb2.AnyValue(string_value=SERVICE_NAME)),
            common_pb2.KeyValue(key="service.version", value=common_pb2.AnyValue(string_value=__version__)),
        ]
    )
    scope = common_pb2.InstrumentationScope(name=SCOPE_NAME, version=__version__)
    return logs_service_pb2.ExportLogsServiceRequest(
        resource_logs=[
            logs_pb2.ResourceLogs(
                resource=resource,
                scope_logs=[logs_pb2.ScopeLogs(scope=scope, log_records=[log_record(payload)])],
            )
        ]
    )


def _retry_delay(error: grpc.RpcError) -> float | None:
    """The ``RetryInfo`` delay of a failed call: in ``grpc-status-details-bin`` (the
    standard place) or ``google.rpc.retryinfo-bin`` (where the Python SDK looks)."""
    infos: list[error_details_pb2.RetryInfo] = []
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except Exception:  # a malformed or inconsistent status: ignore its details
        status = None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            infos.append(info)
    try:
        trailing = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
        raw = trailing.get("google.rpc.retryinfo-bin")
        if isinstance(raw, bytes):
            infos.append(error_details_pb2.RetryInfo.FromString(raw))
    except Exception:
        pass
    for info in infos:
        if info.HasField("retry_delay"):
            return max(0.0, info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return None


class OtlpAlerts(OutboxDelivery):
    """Delivers the ``otlp`` outbox rows as OTLP log records, from a thread of its own."""

    channel = OTLP
    thread_name = "otlp-alerts"

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        metrics: Metrics,
        endpoint: str,
        *,
        insecure: bool | None = None,
        headers: tuple[tuple[str, str], ...] | None = None,
        policy: DeliveryPolicy = DEFAULT_POLICY,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(store, log, metrics, policy, rng=rng)
        self.endpoint = endpoint
        self.address, self.tls = grpc_target(endpoint, insecure)
        self._metadata = tuple(headers or ())
        self._channel: grpc.Channel | None = None
        self._stub: logs_service_pb2_grpc.LogsServiceStub | None = None

    def target(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint}

    def start(self) -> None:
        if not self.tls and not is_loopback(self.address):
            self.log.warning(
                "not-loopback",
                key="alerts.otlp.endpoint",
                endpoint=self.endpoint,
                note="alerts are sent in plaintext to another host; use https:// or alerts.otlp.insecure: false",
            )
        super().start()

    def _client(self) -> logs_service_pb2_grpc.LogsServiceStub:
        if self._stub is None:
            options = [("grpc.primary_user_agent", f"durable-sessions-collector/{__version__}")]
            if self.tls:
                channel = grpc.secure_channel(self.address, grpc.ssl_channel_credentials(), options=options)
            else:
                channel = grpc.insecure_channel(self.address, options=options)
            self._channel, self._stub = channel, logs_service_pb2_grpc.LogsServiceStub(channel)
        return self._stub

    def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def send(self, alert: Alert) -> Attempt:
        """One ``LogsService/Export`` of ``alert``'s log record."""
        request = export_request(alert.payload)
        try:
            response = self._client().Export(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            details = error.details()  # type: ignore[attr-defined]
            text = f"{code.name}: {details}" if details else code.name
            if code is grpc.StatusCode.UNAVAILABLE:
                self.close()  # connect afresh next time, without waiting out gRPC's reconnect backoff
            delay = _retry_delay(error)
            if code in RETRYABLE_CODES or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None):
                return Attempt("retry", text, delay, code in UNAVAILABLE_CODES)
            return Attempt("rejected", text)
        except ValueError as error:  # e.g. metadata gRPC refuses to send
            return Attempt("rejected", f"{type(error).__name__}: {error}")
        partial = response.partial_success
        if partial.rejected_log_records > 0:
            return Attempt(
                "rejected", f"rejected by the receiver: {partial.error_message or 'no reason given'}"
            )
        return Attempt("delivered")
