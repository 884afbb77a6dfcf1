"""Real OpenTelemetry SDK clients for the sidecar: gRPC, HTTP protobuf, HTTP JSON.

The OpenTelemetry Python SDK ships no OTLP/JSON exporter, so :class:`OtlpJsonExporter`
builds the request with the SDK's own encoder and writes it as OTLP/JSON the way the
specification says (lowerCamelCase keys, integer enums, hex ids) — the id conversion is
done here, independently of the sidecar's code, so a shared mistake cannot hide.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode, Tracer

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def any_value(python_value: Any) -> AnyValue:
    """An OTLP ``AnyValue`` holding ``python_value`` (a tuple becomes an array value)."""
    if isinstance(python_value, tuple):
        return AnyValue(array_value=ArrayValue(values=[any_value(item) for item in python_value]))
    if isinstance(python_value, bool):
        return AnyValue(bool_value=python_value)
    if isinstance(python_value, int):
        return AnyValue(int_value=python_value)
    if isinstance(python_value, float):
        return AnyValue(double_value=python_value)
    if isinstance(python_value, bytes):
        return AnyValue(bytes_value=python_value)
    return AnyValue(string_value=python_value)


EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def one_action_export(n: int, session: str, kind: str = "tool_call") -> bytes:
    """A serialized Export request of one action span; ``n`` (< 65536) makes its ids unique."""
    attributes = {"session.id": session, "agent.action.id": f"a{n}", "agent.action.kind": kind}
    span = Span(
        trace_id=bytes([3] * 14) + n.to_bytes(2, "big"),
        span_id=bytes([4] * 6) + n.to_bytes(2, "big"),
        name=f"action {n}",
        start_time_unix_nano=1_700_000_000_000_000_000 + n,
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
    )
    return request_of(span).SerializeToString()


def request_of(*spans: Span) -> ExportTraceServiceRequest:
    """An Export request of ``spans``, under one resource and one scope."""
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])


def export_call(channel: grpc.Channel) -> Any:
    """TraceService/Export on ``channel``, sending raw request bytes."""
    return channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)


def retry_delay(error: grpc.RpcError) -> float | None:
    """The delay an error's ``RetryInfo`` asks for, as the Python SDK reads it; None without one."""
    for key, value in error.trailing_metadata() or ():
        if key == "google.rpc.retryinfo-bin":
            return error_details_pb2.RetryInfo.FromString(value).retry_delay.ToTimedelta().total_seconds()
    return None


def one_action_spans(session_id: str) -> list[ReadableSpan]:
    """One finished SDK span of one action in ``session_id``, for an exporter to send."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "inc-1"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    attributes = {"session.id": session_id, "agent.action.id": "a1", "agent.action.kind": "tool_call"}
    provider.get_tracer("t").start_span("step", attributes=attributes).end()
    return list(memory.get_finished_spans())


def otlp_json(spans: Sequence[ReadableSpan]) -> bytes:
    """The SDK's encoding of ``spans`` as OTLP/JSON bytes."""
    document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource in document.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for node in (span, *span.get("links", [])):
                    for name in ID_FIELDS:
                        if name in node:
                            node[name] = base64.b64decode(node[name]).hex()
    return json.dumps(document).encode()


class OtlpJsonExporter(SpanExporter):
    """POSTs OTLP/JSON to ``/v1/traces``; keeps each response document."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.responses: list[dict[str, Any]] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        request = urllib.request.Request(
            self.endpoint, data=otlp_json(spans), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                self.responses.append(json.loads(response.read()))
                assert response.headers["Content-Type"] == "application/json"
                return SpanExportResult.SUCCESS
        except urllib.error.URLError:
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


def grpc_exporter(endpoint: str, **options: Any) -> GrpcExporter:
    return GrpcExporter(endpoint=endpoint, insecure=True, **options)


def http_exporter(base_url: str, **options: Any) -> HttpExporter:
    return HttpExporter(endpoint=base_url + "/v1/traces", **options)


class Recorder(SpanExporter):
    """Exports to the sidecar over OTLP/gRPC and keeps the spans, to deliver them again or
    read their ids."""

    def __init__(self, endpoint: str) -> None:
        self.exporter = grpc_exporter(endpoint)
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return self.exporter.export(spans)

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def ids(self, action_id: str) -> tuple[bytes, bytes]:
        """(trace id, span id) of the last span of ``action_id``, as OTLP carries them."""
        [*_, span] = [s for s in self.spans if s.attributes.get("agent.action.id") == action_id]
        return span.context.trace_id.to_bytes(16, "big"), span.context.span_id.to_bytes(8, "big")


class Agent:
    """One process incarnation of an agent: a TracerProvider exporting synchronously."""

    def __init__(self, exporter: SpanExporter, instance_id: str, service: str = "agent") -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service, "service.instance.id": instance_id})
        )
        self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer("durable-sessions-tests")

    def action(
        self, session_id: str, action_id: str, kind: str, *, error: bool = False, **fields: Any
    ) -> None:
        """Emit one action span (exported, and so committed, when this returns)."""
        attributes = {"session.id": session_id, "agent.action.id": action_id, "agent.action.kind": kind}
        attributes.update({f"agent.action.{name}": value for name, value in fields.items()})
        with self.tracer.start_as_current_span(f"{kind} {action_id}", attributes=attributes) as span:
            if error:
                span.set_status(Status(StatusCode.ERROR))

    def trace(self, name: str = "turn"):  # type: ignore[no-untyped-def]
        """A new trace (a root span that is not an action)."""
        return self.tracer.start_as_current_span(name, context=Context())

    def shutdown(self) -> None:
        self.provider.shutdown()


def recorded_agent(endpoint: str, instance_id: str = "inc-1") -> Agent:
    """An :class:`Agent` exporting to ``endpoint`` through a :class:`Recorder`, kept as its
    ``recorder``."""
    recorder = Recorder(endpoint)
    agent = Agent(recorder, instance_id)
    agent.recorder = recorder  # type: ignore[attr-defined]
    return agent
