"""Edge cases of the core package: span processor, instrumentation API, offline checker.

Regression tests for behaviour the documentation promises at the edges:

- the span processor fails open on hostile input, keeps the SpanProcessor contract, and
  checks each span with its own resource when spans of several providers end at once;
- an unusable ``max_sessions`` is a ``ConfigurationError`` at construction;
- a span result that is JSON text is read as the log reader reads it (numbers beyond a
  double included);
- ``idempotency_key()``: keys never change for ordinary identities, are unambiguous when
  a part holds the separator, and are never taken for timestamps by ``time-derived-key``;
- an ``action`` object entered by concurrent tasks or threads ends each block's own span;
- the offline checker: exit codes, output formats, format detection (a UTF-8 BOM at the
  start of a file is ignored) and robustness against garbage input.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import json
import linecache
import math
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode

from durable_sessions import cli
from durable_sessions import semconv as sc
from durable_sessions.engine import Checker
from durable_sessions.instrument import action, idempotency_key, session
from durable_sessions.mapping import map_attributes
from durable_sessions.processor import (
    ConfigurationError,
    DurabilitySpanProcessor,
    DurabilityViolationError,
)
from durable_sessions.readers import UTF8_BOM, parse_object, sniff_format
from durable_sessions.rules.record_rules import time_component
from durable_sessions.violation import Violation
from tests.support.waiting import GENEROUS_S, wait_until

TRACING_LOG = Path(__file__).parent / "data" / "tracing-demo-run-001.jsonl"  # the seed's demo trace


# -- helpers -----------------------------------------------------------------------------


class Rig:
    """A TracerProvider with an in-memory exporter first, then the durability processor."""

    def __init__(self, resource: Resource | None = None, **options: Any) -> None:
        self.found: list[Violation] = []
        self._lock = threading.Lock()
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=resource or Resource.create({"service.instance.id": "r1"}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        options.setdefault("on_violation", self._collect)
        options.setdefault("mode", "silent")
        self.processor = DurabilitySpanProcessor(**options)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("audit")

    def _collect(self, violation: Violation) -> None:
        with self._lock:
            self.found.append(violation)

    def span(self, name: str = "s", **attributes: Any) -> None:
        with self.tracer.start_as_current_span(name, attributes=attributes):
            pass

    def rules(self) -> list[str]:
        assert self.processor.wait_checked(30)
        return sorted(v.rule for v in self.found)

    def close(self) -> None:
        self.processor.shutdown()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_replay_check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.replay_check_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def action_line(**fields: Any) -> str:
    record = {"session_id": "s", "action_id": "a", "kind": "tool_call", "status": "ok"}
    record.update(fields)
    return json.dumps(record)


# == span processor: fail open ============================================================

HOSTILE_VALUES: list[Any] = [
    "x" * 200_000,
    float("nan"),
    float("inf"),
    -0.0,
    2**63 - 1,
    -(2**63),
    True,
    ("a", "b"),
    (1, 2, 3),
    (),
    b"\xff\xfe",
    "\udcff",
    "",
    "[" * 5000 + "]" * 5000,
    "9" * 5000,
    '"\\ud800"',
]

FIELDS = [
    sc.ACTION_KIND,
    sc.ACTION_ID,
    sc.ACTION_STATUS,
    sc.ACTION_RESULT,
    sc.ACTION_RESULT_DIGEST,
    sc.ACTION_IDEMPOTENCY_KEY,
    sc.ACTION_MAX_ATTEMPTS,
    sc.ACTION_ATTEMPTS,
    sc.ACTION_RETRYABLE,
    sc.ACTION_TTL_S,
    sc.ACTION_REPLAY,
    sc.ACTION_REPLAYED,
    sc.ACTION_ON_FAILURE,
    sc.SESSION_ID,
    sc.GEN_AI_OPERATION_NAME,
    sc.OPENINFERENCE_SPAN_KIND,
    "agent.action.seq",
    "agent.action.session_id",
]


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_hostile_attribute_values_never_raise_into_span_end(checking: str) -> None:
    """Every field set to every hostile value: span.end() returns, nothing is raised,
    force_flush answers True and the exporting processor still sees every span."""
    rig = Rig(checking=checking)
    try:
        count = 0
        for field in FIELDS:
            for value in HOSTILE_VALUES:
                attributes = {sc.ACTION_KIND: "payment", sc.ACTION_ID: f"a{count}", field: value}
                rig.span(**attributes)
                count += 1
        assert rig.processor.force_flush() is True
        assert len(rig.exporter.get_finished_spans()) == count
        assert rig.processor.internal_errors == 0
    finally:
        rig.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(FIELDS) | st.text(min_size=1, max_size=20),
        st.one_of(
            st.text(max_size=50),
            st.integers(),
            st.floats(allow_nan=True),
            st.booleans(),
            st.lists(st.text(max_size=5), max_size=3),
            st.lists(st.integers(), max_size=3),
        ),
        max_size=8,
    )
)
def test_fuzzed_attributes_fail_open(attributes: dict[str, Any]) -> None:
    """Random attributes on a real SDK span: the processor never raises and never errs."""
    rig = Rig()
    rig.span(**attributes)
    assert rig.processor.force_flush() is True
    assert rig.processor.internal_errors == 0


_ANY_SCALAR = st.one_of(
    st.none(),  # the SDK allows None inside a sequence only; alone it drops the attribute
    st.text(max_size=8),  # lone surrogates included
    st.binary(max_size=4),
    st.integers(min_value=-(2**130), max_value=2**130),  # beyond 64 bits too
    st.floats(allow_nan=True),
    st.booleans(),
    st.sampled_from(["payment", "email", "llm_call", "tool_call", "started"]),
)
_ANY_VALUE = st.one_of(
    _ANY_SCALAR,
    st.lists(_ANY_SCALAR, max_size=3),  # mixed types, None among them
    st.lists(st.lists(_ANY_SCALAR, max_size=2), max_size=2),  # nested: the SDK refuses them
    st.tuples(_ANY_SCALAR, _ANY_SCALAR),
    st.dictionaries(st.text(min_size=1, max_size=3), _ANY_SCALAR, max_size=2),  # the SDK keeps a mapping
)


@pytest.fixture(scope="module")
def intent_rigs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One processor of each checking, with an intent log, for every example."""
    folder = tmp_path_factory.mktemp("intents")
    rigs = [
        Rig(checking=checking, intent_log=folder / f"{checking}.jsonl") for checking in ("inline", "process")
    ]
    yield rigs
    for rig in rigs:
        assert rig.processor.force_flush(timeout_millis=60_000) is True
        assert rig.processor.spans_dropped == 0
        assert rig.processor.internal_errors == 0
        rig.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attributes=st.dictionaries(
        st.sampled_from([*FIELDS, sc.attribute("side_effects")]) | st.text(min_size=1, max_size=10),
        _ANY_VALUE,
        max_size=6,
    ),
    at_start=st.booleans(),
)
def test_attribute_values_of_every_type_fail_open_and_leave_no_intent_unwritten(
    intent_rigs: list[Rig], attributes: dict[str, Any], at_start: bool
) -> None:
    """Any value the SDK may be handed (bytes, integers beyond 64 bits, None in a list,
    nested lists, mappings, NaN, lone surrogates), given at the start (so written to the intent
    log) or set later, on a payment: no error inside the processor, with either checking.
    A bytes action id given at the start was an internal error and a lost intent."""
    payment = {sc.ACTION_KIND: "payment", sc.ACTION_ID: "a"}
    for rig in intent_rigs:
        if at_start:
            rig.span(**{**payment, **attributes})
        else:
            with rig.tracer.start_as_current_span("pay", attributes=payment) as span:
                for key, value in attributes.items():
                    span.set_attribute(key, value)
        assert rig.processor.internal_errors == 0, attributes


