"""What both OTLP receivers do with a decoded request's spans: map, queue, wait for the commit."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from durable_sessions.digest import digest_value
from durable_sessions.mapping import Mapped, map_attributes
from durable_sessions.record import span_location
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.evaluator import Arrival, arrival
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.otlp.budget import DecodingBudget, DecodingRefused
from durable_sessions_collector.otlp.decode import (
    MAX_NAMED_REJECTIONS,
    SpanParts,
    json_span_parts,
    reference_span_parts,
    wire_span_parts,
)
from durable_sessions_collector.pipeline import Job, Overloaded, Pipeline, Unavailable

MAX_MESSAGE_CHARS = 4000


@dataclass(slots=True)
class Outcome:
    """What became of an Export request's spans."""

    total: int
    rejected: list[str]
    stored: int = 0
    duplicates: int = 0
    not_actions: int = 0

    def response(self) -> ExportTraceServiceResponse:
        """The OTLP response: ``partial_success`` only when spans were rejected."""
        response = ExportTraceServiceResponse()
        if self.rejected:
            response.partial_success.rejected_spans = len(self.rejected)
            response.partial_success.error_message = rejection_message(self.rejected, self.total)
        return response


def rpc_status(
    code: int, message: str, *, retry_after_s: float | None = None, bad_request: bool = False
) -> status_pb2.Status:
    """The ``google.rpc.Status`` both receivers answer an error with: ``RetryInfo`` when
    the client should retry after a delay; a ``BadRequest`` when the request's data is
    bad, as the OTLP specification says its details SHOULD carry."""
    status = status_pb2.Status(code=code, message=message)
    if retry_after_s is not None:
        status.details.add().Pack(retry_info(retry_after_s))
    if bad_request:
        violation = error_details_pb2.BadRequest.FieldViolation(field="request", description=message)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return status


def spread_retry(retry_after_s: float) -> float:
    """The delay a refused client is told: between ``retry_after_s`` and twice that, at
    random. Clients refused together (a Collector's queue consumers, the SDK exporters of
    many processes) honour the delay exactly, without jitter of their own: told the same
    delay, they would all come back at the same instant, find the queue full again, and
    run out of attempts in lockstep."""
    return retry_after_s * random.uniform(1.0, 2.0)


