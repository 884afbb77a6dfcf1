"""Readers: turn log files into action records, streamed line by line.

Three formats are read here:

- the seed's JSONL action log, one record object per line;
- the observability-tracing event log (``trace_start``, ``step_complete``,
  ``tool_call``, ``tool_result``, … events), mapped to records as far as that format
  allows (see ``docs/readers.md``);
- OTLP/JSON trace files (one ``ExportTraceServiceRequest`` per line, as the
  OpenTelemetry Collector's ``file`` exporter writes them), each span mapped to a record
  by the same function the span processor and the sidecar use.

A reader never loads a file whole and never raises on bad content: a line it cannot
use becomes an :class:`Unreadable` item naming the line and the reason. Only a source
that cannot be opened or read at all raises :class:`InputError`.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Literal

import orjson

from durable_sessions import bad_text, kinds, otlp_json
from durable_sessions.bad_text import Marked
from durable_sessions.json_text import Failure, exact_integers, parse_with_stdlib
from durable_sessions.mapping import map_span, with_problems
from durable_sessions.record import ActionRecord, Location, line_location

DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"
Format = Literal["auto", "actions", "tracing", "otlp-json"]
FORMATS: tuple[str, ...] = ("auto", "actions", "tracing", "otlp-json")


class InputError(Exception):
    """A source that cannot be read at all: missing, a directory, unreadable."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An input line that holds no record, and why."""

    location: Location
    reason: str
    occurrence: int = 0
    """Which unreadable part of the line this is, from 0: an OTLP/JSON line may hold
    several spans that cannot be read, and each must keep its own violation key."""


Item = tuple[ActionRecord, Location] | Unreadable
"""A record and where it was found, or a line that holds none."""


@contextmanager
def open_source(path: str) -> Iterator[IO[bytes]]:
    """Open ``path`` for binary reading (``-`` is standard input), or raise InputError.

    A source that is compressed or UTF-16 text is refused here: read as lines, it would
    give a screenful of ``unreadable-line`` errors that hide the one thing to do.
    """
    if path == "-":
        if sys.stdin is None:  # started with standard input closed (``<&-``)
            raise InputError("cannot read standard input: it is closed")
        _refuse_undecodable(sys.stdin.buffer, "standard input")
        yield sys.stdin.buffer
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise InputError(f"cannot read {path!r}: {error.strerror or error}") from None
    try:
        _refuse_undecodable(handle, repr(path))
        yield handle
    finally:
        handle.close()


# How a log that is not UTF-8 JSON lines starts (no JSON line starts so), and what to do.
_UNDECODABLE = tuple(
    (re.compile(magic), what)
    for magic, what in (
        (rb"\x1f\x8b", "gzip-compressed; decompress it first (gzip -dc)"),
        (rb"BZh[1-9]1AY&SY", "bzip2-compressed; decompress it first (bzip2 -dc)"),
        (rb"\xfd7zXZ\x00", "xz-compressed; decompress it first (xz -dc)"),
        (rb"\x28\xb5\x2f\xfd", "zstd-compressed; decompress it first (zstd -dc)"),
        (rb"\xff\xfe|\xfe\xff", "UTF-16 text; logs must be UTF-8 (iconv -f UTF-16 -t UTF-8)"),
        # UTF-16 without a byte order mark: two ASCII characters, each with a NUL byte
        # beside it. UTF-8 JSON lines (and comments) hold no NUL byte.
        (rb"(?:[\x01-\x7f]\x00){2}", "UTF-16 text; logs must be UTF-8 (iconv -f UTF-16LE -t UTF-8)"),
        (rb"(?:\x00[\x01-\x7f]){2}", "UTF-16 text; logs must be UTF-8 (iconv -f UTF-16BE -t UTF-8)"),
    )
)


def _refuse_undecodable(handle: IO[bytes], name: str) -> None:
    """Raise InputError when ``handle`` starts like a compressed file or UTF-16 text.
    Peeks, so nothing is consumed, even from a pipe."""
    try:
        head = handle.peek(10)[:10] if hasattr(handle, "peek") else b""
    except OSError as error:
        raise InputError(f"cannot read {name}: {error.strerror or error}") from None
    for magic, what in _UNDECODABLE:
        if magic.match(head):
            raise InputError(f"cannot read {name}: it is {what}")