def test_readable_span_that_is_not_the_sdks_never_raises() -> None:
    """A ReadableSpan built by hand (non-str key, unmarshallable value, no context) or
    objects that are no span at all: on_end/on_start fail open, counted as internal errors."""
    processor = DurabilitySpanProcessor(mode="log", checking="inline")
    odd = [
        None,
        object(),
        ReadableSpan(name="x", attributes={1: "a", sc.ACTION_KIND: "payment"}),  # type: ignore[dict-item]
        ReadableSpan(name="x", attributes={sc.ACTION_KIND: "payment", sc.ACTION_ID: "a"}),
        ReadableSpan(
            name="x", context=SpanContext(1, 2, False), attributes={sc.ACTION_KIND: "x", "v": object()}
        ),
    ]
    for span in odd:
        processor.on_end(span)  # type: ignore[arg-type]
    for args in [(None, None), (object(), None), (object(), object())]:
        processor.on_start(*args)  # type: ignore[arg-type]
    assert processor.internal_errors > 0
    processor.shutdown()


def test_broken_callback_is_counted_not_raised() -> None:
    def broken(_: Violation) -> None:
        raise RuntimeError("callback bug")

    rig = Rig(on_violation=broken, mode="log")
    rig.span(**{sc.ACTION_KIND: "payment", sc.ACTION_ID: "a", sc.SESSION_ID: "s"})
    assert rig.processor.internal_errors == 1
    assert rig.processor.violations_reported == 1
    rig.close()


def test_raise_mode_raises_violations_only_and_shutdown_never_raises() -> None:
    rig = Rig(mode="raise")
    with pytest.raises(DurabilityViolationError) as raised:
        rig.span(**{sc.ACTION_KIND: "payment", sc.ACTION_ID: "a", sc.SESSION_ID: "s"})
    assert [v.rule for v in raised.value.violations] == ["unkeyed-side-effect"]
    # the exporting processor, added first, still received the span
    assert len(rig.exporter.get_finished_spans()) == 1
    # an internal error is not raised in raise mode
    rig.processor.on_end(object())  # type: ignore[arg-type]
    assert rig.processor.internal_errors == 1
    # a started side effect never completed: end-of-session finding at end_sessions ...
    rig.span(
        **{sc.ACTION_KIND: "payment", sc.ACTION_ID: "b", sc.SESSION_ID: "s2", sc.ACTION_STATUS: "started"}
    )
    with pytest.raises(DurabilityViolationError):
        rig.processor.end_sessions()
    rig.span(
        **{sc.ACTION_KIND: "payment", sc.ACTION_ID: "c", sc.SESSION_ID: "s3", sc.ACTION_STATUS: "started"}
    )
    rig.processor.shutdown()  # ... but shutdown never raises


def test_off_mode_does_nothing() -> None:
    rig = Rig(mode="off")
    rig.span(**{sc.ACTION_KIND: "payment", sc.ACTION_ID: "a"})
    assert rig.found == [] and rig.processor.force_flush() is True
    rig.close()