def retry_info(retry_after_s: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration(seconds=int(retry_after_s), nanos=int((retry_after_s % 1) * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def rejection_message(rejected: list[str], total: int) -> str:
    """``rejected 2 of 5 spans: <which and why>; …`` — short enough for a log line."""
    named = rejected[:MAX_NAMED_REJECTIONS]
    text = f"rejected {len(rejected)} of {total} span(s): " + "; ".join(named)
    if len(rejected) > len(named):
        text += f"; and {len(rejected) - len(named)} more"
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 1] + "…"
    return text


class TraceReceiver:
    """Decodes an Export request within the decoding budget, and turns its spans into
    committed action records."""

    def __init__(
        self,
        pipeline: Pipeline,
        metrics: Metrics,
        log: JsonLog,
        budget: DecodingBudget,
        *,
        attribute_value_limit: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.log = log
        self.budget = budget
        self.attribute_value_limit = attribute_value_limit

    def decode(
        self, body: bytes, rejected: list[str], transport: str, *, json: bool = False
    ) -> list[SpanParts]:
        """The parts of the spans of ``body`` (OTLP/JSON with ``json``, else binary protobuf),
        decoded while the budget holds their weight; spans with unusable ids are described
        in ``rejected``. Raise :class:`DecodingRefused` (counted) when the budget has no room
        for them now, :class:`BadData` when ``body`` is not an Export request."""
        try:
            with self.budget.reserved(len(body), json=json) as reservation:
                if json:
                    return json_span_parts(body, rejected)
                parts = wire_span_parts(body)
                if parts is None:  # declined: the reference path takes more memory
                    reservation.grow(self.budget.reference_weight(len(body)))
                    parts = reference_span_parts(body, rejected)
                return parts
        except DecodingRefused:
            self.metrics.decoding_refused.labels(transport).inc()
            raise

    def export(self, spans: list[SpanParts], rejected: list[str], transport: str) -> Outcome:
        """Store the actions among a request's ``spans`` (``rejected``: why its other spans
        were not decoded); raise Overloaded/Unavailable when they cannot be stored now
        (the request's spans are counted as rejected for overload)."""
        unmappable: list[str] = []
        items: list[Arrival] = []
        not_actions = 0
        limit = self.attribute_value_limit
        # The span's parts go to the mapping as they are: SpanData and map_span would
        # only wrap them, and each span's attributes the mapping does not read are skipped.
        for parts in spans:
            name, attributes, resource, status_error, start_time_ns, trace_id, span_id, end_time_ns = parts
            try:
                mapped = map_attributes(
                    attributes,
                    resource,
                    status_error,
                    start_time_ns,
                    trace_id,
                    span_id,
                    limit,
                    False,
                    end_time_ns,
                )
            except Exception as error:  # a mapping bug must not lose the rest of the request
                self.log.error(
                    "mapping-failed",
                    span_id=span_id,
                    trace_id=trace_id,
                    error=f"{type(error).__name__}: {error}",
                )
                unmappable.append(
                    f"span {span_id} {name!r} (trace {trace_id}): cannot be mapped to an action "
                    f"record ({type(error).__name__})"
                )
                continue
            if mapped is None:
                not_actions += 1
                continue
            record, mapping_problems = mapped
            scrub(record)
            items.append(arrival(Mapped(record, span_location(trace_id, span_id), mapping_problems)))
        outcome = Outcome(
            total=len(spans) + len(rejected), rejected=rejected + unmappable, not_actions=not_actions
        )
        self.metrics.spans_received.labels(transport).inc(outcome.total)
        if outcome.not_actions:
            self.metrics.spans_not_action.inc(outcome.not_actions)
        if outcome.rejected:
            self.metrics.spans_rejected.labels(transport, "invalid").inc(len(outcome.rejected))
        if items:
            job = self._stored(items, transport)
            outcome.stored, outcome.duplicates = job.stored, job.duplicates
            if job.unstorable:
                self.metrics.spans_rejected.labels(transport, "unstorable").inc(len(job.unstorable))
                outcome.rejected += job.unstorable
        return outcome

    def _stored(self, items: list[Arrival], transport: str) -> Job:
        """The committed job of ``items``. Every span of a request is counted once: the
        actions refused for now as ``overload`` (queue full) or ``unavailable`` (store
        failure, stopping), the invalid and not-action spans as such before."""
        rejected = self.metrics.spans_rejected.labels
        try:
            job = self.pipeline.submit(items, transport)
        except Overloaded:
            rejected(transport, "overload").inc(len(items))
            raise
        except Unavailable:
            rejected(transport, "unavailable").inc(len(items))
            raise
        try:
            return self.pipeline.wait(job)
        except Unavailable:
            if job.error is not None:  # not committed (after a timeout it still may be, and counts then)
                # Spans of it a store failure did not stop are committed, and counted so.
                rejected(transport, "unavailable").inc(len(items) - job.stored - job.duplicates)
            raise


def scrub(record: dict) -> None:  # type: ignore[type-arg]
    """Keep digests, never text: drop ``result`` and ``prompt``.

    ``map_attributes(..., keep_result=False)`` already leaves ``result`` out, and gives a
    ``prompt`` (the seed's field, from an ``agent.action.prompt`` attribute) its
    ``prompt_digest``; the prompt is the question put to a person and may be personal
    data, so only its digest is kept.
    """
    if "result" in record:
        value = record.pop("result")
        record.setdefault("result_digest", digest_value(value))
    record.pop("prompt", None)


def elapsed_since(start: float) -> float:
    return time.perf_counter() - start
