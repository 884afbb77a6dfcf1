"""OTLP/JSON trace files (the Collector's file exporter format) through the offline checker."""

from __future__ import annotations

import base64
import enum
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from durable_sessions.otlp_json import spans_of

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")


class OtlpJsonFileExporter(SpanExporter):
    """Writes each export as one OTLP/JSON line, as the Collector's ``file`` exporter does:
    the SDK's own protobuf encoding, printed as JSON with hex trace and span ids."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
        for group in document["resourceSpans"]:
            for scope in group["scopeSpans"]:
                for span in scope["spans"]:
                    for name in ("traceId", "spanId", "parentSpanId"):
                        if name in span:
                            span[name] = base64.b64decode(span[name]).hex()
        with self.path.open("a") as out:
            out.write(json.dumps(document) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def write_spans(path: Path, incarnation: str = "run-1") -> None:
    provider = TracerProvider(resource=Resource.create({"service.instance.id": incarnation}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(path)))
    tracer = provider.get_tracer("test")

    def act(name: str, error: bool = False, **attributes: Any) -> None:
        with tracer.start_as_current_span(name, attributes={"session.id": "trip-7", **attributes}) as span:
            if error:
                span.set_status(Status(StatusCode.ERROR))

    with tracer.start_as_current_span("agent turn"):  # not an action
        act(
            "ask",
            **{
                "agent.action.id": "a1",
                "agent.action.kind": "user_prompt",
                "agent.action.result": '{"to": "Kyoto"}',
            },
        )
        act("charge", **{"agent.action.id": "a2", "agent.action.kind": "payment"})
        act(
            "plan",
            **{"agent.action.id": "a3", "agent.action.kind": "llm_call", "agent.action.result": "not json"},
        )
        act("chat gpt-4o", **{"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o"})
    provider.shutdown()


def check(*args: str) -> tuple[int, dict[str, Any]]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", *args], capture_output=True, text=True
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_spans_of_an_otlp_json_file_are_checked_and_located(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    write_spans(path)
    code, report = check(str(path))  # the format is detected
    assert code == 1
    found = {(v["rule"], v["action_id"]) for v in report["violations"]}
    [chat] = [v["action_id"] for v in report["violations"] if v["rule"] == "unrecorded-result"]
    assert len(chat) == 16 and int(chat, 16)  # a GenAI span has no action id: its span id stands in
    assert found == {
        ("unkeyed-side-effect", "a2"),
        ("invalid-field", "a3"),  # a result that is not JSON text
        ("unrecorded-result", chat),  # the GenAI chat span recorded no output
    }
    assert report["actions"] == 4 and report["sessions"] == 1
    lines = path.read_text().splitlines()
    for violation in report["violations"]:
        assert violation["file"] == str(path)
        assert 1 <= violation["line"] <= len(lines)
        assert violation["session_id"] == "trip-7"
    [invalid] = [v for v in report["violations"] if v["rule"] == "invalid-field"]
    assert "agent.action.result is not JSON text" in invalid["message"]


def test_a_span_that_cannot_be_read_is_named_by_its_place(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    write_spans(path)
    document = json.loads(path.read_text().splitlines()[0])
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "zz"
    path.write_text(json.dumps(document) + "\n" + path.read_text())
    code, report = check("--input-format", "otlp-json", str(path))
    assert code == 1
    [unreadable] = [v for v in report["violations"] if v["rule"] == "unreadable-line"]
    assert unreadable["line"] == 1
    assert (
        "resourceSpans[0].scopeSpans[0].spans[0] traceId 'zz' is not 32 hex digits" in unreadable["message"]
    )


def test_the_same_span_twice_is_not_a_duplicate(tmp_path: Path) -> None:
    """OTLP delivers at least once: a file may hold a span twice."""
    path = tmp_path / "traces.jsonl"
    write_spans(path)
    path.write_text(path.read_text() * 2)
    _, report = check(str(path))
    assert "duplicate-action-id" not in {v["rule"] for v in report["violations"]}
    assert report["actions"] == 4


def _as_protobuf(document: dict[str, Any]) -> Any:
    """An OTLP/JSON document with hex ids as the protobuf message (whose JSON ids are base64)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    document = json.loads(json.dumps(document))
    for group in document["resourceSpans"]:
        for scope in group["scopeSpans"]:
            for span in scope["spans"]:
                for holder in (span, *span.get("links", ())):
                    for name in ("traceId", "spanId", "parentSpanId"):
                        if name in holder:
                            holder[name] = base64.b64encode(bytes.fromhex(holder[name])).decode()
    return json_format.ParseDict(document, ExportTraceServiceRequest())