# == span processor: SpanProcessor contract ===============================================


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_shutdown_is_idempotent_and_later_spans_are_ignored(checking: str) -> None:
    rig = Rig(checking=checking)
    rig.span(**{sc.ACTION_KIND: "payment", sc.ACTION_ID: "a", sc.SESSION_ID: "s"})
    assert rig.processor.force_flush(timeout_millis=30_000) is True
    assert rig.rules() == ["unkeyed-side-effect"]
    assert rig.processor.shutdown() is None
    rig.processor.shutdown()
    rig.span(**{sc.ACTION_KIND: "payment", sc.ACTION_ID: "b", sc.SESSION_ID: "s"})
    assert [v.rule for v in rig.found] == ["unkeyed-side-effect"]
    # Nothing is left to check or end: each says so alike in both checkings (end_sessions
    # answered False with a checker process, as if it had not answered in time).
    assert rig.processor.force_flush() is True
    assert rig.processor.wait_checked(1) is True
    assert rig.processor.end_sessions(timeout_s=1) is True
    assert rig.processor.end_session("s") == []
    assert rig.processor.internal_errors == 0


def test_span_ended_twice_is_checked_once() -> None:
    rig = Rig()
    with rig.tracer.start_as_current_span(
        "x", attributes={sc.ACTION_KIND: "payment", sc.ACTION_ID: "a"}
    ) as span:
        pass
    span.end()  # the SDK warns and does not call processors again
    rig.processor.on_end(span)  # the same span delivered twice: a redelivery, not a duplicate
    assert rig.rules() == ["unkeyed-side-effect"]
    assert rig.processor.actions_checked == 1
    rig.close()


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_many_threads_ending_spans_concurrently(checking: str) -> None:
    rig = Rig(checking=checking, max_sessions=50)
    threads, per_thread = 12, 200
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            rig.span(**{sc.SESSION_ID: f"s{t}-{i % 7}", sc.ACTION_KIND: "payment", sc.ACTION_ID: f"a{t}-{i}"})

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert rig.processor.force_flush() is True
    assert len(rig.found) == threads * per_thread == rig.processor.violations_reported
    assert rig.processor.actions_checked == threads * per_thread
    assert rig.processor.internal_errors == 0 and rig.processor.spans_dropped == 0
    rig.close()


def _end_action_span(provider: TracerProvider, action_id: str) -> None:
    with provider.get_tracer("t").start_as_current_span(
        action_id, attributes={sc.ACTION_KIND: "payment", sc.ACTION_ID: action_id}
    ):
        pass


def _provider_of_session(session_id: str, processor: DurabilitySpanProcessor) -> TracerProvider:
    """A provider whose resource names the session (so spans without ``session.id`` take it)."""
    provider = TracerProvider(
        resource=Resource.create({"session.id": session_id, "service.instance.id": f"run-{session_id}"})
    )
    provider.add_span_processor(processor)
    return provider


def _waiting_for_the_lock(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``span.end()``, at the processor's lock (a fixed sleep
    did not always see it get there on a loaded machine)."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    return (
        frame is not None
        and frame.f_code is DurabilitySpanProcessor._check_ended.__code__
        and "with self._lock" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    )


def test_spans_of_two_resources_ending_at_once_are_each_checked_with_their_own_resource() -> None:
    """One processor serves two providers with different resources; a span of each ends
    on its own thread at the same moment. Each span must be checked with its own
    resource: its violation names its own resource's session, never
    that of the span that ended beside it.

    The interleaving is forced: the test holds the processor's private lock (there is no
    public hook to pause a check) while both threads end their spans, so that both are in
    ``span.end()`` before either is checked, then lets them go.
    """
    found: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="inline", on_violation=found.append)
    provider_a = _provider_of_session("sess-A", processor)
    provider_b = _provider_of_session("sess-B", processor)
    thread_a = threading.Thread(target=_end_action_span, args=(provider_a, "from-A"))
    thread_b = threading.Thread(target=_end_action_span, args=(provider_b, "from-B"))
    with processor._lock:
        thread_a.start()
        assert wait_until(lambda: _waiting_for_the_lock(thread_a)), "thread A never reached the check"
        thread_b.start()
        assert wait_until(lambda: _waiting_for_the_lock(thread_b)), "thread B never reached the check"
    thread_a.join(GENEROUS_S)
    thread_b.join(GENEROUS_S)
    processor.shutdown()
    assert {v.action_id: v.session_id for v in found} == {"from-A": "sess-A", "from-B": "sess-B"}


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_spans_of_two_resources_from_many_threads_keep_their_own_session(checking: str) -> None:
    """Many threads end spans of two resources in turn, as fast as they can, with the
    rules checked inline or in the checker process (where a resource is declared to the
    process before its spans): every violation names the session of its own span's
    resource, and every span is checked."""
    found: list[Violation] = []
    lock = threading.Lock()

    def collect(violation: Violation) -> None:
        with lock:
            found.append(violation)

    processor = DurabilitySpanProcessor(mode="silent", checking=checking, on_violation=collect)
    providers = [_provider_of_session(name, processor) for name in ("sess-A", "sess-B")]
    threads, per_thread = 8, 150
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            provider = providers[(t + i) % 2]
            _end_action_span(provider, f"{'AB'[(t + i) % 2]}-{t}-{i}")

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert processor.force_flush() is True
    processor.shutdown()
    assert processor.spans_dropped == 0 and processor.internal_errors == 0
    assert len(found) == threads * per_thread
    wrong = [(v.action_id, v.session_id) for v in found if v.session_id != f"sess-{v.action_id[0]}"]
    assert wrong == []


# == span processor: configuration ========================================================


@pytest.mark.parametrize("bad", [0, -1, "many", 2.5, True])
def test_unusable_max_sessions_argument_is_rejected_at_construction(bad: Any) -> None:
    """docs/processor.md: an unusable value raises ``ConfigurationError`` when the
    processor is built, at setup, never later. The argument is held to the rule its
    environment variable is held to (an integer of at least 1): taken as given, ``"many"``
    would make every action span a silent internal error in ``span.end()``, and ``0``
    would forget each session before its first action is remembered."""
    with pytest.raises(ConfigurationError, match="max_sessions"):
        DurabilitySpanProcessor(max_sessions=bad)


