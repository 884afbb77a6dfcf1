"""The OTLP/HTTP receiver: ``POST /v1/traces``, binary protobuf or JSON, optionally
compressed (every coding of the Collector's ``otlphttp`` exporter: :mod:`.content_encoding`).

Answers, per the OTLP specification (the response has the request's Content-Type,
``application/protobuf`` included; error bodies are a ``google.rpc.Status``):

| situation | status | notes |
|---|---|---|
| every span accepted | 200 | ``ExportTraceServiceResponse`` with ``partial_success`` unset |
| some spans rejected | 200 | ``partial_success.rejected_spans`` and a message naming them |
| body not decodable (protobuf, JSON, its Content-Encoding) | 400 | ``Status.message`` says what and where |
| body framing invalid or ambiguous, body stalled | 400 | connection closed (``httpserver``) |
| ``Transfer-Encoding`` other than chunked | 501 | connection closed |
| body over ``max_request_bytes`` (after decompression) | 413 | decompression stops at the limit |
| ``Content-Type`` not protobuf/JSON, JSON not in UTF-8, unknown ``Content-Encoding`` or several (``identity`` is none) | 415 | |
| write queue full, decoding budget in use, store failure | 503 | ``Retry-After`` seconds, ``RetryInfo`` in the Status |
| a method other than POST | 405 | ``Allow``; the Status in JSON unless the request says protobuf |
"""

from __future__ import annotations

import time

from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2

from durable_sessions_collector.httpserver import BodyError, BodyTooLarge, Request, Response
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.otlp.budget import DecodingRefused
from durable_sessions_collector.otlp.content_encoding import ENCODINGS, TooLarge, coding_of, decompress
from durable_sessions_collector.otlp.decode import BadData, SpanParts
from durable_sessions_collector.otlp.receiver import TraceReceiver, rpc_status, spread_retry
from durable_sessions_collector.pipeline import Overloaded, Unavailable

PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
PROTOBUF_TYPES = {"application/x-protobuf", "application/protobuf"}
TRANSPORT = "http"


def _content_type(header: str) -> tuple[str, str | None]:
    """A Content-Type header's media type and ``charset`` parameter (None when absent),
    both lower-cased, the charset unquoted."""
    media_type, *parameters = header.split(";")
    charset = None
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
            break
    return media_type.strip().lower(), charset


def answer_media_type(request: Request) -> str:
    """The media type to answer ``request`` in before its body is read (401, 405, 500):
    its own when protobuf or JSON, as OTLP/HTTP wants; JSON when it names none or another,
    as the 415 for such a type is."""
    media_type = _content_type(request.header("Content-Type"))[0]
    return media_type if media_type in PROTOBUF_TYPES else JSON


def status_body(status: int, message: str, media_type: str, retry_after_s: int | None = None) -> Response:
    """A 4xx/5xx answer: a ``google.rpc.Status`` in ``media_type``, the request's. With
    ``retry_after_s``, a delay spread above it (see :func:`spread_retry`), in whole
    seconds as ``Retry-After`` takes it, in the header and in ``RetryInfo``."""
    code = {400: code_pb2.INVALID_ARGUMENT, 401: code_pb2.UNAUTHENTICATED, 405: code_pb2.UNIMPLEMENTED, 413: code_pb2.RESOURCE_EXHAUSTED,
            415: code_pb2.INVALID_ARGUMENT, 500: code_pb2.INTERNAL, 501: code_pb2.UNIMPLEMENTED,
            503: code_pb2.UNAVAILABLE}.get(status, code_pb2.UNKNOWN)  # fmt: skip
    delay = None if retry_after_s is None else round(spread_retry(retry_after_s))
    message_pb = rpc_status(code, message, retry_after_s=delay, bad_request=status == 400)
    headers = {"Retry-After": str(delay)} if delay is not None else {}
    return _encode(status, message_pb, media_type, headers)


def _encode(
    status: int, message: Message, media_type: str, headers: dict[str, str] | None = None
) -> Response:
    # OTLP/HTTP: "The server MUST use the same Content-Type in the response as it received
    # in the request"; a client that sent application/protobuf may not take x-protobuf.
    if media_type == JSON:
        body = json_format.MessageToJson(message, indent=None).encode("utf-8")
        return Response(status, body, JSON, headers or {})
    return Response(status, message.SerializeToString(), media_type, headers or {})