def display_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def parse_object(line: bytes) -> dict[str, Any] | str:
    """The JSON object on ``line``, or a message saying why there is none."""
    try:
        value = exact_integers(line, orjson.loads(line))
    except orjson.JSONDecodeError as error:
        value = parse_with_stdlib(line, error)
        if isinstance(value, Failure):
            return value.reason
    if type(value) is not dict:
        return f"line is {_json_type(value)}, not a JSON object"
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    if value is None:
        return "JSON null"
    if isinstance(value, bool):
        return "a JSON boolean"
    return "a JSON number"


def too_long(max_line_bytes: int) -> str:
    return f"line is longer than {max_line_bytes} bytes, the reader's limit"


def numbered_lines(source: IO[bytes], name: str, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """``(line_number, raw_line)`` for every line; ``None`` for one over ``max_line_bytes``.

    An over-long line is skipped in chunks, never held whole in memory.
    """
    number = 0
    readline = source.readline
    try:
        while raw := readline(max_line_bytes + 1):
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while (rest := readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield number, None
            else:
                yield number, raw
    except OSError as error:
        raise InputError(f"cannot read {name!r} after line {number}: {error.strerror or error}") from None


def parse_line(raw: bytes | None, name: str, number: int, max_line_bytes: int) -> Item | None:
    """The item on one line from :func:`numbered_lines`; None for a blank or comment line."""
    if raw is None:
        return Unreadable(Location(name, number), too_long(max_line_bytes))
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = _parse_unusual_line(raw, number)
        if value is None:
            return None
    else:
        value = exact_integers(raw, value)  # integers beyond 64 bits, which orjson rounds
    if type(value) is dict:
        return value, line_location(name, number)  # type: ignore[return-value]
    return Unreadable(Location(name, number), _why_unreadable(value))


def read_actions(
    source: IO[bytes], name: str, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[Item]:
    """Records from the seed's JSONL action log, with their line numbers.

    Blank lines and lines starting with ``#`` are skipped. A line longer than
    ``max_line_bytes`` is reported without ever being held whole in memory.
    """
    for number, raw in numbered_lines(source, name, max_line_bytes):
        if item := parse_line(raw, name, number, max_line_bytes):
            yield item


def _content(raw: bytes, number: int) -> bytes:
    """The line without surrounding blanks and, on the first line, without a UTF-8 BOM."""
    stripped = raw.strip()
    if number == 1 and stripped.startswith(UTF8_BOM):
        stripped = stripped[len(UTF8_BOM) :].strip()
    return stripped


def _parse_unusual_line(raw: bytes, number: int) -> Any:
    """What orjson refused: None for a blank or comment line, else a value or a Failure."""
    stripped = _content(raw, number)
    if not stripped or stripped.startswith(b"#"):
        return None
    parsed = parse_object(stripped)
    return Failure(parsed) if type(parsed) is str else parsed


def _why_unreadable(value: Any) -> str:
    if isinstance(value, Failure):
        return value.reason
    return f"line is {_json_type(value)}, not a JSON object"


# -- observability-tracing event logs ------------------------------------------------

TRACING_MARKERS = ("trace_id", "span", "step")
TRACING_ACTION_EVENTS = {
    "tool_call": kinds.TOOL_CALL,
    "tool_result": kinds.TOOL_CALL,
    "step_complete": kinds.LLM_CALL,
}
_TRACING_STATUS = {"ok": "ok", "error": "error", "started": "started"}
_META_RECORD_FIELDS = (
    "idempotency_key", "result", "result_ref", "result_digest", "replay", "replayed",
    "side_effects", "retryable", "max_attempts", "attempts", "cacheable", "cache_key",
    "ttl_s", "on_failure", "incarnation", "prompt_digest",
)  # fmt: skip


def is_tracing_event(obj: dict[str, Any]) -> bool:
    return all(marker in obj for marker in TRACING_MARKERS) and "action_id" not in obj


CompletedSpans = set[tuple[Any, Any]]
"""The (trace id, span) of every tracing span that has completed so far in a stream."""


def read_tracing(
    source: IO[bytes],
    name: str,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    completed: CompletedSpans | None = None,
) -> Iterator[Item]:
    """Records from an observability-tracing event log.

    ``tool_call``/``tool_result`` events become ``tool_call`` actions and
    ``step_complete`` events ``llm_call`` actions, with the trace as the session and the
    span as the action id. Durability fields the event carries in ``meta`` under their
    record names (``idempotency_key``, ``result_ref``, …) are taken; ``meta.action_kind``
    overrides the kind. Other events (``trace_start``, ``step_start``, ``error``, …)
    describe no action and are skipped. ``completed``: the spans completed in the files
    read before in the same stream (share one set across them), so that a ``tool_result``
    in this file whose ``tool_call`` completed in an earlier one is dropped there too.
    """
    if completed is None:
        completed = set()
    for item in read_actions(source, name, max_line_bytes=max_line_bytes):
        if type(item) is Unreadable:
            yield item
            continue
        event, location = item  # type: ignore[misc]
        record = tracing_event_to_record(event, completed)
        if record is not None:
            yield record, location


def tracing_event_to_record(event: dict[str, Any], completed: CompletedSpans) -> ActionRecord | None:
    """The record one tracing event describes, or None when it describes no action."""
    event_kind, event_status = event.get("kind"), event.get("status")
    if type(event_kind) is not str or type(event_status) is not str:
        return None
    kind = TRACING_ACTION_EVENTS.get(event_kind)
    status = _TRACING_STATUS.get(event_status)
    if kind is None or status is None:
        return None
    span = (event.get("trace_id"), event.get("span"))
    if status != "started" and all(type(part) is str for part in span):
        if event_kind == "tool_result" and span in completed:
            return None
        completed.add(span)
    meta = event.get("meta") if isinstance(event.get("meta"), dict) else {}
    record: ActionRecord = {
        "session_id": event.get("trace_id"),
        "action_id": event.get("span"),
        "kind": meta.get("action_kind", kind),
        "status": status,
        "name": event.get("tool") or event.get("agent"),
        "ts": event.get("ts"),
    }
    record.update((key, meta[key]) for key in _META_RECORD_FIELDS if key in meta)  # type: ignore[typeddict-item]
    return record


def sniff_format(source: IO[bytes], name: str, max_line_bytes: int) -> Format:
    """``otlp-json`` or ``tracing`` when the first readable object looks like an OTLP
    request or a tracing event, else ``actions``.

    A seekable file is read up to its first object and rewound; a pipe can only be
    peeked at, so there the first object must fit in the read buffer (:func:`sniff`
    reads a pipe's first object whole). A UTF-8 BOM that starts the source is ignored,
    as the readers ignore it.
    """
    try:
        first = _head_object(source, max_line_bytes)
    except OSError as error:
        raise InputError(f"cannot read {name!r}: {error.strerror or error}") from None
    return _format_of(first)


def sniff(source: IO[bytes], name: str, max_line_bytes: int) -> tuple[Format, IO[bytes]]:
    """The format of ``source`` (as :func:`sniff_format` decides it) and the stream to read
    it from: ``source`` itself when it can be rewound.

    Standard input, a pipe or a FIFO cannot be rewound, and a peek sees one buffer (8 KiB
    for standard input): a first line longer than that, as an OTLP/JSON request of a few
    dozen spans is, went undetected and the whole stream was read as an action log. So
    its lines up to the first object are read whole here, and the stream returned gives
    them back before the rest.
    """
    if _seekable(source):
        return sniff_format(source, name, max_line_bytes), source
    try:
        head, first = _lines_to_first_object(source, max_line_bytes, _HEAD_LINES)
    except OSError as error:
        raise InputError(f"cannot read {name!r}: {error.strerror or error}") from None
    return _format_of(first), io.BufferedReader(_Replay(b"".join(head), source))


class _Replay(io.RawIOBase):
    """``head``, then what ``rest`` gives: a stream read from the start again after
    :func:`sniff` read its first lines. Reads from ``rest`` return what it has at hand
    (``read1``), so that lines are checked as they come."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            count = min(len(buffer), len(self._head))
            buffer[:count] = self._head[:count]
            self._head = self._head[count:]
            return count
        read1 = getattr(self._rest, "read1", self._rest.read)
        data = read1(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _format_of(first: dict[str, Any] | None) -> Format:
    """The format a source's first object (None: it has none in its first lines) says."""
    if first is None:
        return "actions"
    if otlp_json.is_otlp_request(first):
        return "otlp-json"
    return "tracing" if is_tracing_event(first) else "actions"


def _object_on(line: bytes, number: int) -> dict[str, Any] | None:
    """The JSON object on line ``number`` (its strings that are not UTF-8 text marked, see
    :mod:`.bad_text`), or None: a blank or comment line, or one that is no object (the
    reader reports it), which says nothing of the format of the lines after it."""
    stripped = _content(line, number)
    if not stripped or stripped.startswith(b"#"):
        return None
    parsed = parse_object(stripped)
    if not isinstance(parsed, dict):  # an OTLP/JSON line whose text is not all UTF-8 is still one
        return _marked_object(stripped)[0]
    return parsed


_HEAD_LINES = 64
"""How many lines format detection looks at, at most, for the first object."""


def _seekable(source: IO[bytes]) -> bool:
    try:
        return bool(source.seekable())
    except (OSError, ValueError, AttributeError):
        return False


def _head_object(source: IO[bytes], max_line_bytes: int) -> dict[str, Any] | None:
    """The first JSON object in the first lines of ``source``, which is left where it was."""
    if not _seekable(source):
        peek = getattr(source, "peek", None)
        # Lines end at "\n" alone, as the readers split them: splitlines() also split at a
        # "\r", which JSON allows as whitespace inside an object.
        lines = peek(65536).split(b"\n") if peek else []
        found = (_object_on(line, number) for number, line in enumerate(lines, 1))
        return next((first for first in found if first is not None), None)  # {} is one
    start = source.tell()
    try:
        return _lines_to_first_object(source, max_line_bytes, _HEAD_LINES)[1]
    finally:
        source.seek(start)


def _lines_to_first_object(
    source: IO[bytes], max_line_bytes: int, limit: int
) -> tuple[list[bytes], dict[str, Any] | None]:
    """The lines ``source`` gives up to its first JSON object, that line included (at most
    ``limit`` lines), and that object (None when there is none among them). Each line is
    read once: reading a line of 64 MiB may cost a second or more."""
    lines: list[bytes] = []
    while len(lines) < limit and (line := source.readline(max_line_bytes + 1)):
        lines.append(line)
        if (first := _object_on(line, len(lines))) is not None:
            return lines, first
    return lines, None


# -- OTLP/JSON trace files ------------------------------------------------------------


class Redeliveries:
    """The spans read lately, to drop a span delivered again.

    OTLP delivers at least once: a retried Export brings its spans back, and not always
    right after their first delivery (another batch may have gone through meanwhile), so
    the engine, which recognises a repeat of an action's latest record only, would judge
    an earlier one as a new record. The sidecar's stores drop every repeat (both are
    unique on session, trace, span and status); a file of OTLP requests is read the same
    way, so a span whose ids and status equal those of a span of another session is kept,
    as the stores keep it. A retry comes back within the exporter's retry window, so only
    the last ``window`` spans are remembered, by a 64-bit hash of (session id, trace id,
    span id, status): memory stays bounded however long the input.
    """

    def __init__(self, window: int = 200_000) -> None:
        self.window = window
        self._seen: dict[int, None] = {}

    def is_repeat(self, session_id: object, trace_id: str, span_id: str, status: object) -> bool:
        """Whether this (session id, trace id, span id, status) was read lately; remembers
        it if not. No session is the store's ``''``.

        ``session_id`` and ``status`` may be any attribute value (a mistyped one is an
        array or a key-value list, which cannot be hashed): it is keyed by its ``repr``
        then, as the sidecar's store keeps such a value as one digest of it.
        """
        seen = self._seen
        key = hash((_keyed(session_id), trace_id, span_id, _keyed(status)))
        if key in seen:
            return True
        seen[key] = None
        if len(seen) > self.window:
            del seen[next(iter(seen))]  # the oldest: dicts keep insertion order
        return False


def _keyed(value: object) -> str:
    """``value`` as :class:`Redeliveries` keys it: text as it is, none as ``''``, anything
    else by its ``repr``."""
    if type(value) is str:
        return value
    return "" if value is None else repr(value)


def read_otlp_json(
    source: IO[bytes],
    name: str,
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    redeliveries: Redeliveries | None = None,
    attribute_value_limit: int | None = None,
) -> Iterator[Item]:
    """Records from the spans of an OTLP/JSON file, located by line and span.

    Spans that describe no action are skipped; a span that cannot be read (a bad id, a
    start time that is no integer) is reported with its place in the request. A span
    delivered again is skipped (``redeliveries``: share one across the files of a stream).
    ``attribute_value_limit``: the attribute value length limit the spans were recorded
    under (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``), when known, so that a result the SDK
    cut is a ``truncated-result``, as the span processor and the sidecar judge it.
    """
    if redeliveries is None:
        redeliveries = Redeliveries()
    for item, marked in _otlp_requests(source, name, max_line_bytes):
        if type(item) is Unreadable:
            yield item
            continue
        request, location = item  # type: ignore[misc]
        bad = 0  # the bad spans of a line share its location: each gets its own occurrence
        for span in otlp_json.spans_of(request, attribute_value_limit=attribute_value_limit, marked=marked):
            if type(span) is otlp_json.BadSpan:
                yield Unreadable(location, f"{span.where} {span.reason}", bad)  # type: ignore[union-attr]
                bad += 1
                continue
            mapped = map_span(span)  # type: ignore[arg-type]
            if mapped is None:
                continue
            trace_id, span_id = mapped.where[2:]
            record = mapped.record
            if redeliveries.is_repeat(record.get("session_id"), trace_id, span_id, record.get("status")):
                continue
            yield (
                with_problems(mapped.record, mapped.problems),
                Location(name, location.line, trace_id, span_id),
            )


def _otlp_requests(source: IO[bytes], name: str, max_line_bytes: int) -> Iterator[tuple[Item, Marked | None]]:
    """The lines of an OTLP/JSON file as :func:`read_actions` reads them, except that a
    line refused for strings that are not UTF-8 text (bytes that are not, a lone surrogate
    escape) is read with those strings marked (:mod:`.bad_text`), so that only the spans
    holding them are unreadable, as the sidecar rejects only those."""
    for number, raw in numbered_lines(source, name, max_line_bytes):
        item = parse_line(raw, name, number, max_line_bytes)
        if type(item) is Unreadable and raw is not None:
            request, found = _marked_object(_content(raw, number))
            if request is not None:
                yield (request, line_location(name, number)), found  # type: ignore[misc]
                continue
        if item is not None:
            yield item, None


def _marked_object(line: bytes) -> tuple[dict[str, Any], Marked] | tuple[None, None]:
    """The JSON object of ``line`` read with its bad text marked, and the marks; Nones
    when it holds none or is no object (refused for more than its text)."""
    read = bad_text.read(line)
    return read if read is not None and type(read[0]) is dict else (None, None)


def read(
    path: str,
    source: IO[bytes],
    *,
    fmt: Format = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    redeliveries: Redeliveries | None = None,
    completed: CompletedSpans | None = None,
    attribute_value_limit: int | None = None,
) -> Iterator[Item]:
    """Items from an opened source, in the given or sniffed format. The state a stream
    carries from file to file, to share across its files: ``redeliveries``, the OTLP/JSON
    spans read before; ``completed``, the tracing spans completed before.
    ``attribute_value_limit``: see :func:`read_otlp_json`."""
    name = display_name(path)
    if fmt == "auto":
        fmt, source = sniff(source, name, max_line_bytes)
    if fmt == "otlp-json":
        return read_otlp_json(
            source,
            name,
            max_line_bytes=max_line_bytes,
            redeliveries=redeliveries,
            attribute_value_limit=attribute_value_limit,
        )
    if fmt == "tracing":
        return read_tracing(source, name, max_line_bytes=max_line_bytes, completed=completed)
    return read_actions(source, name, max_line_bytes=max_line_bytes)