def test_max_sessions_environment_variable_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("many", "0", "-3"):
        monkeypatch.setenv("DURABLE_SESSIONS_MAX_SESSIONS", bad)
        with pytest.raises(ConfigurationError):
            DurabilitySpanProcessor()


def test_one_session_is_the_smallest_max_sessions_and_session_rules_still_fire() -> None:
    """``max_sessions=1`` is accepted, and the one session held remembers its actions:
    two kinds under one action id in one session is a ``duplicate-action-id``."""
    rig = Rig(max_sessions=1)
    rig.span(**{sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a1", sc.SESSION_ID: "s"})
    rig.span(**{sc.ACTION_KIND: "clock", sc.ACTION_ID: "a1", sc.SESSION_ID: "s", sc.ACTION_RESULT: "1"})
    rig.processor.force_flush()
    assert "duplicate-action-id" in rig.rules()
    rig.close()


# == mapping ================================================================================


def test_mapping_keeps_wrong_types_and_reports_them() -> None:
    mapped = map_attributes(
        {sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_MAX_ATTEMPTS: "3", sc.ACTION_RESULT: 5},
        {},
        False,
        1,
        1,
        2,
        None,
        True,
    )
    assert mapped is not None
    record, problems = mapped
    assert record["max_attempts"] == "3"
    assert problems and "expected JSON text" in problems[0]


BEYOND_DOUBLE = ("1e999", "-1e999", "9" * 400, '{"big": 1e400}', "[1e999, 2]")


def _map_result(text: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    mapped = map_attributes(
        {sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: text},
        {},
        False,
        1,
        1,
        2,
        None,
        True,
    )
    assert mapped is not None
    return mapped  # type: ignore[return-value]


@pytest.mark.parametrize("text", BEYOND_DOUBLE)
def test_span_result_with_numbers_beyond_a_double_is_json_as_in_a_log(text: str) -> None:
    """``agent.action.result`` must be JSON text (RFC 8259), which allows numbers that no
    double holds (``1e999``, 400-digit integers). The log reader accepts them in a record
    (docs/readers.md: "`1e999` is JSON"); a span carrying the same result must be mapped
    without a problem, and its result read the same way as in the log."""
    assert isinstance(parse_object(f'{{"result": {text}}}'.encode()), dict)
    record, problems = _map_result(text)
    assert problems == ()
    assert record["result"] == json.loads(text)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "not json", '"\\ud800"', "[1,", "[" * 5000])
def test_span_result_that_is_not_json_text_is_still_reported(text: str) -> None:
    """What no JSON parser accepts stays a mapping problem, kept as given."""
    record, problems = _map_result(text)
    assert record["result"] == text
    assert len(problems) == 1 and "is not JSON text" in problems[0]


def test_processor_reports_no_invalid_field_for_a_result_beyond_a_double() -> None:
    """End to end through a span: a recorded ``1e999`` result is no ``invalid-field``."""
    rig = Rig()
    rig.span(
        **{sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a1", sc.SESSION_ID: "s", sc.ACTION_RESULT: "1e999"}
    )
    rig.span(**{sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a2", sc.SESSION_ID: "s", sc.ACTION_RESULT: "NaN"})
    assert rig.processor.force_flush() is True
    assert [(v.action_id, v.rule) for v in rig.found] == [("a2", "invalid-field")]
    rig.close()


# == instrumentation API ====================================================================


def test_idempotency_key_is_stable_and_shaped() -> None:
    key = idempotency_key("trip-42", "a07")
    assert key == idempotency_key("trip-42", "a07")
    assert key.startswith("ds1-") and len(key) == 36
    assert key != idempotency_key("trip-42", "a08") != idempotency_key("trip-42", "a07", scope="x")


# Keys as released versions computed them. They must never change: a process upgraded in
# the middle of a session has to send the far side the same key again, or it is charged twice.
KNOWN_KEYS = [
    (("trip-42", "a07", ""), "ds1-ldgs7brkeo577tr445haxxbzwe7rm44j"),
    (("trip-42", "a07", "x"), "ds1-ep56dhmn5hbdfs427lnlwpu6jo3daonk"),
    (("s-1", "a2", ""), "ds1-l74ky6j5nqaama3lsqztalfki7mc2nv2"),
    (("s", "a", "payments"), "ds1-fr2avnrb72lgxujccnz6jet34okepfdt"),
    (("s", "a126387", ""), "ds1-6ighg3o52hmc2dtnuoedke2445773462"),
    (("", "", ""), "ds1-xde6iqhk2po2zt34y7uhtvisujrsoitq"),
    (("é\udcff", "日本", ""), "ds1-2zsjsxdvdun7mrza4pogcecdquuk2qj4"),
]


@pytest.mark.parametrize(("identity", "key"), KNOWN_KEYS)
def test_idempotency_keys_of_ordinary_identities_never_change(
    identity: tuple[str, str, str], key: str
) -> None:
    session_id, action_id, scope = identity
    assert idempotency_key(session_id, action_id, scope=scope) == key


def test_idempotency_key_whose_digits_read_as_an_epoch_is_not_time_derived() -> None:
    """docs/processor.md: our keys are never mistaken for a timestamp by
    ``time-derived-key``. Base32 digits are 2-7, so about one key in a million holds a run
    of ten that reads as an epoch second between 2000 and 2100; this identity's key ends
    in ``2445773462``. The key is a hash of the identity and must not be flagged."""
    key = idempotency_key("s", "a126387")
    assert key.endswith("2445773462")
    record = {
        "session_id": "s",
        "action_id": "a126387",
        "kind": "payment",
        "status": "ok",
        "idempotency_key": key,
    }
    assert time_component(key) is None
    assert "time-derived-key" not in [v.rule for v in Checker().feed(record)]


@pytest.mark.parametrize(
    "key",
    [
        "pay-2445773462",
        "ds1-6ighg3o52hmc2dtnuoedke2445773462-retry",  # more than the derived format
        "ds1-ighg3o52hmc2dtnuoedke2445773462",  # one character short
        "DS1-6IGHG3O52HMC2DTNUOEDKE2445773462",  # not what idempotency_key() writes
        "ds1-2024-05-01aaaaaaaaaaaaaaaaaaaaa",
    ],
)
def test_keys_that_only_resemble_the_derived_format_are_still_checked_for_time(key: str) -> None:
    """Only a key in exactly the format ``idempotency_key()`` produces is exempt."""
    assert time_component(key) is not None


def test_identities_with_separator_characters_get_distinct_keys() -> None:
    """Session, action and scope are joined with ``\\x1f`` before hashing; a part holding
    that character must not make two identities one: ``("a\\x1fb", "c")`` and
    ``("a", "b\\x1fc")`` would otherwise share a key, and the far side would take the
    second action's effect for a retry of the first."""
    assert idempotency_key("a\x1fb", "c") != idempotency_key("a", "b\x1fc")
    assert idempotency_key("s", "a", scope="x\x1fy") != idempotency_key("y", "a", scope="x")
    key = idempotency_key("a\x1fb", "c")
    assert re.fullmatch(r"ds1-[a-z2-7]{32}", key) and time_component(key) is None


identity_part = st.text(alphabet="a1:\x1f", max_size=6)


def _key(scope: str, session_id: str, action_id: str) -> str:
    return idempotency_key(session_id, action_id, scope=scope)


@settings(max_examples=300, deadline=None)
@given(st.tuples(identity_part, identity_part, identity_part), st.data())
def test_identities_that_join_to_the_same_text_get_distinct_keys(
    identity: tuple[str, str, str], data: st.DataObject
) -> None:
    """The identity ``(scope, session, action)`` is re-cut at two other separators of its
    ``\x1f``-joined text: a different identity that a plain join cannot tell apart. Its
    key must differ (parts are made of the separator, a digit, ``:`` and a letter, the
    characters an encoding of the parts could confuse)."""
    joined = "\x1f".join(identity)
    separators = [i for i, char in enumerate(joined) if char == "\x1f"]
    first, second = sorted(
        data.draw(st.lists(st.sampled_from(separators), min_size=2, max_size=2, unique=True))
    )
    other = (joined[:first], joined[first + 1 : second], joined[second + 1 :])
    assume(other != identity)
    assert _key(*identity) != _key(*other)


@settings(max_examples=300, deadline=None)
@given(
    st.tuples(identity_part, identity_part, identity_part),
    st.tuples(identity_part, identity_part, identity_part),
)
def test_different_identities_never_share_a_key(
    first: tuple[str, str, str], second: tuple[str, str, str]
) -> None:
    """Any two distinct identities over those characters: distinct keys."""
    assume(first != second)
    assert _key(*first) != _key(*second)


def test_nested_sessions_threads_and_tasks() -> None:
    rig = Rig()
    seen: dict[str, Any] = {}
    try:
        with session("outer"):
            with session("inner"):
                rig.span("n-inner")
            rig.span("n-outer")
            with rig.tracer.start_as_current_span("parent") as parent:
                parent_context = trace_api.set_span_in_context(parent)

                def in_thread() -> None:
                    rig.span("plain-thread")  # no copied context: nothing to copy from
                    with rig.tracer.start_as_current_span("explicit-parent", context=parent_context):
                        pass

                thread = threading.Thread(target=in_thread)
                thread.start()
                thread.join()
                contextvars.copy_context().run(
                    lambda: threading.Thread(target=rig.span, args=("copied",)).run()
                )

            async def main() -> None:
                async def task() -> None:
                    rig.span("task")

                await asyncio.gather(asyncio.create_task(task()))

            asyncio.run(main())
        for span in rig.exporter.get_finished_spans():
            seen[span.name] = (span.attributes or {}).get(sc.SESSION_ID)
    finally:
        rig.close()
    assert seen == {
        "n-inner": "inner",
        "n-outer": "outer",
        "plain-thread": None,
        "explicit-parent": "outer",
        "copied": "outer",
        "parent": "outer",
        "task": "outer",
    }


def test_action_exception_propagates_unchanged_and_marks_error() -> None:
    rig = Rig()
    error = ValueError("boom")
    with pytest.raises(ValueError) as raised, action("a1", "tool_call", tracer_provider=rig.provider):
        raise error
    assert raised.value is error
    (span,) = rig.exporter.get_finished_spans()
    assert span.attributes[sc.ACTION_STATUS] == "error"
    assert span.status.status_code is StatusCode.ERROR
    rig.close()


def test_action_decorator_sync_and_async_records_return_value() -> None:
    rig = Rig()

    @action(lambda x: f"sync-{x}", "external_read", tracer_provider=rig.provider)
    def read(x: int) -> dict[str, int]:
        return {"x": x}

    @action(lambda x: f"async-{x}", "llm_call", tracer_provider=rig.provider)
    async def call(x: int) -> list[int]:
        await asyncio.sleep(0)
        return [x]

    assert read(1) == {"x": 1}
    assert asyncio.run(call(2)) == [2]
    spans = {s.attributes[sc.ACTION_ID]: s.attributes for s in rig.exporter.get_finished_spans()}
    assert spans["sync-1"][sc.ACTION_RESULT] == '{"x":1}'
    assert spans["async-2"][sc.ACTION_RESULT] == "[2]"
    assert rig.rules() == []
    rig.close()


def test_record_of_unserialisable_value_does_not_raise() -> None:
    rig = Rig()
    loop: list[Any] = []
    loop.append(loop)
    with action("a1", "llm_call", tracer_provider=rig.provider) as act:
        assert act.record(loop) is loop
        nan = float("nan")  # (an integer past 64 bits is valid JSON, and recorded: test_instrument_edges)
        assert act.record(nan) is nan
        assert act.recorded is False
    assert rig.rules() == ["unrecorded-result"]
    rig.close()


def test_one_action_object_entered_by_two_asyncio_tasks_ends_each_tasks_own_span() -> None:
    """An ``action`` object may be entered by several tasks at once (one created at module
    level, say). Each ``with`` block must end the span it started: the task that raises
    gets ``status=error`` on its own span, and the other task's span ends ok."""
    rig = Rig()
    shared = action("x", "tool_call", tracer_provider=rig.provider)
    spans: dict[str, Any] = {}

    async def job(name: str, fail: bool, delay: float) -> None:
        try:
            with shared as act:
                spans[name] = act.span
                await asyncio.sleep(delay)
                if fail:
                    raise ValueError("boom")
        except ValueError:
            pass

    async def main() -> None:
        await asyncio.gather(job("failing", True, 0.01), job("fine", False, 0.05))

    asyncio.run(main())
    rig.close()
    assert {name: span.status.status_code for name, span in spans.items()} == {
        "failing": StatusCode.ERROR,
        "fine": StatusCode.UNSET,
    }
    assert {name: span.attributes.get(sc.ACTION_STATUS) for name, span in spans.items()} == {
        "failing": "error",
        "fine": None,
    }
    assert all(not span.is_recording() for span in spans.values())


def test_one_action_object_entered_by_two_threads_ends_each_threads_own_span() -> None:
    """The same with threads: the first thread enters, the second enters, the first leaves
    with an exception, then the second leaves normally."""
    rig = Rig()
    shared = action("x", "tool_call", tracer_provider=rig.provider)
    spans: dict[str, Any] = {}
    # Each step waits for the one before: with fixed sleeps and short waits, a loaded
    # machine could run them in another order (the second entering first), testing nothing.
    first_entered, second_entered, first_left = threading.Event(), threading.Event(), threading.Event()
    waited: list[bool] = []

    def first() -> None:
        with contextlib.suppress(ValueError), shared as act:
            spans["failing"] = act.span
            first_entered.set()
            waited.append(second_entered.wait(GENEROUS_S))
            raise ValueError("boom")
        first_left.set()

    def second() -> None:
        with shared as act:
            spans["fine"] = act.span
            second_entered.set()
            waited.append(first_left.wait(GENEROUS_S))

    pool = [threading.Thread(target=first), threading.Thread(target=second)]
    pool[0].start()
    assert first_entered.wait(GENEROUS_S)
    pool[1].start()
    for thread in pool:
        thread.join(GENEROUS_S)
    rig.close()
    assert waited == [True, True]
    assert {name: span.status.status_code for name, span in spans.items()} == {
        "failing": StatusCode.ERROR,
        "fine": StatusCode.UNSET,
    }


def test_one_action_object_reentered_in_one_task_ends_the_inner_span_first() -> None:
    rig = Rig()
    shared = action("x", "tool_call", tracer_provider=rig.provider)
    with shared as outer:
        with shared as inner:
            assert inner.span is not outer.span
        assert not inner.span.is_recording() and outer.span.is_recording()
    assert not outer.span.is_recording()
    assert len(rig.exporter.get_finished_spans()) == 2
    rig.close()


# == offline checker CLI ======================================================================


def test_replay_check_output_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "a.jsonl"
    log.write_text("# c\n\nnot json\n[1]\n" + action_line(kind="payment") + "\n")
    code, out, _ = run_replay_check(["--actions", str(log)], capsys)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("line 3 [?]: ") and lines[1].startswith("line 4 [?]: ")
    assert lines[2].startswith("line 5 [a]: side-effecting kind 'payment'")
    assert lines[3] == "" and lines[4] == "replay-check FAIL: 3 violation(s) in 3 action(s)"
    code, _, _ = run_replay_check(["--actions", str(tmp_path)], capsys)
    assert code == 2


def test_check_exit_codes_and_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    code, _, err = run_cli(["check", str(empty)], capsys)
    assert code == 0 and "no actions found" in err
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(
        b"\xef\xbb\xbf" + action_line().encode() + b"\r\n" + action_line(action_id="b").encode()
    )
    assert run_cli(["check", str(clean)], capsys)[0] == 0
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x00\x01\xff\xfe\n" + action_line(x="?").encode().replace(b"?", b"\xff") + b"\n")
    code, out, _ = run_cli(["check", str(garbage)], capsys)
    assert code == 1 and f"{garbage}:1:" in out and f"{garbage}:2:" in out and "not valid UTF-8" in out
    code, _, err = run_cli(["check", str(tmp_path)], capsys)
    assert code == 2 and "Is a directory" in err
    code, _, err = run_cli(["check", str(clean), str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and "missing.jsonl" in err
    with pytest.raises(SystemExit) as usage:  # argparse: usage errors exit 2
        cli.main(["check", "--jobs", "0", str(clean)])
    assert usage.value.code == 2
    capsys.readouterr()
    assert run_cli(["check", "--disable", "no-such-rule", str(clean)], capsys)[0] == 2
    assert run_cli(["explain", "no-such-rule"], capsys)[0] == 2
    assert run_cli(["explain", "unkeyed-side-effect"], capsys)[0] == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(action_line(kind="payment").encode())))
    code, out, _ = run_cli(["check", "-"], capsys)
    assert code == 1 and out.startswith("<stdin>:1:")


def test_long_lines_are_reported_and_reading_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "long.jsonl"
    log.write_text(action_line(pad="x" * 5000) + "\n" + action_line(action_id="b", kind="payment") + "\n")
    code, out, _ = run_cli(["check", "--max-line-bytes", "1000", str(log)], capsys)
    assert code == 1
    assert f"{log}:1: error[unreadable-line]" in out and "longer than 1000 bytes" in out
    assert f"{log}:2: error[unkeyed-side-effect]" in out


def test_json_and_sarif_output_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "with space.jsonl"
    log.write_text("oops\n" + action_line(kind="payment") + "\n")
    code, out, _ = run_cli(["check", "--format", "json", str(log)], capsys)
    document = json.loads(out)
    assert code == 1 and document["ok"] is False and document["actions"] == 2
    assert {v["rule"] for v in document["violations"]} == {"unreadable-line", "unkeyed-side-effect"}
    code, out, _ = run_cli(["check", "--format", "sarif", str(log)], capsys)
    sarif = json.loads(out)
    assert code == 1 and sarif["version"] == "2.1.0" and "$schema" in sarif
    (run,) = sarif["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert len({r["id"] for r in rules}) == len(rules)
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note", "none")
        assert result["message"]["text"]
        physical = result["locations"][0]["physicalLocation"]
        assert physical["artifactLocation"]["uri"].startswith("file://")
        assert " " not in physical["artifactLocation"]["uri"]
        assert physical["region"]["startLine"] >= 1


def test_jobs_give_the_same_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = []
    for i in range(400):
        sid = ["s1", "s\\u00e9", "é", 's"q', ""][i % 5]
        lines.append(
            f'{{"session_id":"{sid}","action_id":"a{i % 37}","kind":"{["payment", "llm_call", "tool_call"][i % 3]}",'
            f'"status":"{["ok", "started", "error"][i % 3]}"}}'
        )
        if i % 50 == 0:
            lines.append("# comment\r")
            lines.append("\xff")
    log = tmp_path / "many.jsonl"
    log.write_bytes(("\n".join(lines)).encode("utf-8", "surrogateescape").replace(b"\xc3\xbf", b"\xff"))
    one = run_cli(["check", "--jobs", "1", str(log)], capsys)
    three = run_cli(["check", "--jobs", "3", str(log)], capsys)
    assert one[0] == three[0] == 1
    assert one[1] == three[1]


def test_tracing_log_is_detected(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["check", str(TRACING_LOG)], capsys)
    assert code == 1 and "3 error(s)" in out and "unrecorded-result" in out


def test_tracing_log_with_bom_is_detected_as_tracing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/readers.md: a UTF-8 BOM at the very start of a file is ignored, and the first
    line that is neither blank nor a comment decides the format. A tracing log saved with
    a BOM is therefore checked as a tracing log, with the same findings as without it (as
    an action log, every event would be ``missing-field`` errors)."""
    with_bom = tmp_path / "demo-bom.jsonl"
    with_bom.write_bytes(UTF8_BOM + TRACING_LOG.read_bytes())
    _, plain, _ = run_cli(["check", str(TRACING_LOG)], capsys)
    code, out, _ = run_cli(["check", str(with_bom)], capsys)
    assert code == 1
    assert "missing-field" not in out
    assert out.replace(str(with_bom), "F") == plain.replace(str(TRACING_LOG), "F")


def test_bom_before_a_comment_line_is_ignored_in_detection(tmp_path: Path) -> None:
    """The BOM is ignored before a comment too: the line after it decides."""
    log = tmp_path / "commented.jsonl"
    log.write_bytes(UTF8_BOM + b"# exported by a tool\n" + TRACING_LOG.read_bytes())
    with log.open("rb") as source:
        assert sniff_format(source, str(log), 1 << 20) == "tracing"
        assert source.tell() == 0


def _otlp_json_line(result: str) -> bytes:
    def attribute(key: str, value: str) -> dict[str, Any]:
        return {"key": key, "value": {"stringValue": value}}

    span = {
        "traceId": "0af7651916cd43dd8448eb211c80319c",
        "spanId": "b7ad6b7169203331",
        "name": "charge",
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001000000000",
        "attributes": [
            attribute(sc.SESSION_ID, "trip-7"),
            attribute(sc.ACTION_ID, "a1"),
            attribute(sc.ACTION_KIND, "payment"),
            attribute(sc.ACTION_RESULT, result),
        ],
    }
    request = {
        "resourceSpans": [
            {
                "resource": {"attributes": [attribute("service.instance.id", "run-1")]},
                "scopeSpans": [{"scope": {"name": "t"}, "spans": [span]}],
            }
        ]
    }
    return json.dumps(request).encode() + b"\n"


def test_otlp_json_file_with_bom_is_detected_and_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An OTLP/JSON trace file with a BOM is detected as OTLP/JSON and its spans are
    checked as without the BOM (one unkeyed payment, at line 1)."""
    plain, with_bom = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_bytes(_otlp_json_line('{"charged": 2400}'))
    with_bom.write_bytes(UTF8_BOM + plain.read_bytes())
    code, expected, _ = run_cli(["check", str(plain)], capsys)
    assert code == 1 and "unkeyed-side-effect" in expected
    code, out, _ = run_cli(["check", str(with_bom)], capsys)
    assert code == 1
    assert out.replace(str(with_bom), "F") == expected.replace(str(plain), "F")


def test_otlp_json_span_result_beyond_a_double_is_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The offline OTLP/JSON reader maps spans as the processor does: a ``1e999`` result
    is JSON text, not an ``invalid-field``."""
    trace = tmp_path / "big.json"
    trace.write_bytes(_otlp_json_line("1e999"))
    _, out, _ = run_cli(["check", str(trace)], capsys)
    assert "invalid-field" not in out and "unkeyed-side-effect" in out


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_parse_object_never_raises(raw: bytes) -> None:
    value = parse_object(raw)
    assert isinstance(value, dict | str)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=40), st.just(action_line().encode())), max_size=15))
def test_check_never_raises_on_garbage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[bytes]
) -> None:
    log = tmp_path / "fuzz.jsonl"
    log.write_bytes(b"\n".join(lines))
    code, out, _ = run_cli(["check", str(log)], capsys)
    assert code in (0, 1)
    assert "durable-sessions OK" in out or "durable-sessions FAIL" in out
    assert not math.isnan(len(out))


def test_each_missing_field_is_its_own_violation_with_its_own_key() -> None:
    # A store (the sidecar's) keeps one violation per key: two fields missing on one span
    # must be two keys. The first keeps the key it always had, so a store written by an
    # earlier version does not see it as new.
    from durable_sessions.engine import Checker
    from durable_sessions.record import span_location
    from durable_sessions.rules import select_rules

    where = span_location("a" * 32, "b" * 16)
    violations = Checker(select_rules()).feed({"session_id": "s", "status": "ok"}, where)
    assert [v.rule for v in violations] == ["missing-field", "missing-field"]
    assert violations[0].key == f"s|missing-field|None|{'b' * 16}"
    assert violations[1].key == violations[0].key + "#1"


@pytest.mark.parametrize(
    ("arguments", "environment"),
    [
        ({"key_window_s": -1}, {}),
        ({"key_window_s": float("nan")}, {}),
        ({"key_window_s": "86400"}, {}),
        ({"log_limit_per_minute": 0}, {}),
        ({}, {"DURABLE_SESSIONS_KEY_WINDOW_S": "nan"}),
        ({}, {"DURABLE_SESSIONS_KEY_WINDOW_S": "-5"}),
    ],
)
def test_unusable_window_and_log_limit_are_configuration_errors(
    arguments: dict[str, Any], environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/processor.md: an unusable value raises ConfigurationError at setup, never later.
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError):
        DurabilitySpanProcessor(**arguments)


def test_the_window_variable_takes_fractional_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the CLI's --key-window-s and the sidecar's evaluation.key_window_s do.
    monkeypatch.setenv("DURABLE_SESSIONS_KEY_WINDOW_S", "0.5")
    processor = DurabilitySpanProcessor()
    assert processor.checker is not None and processor.checker.key_window_s == 0.5
    processor.shutdown()


def test_an_otlp_span_delivered_again_later_is_read_once_also_in_the_next_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A retried Export can bring a span back after a later record of the same action, and
    # the Collector's file exporter may have rotated to the next file meanwhile. Judged as
    # a new record, the repeat would be a duplicate action id and, its status being
    # "started", an unfinished side effect.
    def request(span_id: str, status: str, start: int) -> str:
        return otlp_mail_request("ab" * 16, span_id, status, start)

    first, second = tmp_path / "traces-1.jsonl", tmp_path / "traces-2.jsonl"
    started, done = (
        request("01" * 8, "started", 1_700_000_000_000_000_000),
        request("02" * 8, "ok", 1_700_000_001_000_000_000),
    )
    first.write_text(started + "\n" + done + "\n")
    second.write_text(started + "\n")  # the first Export, retried
    code, out, _ = run_cli(["check", "--format", "json", str(first), str(second)], capsys)
    assert code == 0, out
    assert json.loads(out)["actions"] == 2


def otlp_mail_request(trace_id: str, span_id: str, status: str, start: int) -> str:
    """One OTLP/JSON request line holding one span of the keyed email ``mail`` of session ``r``."""
    attributes = {
        "session.id": "r",
        "agent.action.id": "mail",
        "agent.action.kind": "email",
        "agent.action.status": status,
        "agent.action.idempotency_key": "mail-r",
    }
    span = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": "mail",
        "startTimeUnixNano": str(start),
        "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attributes.items()],
    }
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_otlp_span_of_an_action_s_last_span_id_in_another_trace_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    # A span id is unique within its trace only: the same id in another trace is another
    # span (the email sent again), as the sidecar judges it. The engine, which remembers
    # an action's last span id but not its trace, took it for the first span delivered
    # again and skipped it; exact repeats (same trace, span and status) are still read once.
    path = tmp_path / "traces.jsonl"
    first = otlp_mail_request("ab" * 16, "07" * 8, "ok", 1_700_000_000_000_000_000)
    other = otlp_mail_request("cd" * 16, "07" * 8, "ok", 1_700_000_001_000_000_000)
    path.write_text("\n".join([first, first, other, other, first]) + "\n")
    code, out, _ = run_cli(["check", "--format", "json", "--jobs", jobs, str(path)], capsys)
    report = json.loads(out)
    assert code == 1, out
    assert report["actions"] == 2
    assert [(v["rule"], v["line"]) for v in report["violations"]] == [("duplicate-action-id", 3)]