class Cap(int, enum.Enum):  # str() of such a member is "Cap.THREE", not "3"
    THREE = 3


class Kind(str, enum.Enum):  # noqa: UP042 (the mixin, whose str() is its name, is the case)
    PAYMENT = "payment"


class Ratio(float):
    def __repr__(self) -> str:
        return "Ratio!"


def test_the_file_exporter_writes_what_the_sdk_s_protobuf_encoding_says(tmp_path: Path) -> None:
    """``FileSpanExporter`` against the SDK's own OTLP encoder, field for field, on spans with
    every attribute type, a status, a parent, an event, a link, two scopes and two resources
    in one export."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from durable_sessions.otlp_json import FileSpanExporter

    memory, path = InMemorySpanExporter(), tmp_path / "traces.jsonl"
    exported = []
    for incarnation in ("run-1", "run-2"):
        provider = TracerProvider(resource=Resource.create({"service.instance.id": incarnation, "n": 7}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        for scope in ("one", "two"):
            tracer = provider.get_tracer(scope, "1.0" if scope == "one" else None)
            with tracer.start_as_current_span("parent"), tracer.start_as_current_span("child") as span:
                span.set_attributes(
                    {
                        "s": "naïve ✓",
                        "b": True,
                        "i": -(2**62),
                        "f": 0.1,
                        "nan": float("nan"),
                        "inf": float("-inf"),
                        "strings": ("a", "b"),
                        "ints": (1, 2),
                        "bools": (False,),
                        # subclasses of the plain types, written as their plain values
                        "cap": Cap.THREE,
                        "kind": Kind.PAYMENT,
                        "ratio": Ratio(0.5),
                        "caps": (Cap.THREE, 4),
                    }
                )
                span.set_status(Status(StatusCode.ERROR, "it broke"))
                span.add_event("exception", {"exception.type": "ValueError"})
                span.add_link(span.get_span_context(), {"why": "retry of"})
        exported = list(memory.get_finished_spans())
    exporter = FileSpanExporter(path)
    assert exporter.export(exported).name == "SUCCESS"
    exporter.shutdown()
    assert exporter.export(exported).name == "FAILURE"  # after shutdown
    (line,) = path.read_text().splitlines()
    ours = _as_protobuf(json.loads(line))
    theirs = encode_spans(exported)

    def spans_by_id(request: Any) -> dict[bytes, Any]:
        return {
            span.span_id: (group.resource, scope.scope, span)
            for group in request.resource_spans
            for scope in group.scope_spans
            for span in scope.spans
        }

    assert spans_by_id(ours).keys() == spans_by_id(theirs).keys() and len(spans_by_id(ours)) == 8
    for span_id, (resource, scope, span) in spans_by_id(theirs).items():
        our_resource, our_scope, our_span = spans_by_id(ours)[span_id]
        assert (
            our_resource == resource and our_scope.name == scope.name and our_scope.version == scope.version
        )
        # NaN is not equal to itself, so compare the attributes' wire bytes.
        assert our_span.SerializeToString(deterministic=True) == span.SerializeToString(deterministic=True)


def _one_span(path: Path, **attributes: Any) -> None:
    from durable_sessions.otlp_json import FileSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    with provider.get_tracer("t").start_as_current_span("s", attributes=attributes):
        pass
    provider.shutdown()


def test_the_file_exporter_writes_none_in_a_sequence_as_an_empty_value(tmp_path: Path) -> None:
    from durable_sessions.otlp_json import spans_of

    _one_span(tmp_path / "t.jsonl", names=("a", None))
    (span,) = spans_of(json.loads((tmp_path / "t.jsonl").read_text()))
    assert span.attributes["names"] == ("a", None)


def test_the_file_exporter_keeps_a_span_whose_text_is_not_unicode(tmp_path: Path) -> None:
    """A lone surrogate (Python strings may hold one) is written as a JSON escape, not lost with its batch."""
    _one_span(
        tmp_path / "t.jsonl",
        **{"session.id": "s-\ud800", "agent.action.id": "a1", "agent.action.kind": "clock"},
    )
    (line,) = (tmp_path / "t.jsonl").read_bytes().splitlines()
    assert b"s-\\ud800" in line


def test_text_that_is_not_unicode_makes_only_its_span_unreadable(tmp_path: Path) -> None:
    """The file exporter writes a batch as one line, and a lone surrogate of a Python
    string as its escape, which is no Unicode: the whole line was unreadable, the
    batch's other spans unchecked, where the sidecar rejects only the span holding it.
    Now only that span is unreadable, named with the field; the unkeyed payment beside
    it is found. The line is the file's only one, so format detection reads it too."""
    from durable_sessions.otlp_json import FileSpanExporter

    path = tmp_path / "t.jsonl"
    provider = TracerProvider()
    spans: list[ReadableSpan] = []

    class Keep(SpanExporter):
        def export(self, batch: Sequence[ReadableSpan]) -> SpanExportResult:
            spans.extend(batch)
            return SpanExportResult.SUCCESS

    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("t")
    session = {"session.id": "s-1", "agent.action.kind": "payment", "result_digest": "sha256:" + "0" * 64}
    for action_id, extra in (("pay-1", {}), ("pay-2", {"note": "caf\udce9"}), ("pay-3", {})):
        with tracer.start_as_current_span(
            "pay", attributes={**session, "agent.action.id": action_id, **extra}
        ):
            pass
    FileSpanExporter(path).export(spans)
    assert len(path.read_bytes().splitlines()) == 1
    code, report = check(str(path))
    assert code == 1
    found = sorted((v["rule"], v["action_id"]) for v in report["violations"])
    assert found == [
        ("unkeyed-side-effect", "pay-1"),
        ("unkeyed-side-effect", "pay-3"),
        ("unreadable-line", None),
    ]
    [unreadable] = [v for v in report["violations"] if v["rule"] == "unreadable-line"]
    assert "spans[1] attributes[" in unreadable["message"]
    assert "is not valid UTF-8 (a lone surrogate escape \\udce9)" in unreadable["message"]