class HttpTraceReceiver:
    """The ``POST /v1/traces`` handler."""

    def __init__(self, receiver: TraceReceiver, *, max_request_bytes: int, log: JsonLog) -> None:
        self.receiver = receiver
        self.metrics = receiver.metrics
        self.limit = max_request_bytes
        self.log = log

    def __call__(self, request: Request) -> Response:
        start = time.perf_counter()
        try:
            return self._handle(request)
        finally:
            self.metrics.export_latency.labels(TRANSPORT).observe(time.perf_counter() - start)

    def error_response(self, request: Request, status: int, message: str) -> Response:
        """The HTTP port's own error answers on this path (405, 500): the OTLP specification
        wants a ``google.rpc.Status`` for every 4xx and 5xx there, in the request's
        encoding (JSON when it has none, as a GET has not: :func:`answer_media_type`)."""
        return status_body(status, message, answer_media_type(request))

    def _handle(self, request: Request) -> Response:
        count = self.metrics.requests.labels
        media_type, charset = _content_type(request.header("Content-Type"))
        json_encoding = media_type == JSON
        if not json_encoding and media_type not in PROTOBUF_TYPES:
            count(TRANSPORT, "unsupported").inc()
            shown = media_type or "none"
            return status_body(415, f"unsupported Content-Type {shown!r}; send {PROTOBUF} or {JSON}", JSON)
        if json_encoding and charset not in (None, "utf-8", "utf8"):
            count(TRANSPORT, "unsupported").inc()
            return status_body(415, f"unsupported charset {charset!r}: OTLP/JSON is UTF-8", JSON)
        codings = request.header_list("Content-Encoding")
        encoding = coding_of(codings)
        if encoding is None:
            count(TRANSPORT, "unsupported").inc()
            return status_body(
                415,
                f"unsupported Content-Encoding {codings.strip().lower()!r}; send {', '.join(ENCODINGS)} or none",
                media_type,
            )
        rejected: list[str] = []
        spans = self._decoded(request, encoding, media_type, rejected)
        if isinstance(spans, Response):
            return spans
        try:
            outcome = self.receiver.export(spans, rejected, TRANSPORT)
        except Overloaded as error:
            count(TRANSPORT, "unavailable").inc()
            return status_body(503, str(error), media_type, error.retry_after_s)
        except Unavailable as error:
            count(TRANSPORT, "unavailable").inc()
            return status_body(503, str(error), media_type, error.retry_after_s)
        except Exception as error:
            self.log.error("export-failed", transport=TRANSPORT, error=f"{type(error).__name__}: {error}")
            count(TRANSPORT, "unavailable").inc()
            return status_body(503, "internal error in the sidecar (see its log); retry later", media_type, 1)
        count(TRANSPORT, "partial" if outcome.rejected else "ok").inc()
        return _encode(200, outcome.response(), media_type)

    def _decoded(
        self, request: Request, encoding: str, media_type: str, rejected: list[str]
    ) -> list[SpanParts] | Response:
        """The request's spans (see :meth:`TraceReceiver.decode`), or the answer when its
        body cannot be read, decompressed or decoded, or the decoding budget has no room
        for it. The body is not held once its spans are decoded, while they are committed."""
        count = self.metrics.requests.labels
        try:
            body = decompress(request.read_body(self.limit), encoding, self.limit)
            return self.receiver.decode(body, rejected, TRANSPORT, json=media_type == JSON)
        except (BodyTooLarge, TooLarge) as error:
            count(TRANSPORT, "too_large").inc()
            return status_body(413, str(error), media_type)
        except BodyError as error:
            count(TRANSPORT, "unsupported" if error.status == 501 else "invalid").inc()
            request.handler.close_connection = True
            return status_body(error.status, str(error), media_type)  # 400, or 501 (transfer coding)
        except BadData as error:
            count(TRANSPORT, "invalid").inc()
            return status_body(400, str(error), media_type)
        except DecodingRefused as error:
            count(TRANSPORT, "unavailable").inc()
            return status_body(503, str(error), media_type, error.retry_after_s)