def test_text_that_is_not_unicode_in_a_resource_or_scope_makes_its_spans_unreadable(tmp_path: Path) -> None:
    """As the sidecar rejects them: bad text in a resource or a scope makes each of its
    spans unreadable, and outside any of them the whole line."""
    path = tmp_path / "traces.jsonl"
    write_spans(path)
    first = path.read_bytes().splitlines()[0]
    assert first.count(b'"scope":{"name":"test"') == 1 or first.count(b'"scope": {"name": "test"') == 1
    spans = first.count(b'"spanId"')
    for bad, reason, unreadable in (
        (first.replace(b'"run-1"', b'"run-\\udc80"'), "resource.attributes[", spans),
        (first.replace(b'"name": "test"', b'"name": "te\\udc80st"'), "scope.name is not valid UTF-8", spans),
        (
            b'{"x": "\\udc80", ' + first[1:],
            "the request x is not valid UTF-8 (a lone surrogate escape \\udc80), outside any span",
            1,
        ),
    ):
        path.write_bytes(bad + b"\n")
        _code, report = check(str(path))
        found = [v for v in report["violations"] if v["rule"] == "unreadable-line"]
        assert len(found) == unreadable, found
        assert all(reason in v["message"] for v in found), found


def test_a_file_exporter_forked_while_its_lock_is_held_exports_in_the_child(tmp_path: Path) -> None:
    import multiprocessing

    from durable_sessions.otlp_json import FileSpanExporter

    exporter = FileSpanExporter(tmp_path / "t.jsonl")
    with exporter._lock:  # another thread in the middle of an export, as far as the child knows
        child = multiprocessing.get_context("fork").Process(target=exporter.export, args=([],))
        child.start()
    child.join(20)
    assert child.exitcode == 0


def test_a_first_line_that_cannot_be_read_leaves_the_rest_read_as_otlp_json(tmp_path: Path) -> None:
    """Format detection looked at the first line of content alone: one holding a lone
    surrogate escape (which the file exporter writes for a Python string holding one) or
    bytes that are not UTF-8 is no object, so an OTLP/JSON file was read as an action log,
    every later request a record missing all its fields. The first object decides now;
    the bad line is reported by its number, in a file and on standard input."""
    path = tmp_path / "traces.jsonl"
    write_spans(path)
    good = path.read_bytes()
    first = good.splitlines()[0]
    assert first.count(b'"trip-7"') == 1
    for bad, reason in (
        (
            first.replace(b'"trip-7"', b'"trip-\\udc80"'),
            "is not valid UTF-8 (a lone surrogate escape \\udc80)",
        ),
        (first.replace(b'"trip-7"', b'"trip-\xc3\x28"'), "is not valid UTF-8 (byte 0xc3)"),
    ):
        path.write_bytes(bad + b"\n" + good)
        piped = subprocess.run(
            [str(DURABLE_SESSIONS), "check", "--format", "json", "-"],
            input=path.read_bytes(),
            capture_output=True,
        )
        for code, report in (check(str(path)), (piped.returncode, json.loads(piped.stdout))):
            assert code == 1
            found = [(v["rule"], v["action_id"], v["line"]) for v in report["violations"]]
            assert ("unreadable-line", None, 1) in found
            assert {rule for rule, _, _ in found} == {
                "unreadable-line",
                "unkeyed-side-effect",
                "invalid-field",
                "unrecorded-result",
            }
            [unreadable] = [v for v in report["violations"] if v["rule"] == "unreadable-line"]
            assert reason in unreadable["message"]
            assert report["actions"] == 4 + 1 and report["sessions"] == 1  # the bad line counts as one


_EXPORTS_WITH_A_FULL_DISK = """
import os, resource, signal, sys
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from durable_sessions.otlp_json import FileSpanExporter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail, nothing kills
path = sys.argv[1]
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
tracer = provider.get_tracer("t")
tracer.start_span("one").end()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 40, hard))
tracer.start_span("two", attributes={"long": "x" * int(sys.argv[2])}).end()  # room for 40 bytes of it
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
tracer.start_span("three").end()
provider.shutdown()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="fills the disk with RLIMIT_FSIZE")
@pytest.mark.parametrize("length", [10, 100_000], ids=["short", "longer-than-the-buffer"])
def test_a_span_line_cut_short_by_a_full_disk_does_not_take_the_next_one_with_it(
    tmp_path: Path, length: int
) -> None:
    """The export a full disk had room for only part of failed, and left a partial line:
    the next span was appended to it, one line that did not read, lost to the check. A
    short line's rest stayed in the file object's buffer instead, written out with the
    next line (in a file other processes append to, after theirs). The failed span is
    lost, as its export said; the ones around it are not."""
    path = tmp_path / "traces.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _EXPORTS_WITH_A_FULL_DISK, str(path), str(length)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "could not write 1 spans" in done.stderr
    lines = path.read_bytes().split(b"\n")
    names = []
    for line in lines:
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            continue
        names += [span.name for span in spans_of(request)]
    assert names[0] == "one" and names[-1] == "three" and "two" not in names
    assert path.read_bytes().endswith(b"\n")
