"""``durable_sessions.instrument`` at its edges: generator actions, exceptions that are not
errors, results JSON cannot hold as orjson writes them, attribute length limits, and
identities of the wrong type."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import inspect
import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from durable_sessions import semconv as sc
from durable_sessions.instrument import FileResultStore, action, idempotency_key, resource, session
from durable_sessions.journal import SqliteJournal
from durable_sessions.processor import DurabilitySpanProcessor
from durable_sessions.violation import Violation


class Env:
    """A real SDK provider: spans to memory, and the durability processor's findings."""

    def __init__(self, limits: SpanLimits | None = None, *, strict: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.violations: list[Violation] = []
        self.provider = TracerProvider(resource=resource(), span_limits=limits)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.processor = DurabilitySpanProcessor(
            mode="silent", strict=strict, on_violation=self.violations.append
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("test")

    def spans(self, name_prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(name_prefix)]

    def action_span(self) -> ReadableSpan:
        (only,) = [s for s in self.spans() if sc.ACTION_ID in (s.attributes or {})]
        return only

    def rules(self) -> list[str]:
        return [v.rule for v in self.violations]


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.provider.shutdown()


def current_span_name() -> str | None:
    span = trace_api.get_current_span()
    return getattr(span, "name", None) if span.is_recording() else None


# -- decorated generator functions ---------------------------------------------------------


def test_decorated_functions_keep_their_kind() -> None:
    """Frameworks dispatch on inspect's predicates (a streaming endpoint on
    ``isasyncgenfunction``): the decorated function must stay what it was."""
    decorate = action("a", "llm_call")

    def plain() -> int:
        return 1

    async def coroutine() -> int:
        return 1

    def generator() -> Iterator[int]:
        yield 1

    async def async_generator() -> AsyncIterator[int]:
        yield 1

    predicates = (inspect.iscoroutinefunction, inspect.isgeneratorfunction, inspect.isasyncgenfunction)
    for func in (plain, coroutine, generator, async_generator):
        decorated = decorate(func)
        assert [p(decorated) for p in predicates] == [p(func) for p in predicates], func.__name__
        assert decorated.__name__ == func.__name__ and decorated.__wrapped__ is func


def test_decorated_generator_runs_inside_its_span(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """A streaming call: the span lasts from the first item to the end of the stream, is
    the current span inside the body (its HTTP span is a child) but not in the consumer's
    code between items, carries the session, and the generator object is not taken for
    the result."""
    seen_in_body: list[str | None] = []

    @action(lambda prompt: f"stream-{prompt}", "tool_call", tracer_provider=env.provider)
    def stream(prompt: str) -> Iterator[str]:
        for chunk in ("Hel", "lo"):
            with env.tracer.start_as_current_span("http"):
                pass
            seen_in_body.append(current_span_name())
            yield chunk

    seen_by_consumer: list[str | None] = []
    with session("s-stream"):
        chunks = []
        for chunk in stream("hi"):
            seen_by_consumer.append(current_span_name())
            chunks.append(chunk)
    assert chunks == ["Hel", "lo"]
    assert seen_in_body == ["tool_call stream-hi"] * 2
    assert seen_by_consumer == [None, None]
    span = env.action_span()
    assert span.attributes[sc.SESSION_ID] == "s-stream"
    assert span.status.status_code is StatusCode.UNSET
    assert sc.ACTION_STATUS not in span.attributes
    assert sc.ACTION_RESULT not in span.attributes  # nothing recorded on our behalf
    https = env.spans("http")
    assert len(https) == 2
    assert all(h.parent is not None and h.parent.span_id == span.context.span_id for h in https)
    assert all(span.start_time <= h.start_time and h.end_time <= span.end_time for h in https)
    assert "not JSON-serialisable" not in caplog.text
    assert env.rules() == []


def test_decorated_generator_failing_mid_stream_is_an_error(env: Env) -> None:
    @action("stream", "llm_call", tracer_provider=env.provider)
    def stream() -> Iterator[str]:
        yield "Hel"
        raise error

    error = ConnectionResetError("connection reset mid-stream")
    got: list[str] = []
    with pytest.raises(ConnectionResetError) as raised, session("s"):
        got.extend(stream())
    assert raised.value is error
    span = env.action_span()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[sc.ACTION_STATUS] == "error"
    assert [event.name for event in span.events] == ["exception"]


def test_decorated_generator_passes_send_throw_and_return_through(env: Env) -> None:
    @action("echo", "tool_call", tracer_provider=env.provider)
    def echo() -> Iterator[Any]:
        received = []
        while True:
            try:
                value = yield current_span_name()
            except KeyError as error:  # handled by the body: the action goes on
                received.append(f"caught {error.args[0]}")
                continue
            if value is None:
                return received
            received.append(value)

    def run() -> list[str]:
        return (yield from echo())  # type: ignore[no-any-return]

    outer = run()
    assert next(outer) == "tool_call echo"
    assert outer.send("a") == "tool_call echo"
    assert outer.throw(KeyError("k")) == "tool_call echo"
    with pytest.raises(StopIteration) as stop:
        outer.send(None)
    assert stop.value.value == ["a", "caught k"]
    assert env.action_span().status.status_code is StatusCode.UNSET


def test_decorated_generator_closed_early_ends_normally_inside_its_span(env: Env) -> None:
    """A consumer that breaks out: the body's cleanup runs inside the span, which ends
    then, as a normal end (GeneratorExit is not a failure)."""
    cleanup_in: list[str | None] = []

    @action("search", "tool_call", tracer_provider=env.provider)
    def search() -> Iterator[str]:
        try:
            yield from ("hit1", "hit2", "hit3")
        finally:
            cleanup_in.append(current_span_name())

    with session("s"):
        for _hit in search():
            break
    assert cleanup_in == ["tool_call search"]
    span = env.action_span()
    assert span.status.status_code is StatusCode.UNSET
    assert sc.ACTION_STATUS not in span.attributes


def test_decorated_generator_resumed_in_another_thread(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """The generator's context goes with it: a thread that resumes and closes it runs the
    body in the span and ends it without a context detached in the wrong place."""

    @action("gen", "tool_call", tracer_provider=env.provider)
    def gen() -> Iterator[str | None]:
        yield current_span_name()
        yield current_span_name()

    with session("s-thread"):
        stream = gen()
        first = next(stream)
    seen: list[str | None] = []

    def resume() -> None:
        seen.append(next(stream))
        stream.close()

    thread = threading.Thread(target=resume)
    thread.start()
    thread.join()
    assert [first, *seen] == ["tool_call gen"] * 2
    span = env.action_span()
    assert span.attributes[sc.SESSION_ID] == "s-thread" and span.end_time is not None
    assert "Failed to detach context" not in caplog.text


# -- decorated async generator functions -----------------------------------------------------


def test_decorated_async_generator_runs_inside_its_span(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    @action("astream", "tool_call", tracer_provider=env.provider)
    async def astream() -> AsyncIterator[str | None]:
        for _ in range(2):
            await asyncio.sleep(0.01)

            async def fetch() -> None:  # a task started in the body: a child of the action
                with env.tracer.start_as_current_span("http"):
                    pass

            await asyncio.create_task(fetch())
            yield current_span_name()

    async def main() -> tuple[list[str | None], list[str | None]]:
        in_body, in_consumer = [], []
        with session("s-async"):
            async for name in astream():
                in_body.append(name)
                in_consumer.append(current_span_name())
        return in_body, in_consumer

    in_body, in_consumer = asyncio.run(main())
    assert in_body == ["tool_call astream"] * 2
    assert in_consumer == [None, None]
    span = env.action_span()
    assert span.attributes[sc.SESSION_ID] == "s-async"
    assert (span.end_time - span.start_time) >= 20_000_000  # open across both sleeps
    assert all(h.parent is not None and h.parent.span_id == span.context.span_id for h in env.spans("http"))
    assert "not JSON-serialisable" not in caplog.text
    assert env.rules() == []


def test_decorated_async_generator_failure_asend_athrow_and_aclose(env: Env) -> None:
    @action(lambda n: f"a{n}", "tool_call", tracer_provider=env.provider)
    async def numbers(n: int) -> AsyncIterator[Any]:
        sent = yield n
        yield sent
        raise ValueError(f"boom {n}")

    async def main() -> None:
        one = numbers(1)
        assert await one.__anext__() == 1
        assert await one.asend("sent") == "sent"
        with pytest.raises(ValueError, match="boom 1"):
            await one.__anext__()
        two = numbers(2)
        await two.__anext__()
        with pytest.raises(KeyError):
            await two.athrow(KeyError("thrown in"))
        three = numbers(3)
        await three.__anext__()
        await three.aclose()

    asyncio.run(main())
    spans = {s.attributes[sc.ACTION_ID]: s for s in env.spans()}
    assert {k: s.status.status_code for k, s in spans.items()} == {
        "a1": StatusCode.ERROR,
        "a2": StatusCode.ERROR,
        "a3": StatusCode.UNSET,
    }
    assert spans["a1"].attributes[sc.ACTION_STATUS] == "error"
    assert sc.ACTION_STATUS not in spans["a3"].attributes


def test_async_generator_left_open_is_closed_once_inside_its_span(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncio.run closes the async generators still open when it ends; the decorated one
    closes the body itself, in the span, and the loop must not close the body as well."""
    cleanup_in: list[str | None] = []

    @action("left-open", "tool_call", tracer_provider=env.provider)
    async def endless() -> AsyncIterator[int]:
        try:
            while True:
                yield 1
        finally:
            await asyncio.sleep(0)
            cleanup_in.append(current_span_name())

    kept: list[Any] = []

    async def main() -> None:
        stream = endless()
        kept.append(stream)
        await stream.__anext__()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert cleanup_in == ["tool_call left-open"]
    assert "already running" not in caplog.text
    assert env.action_span().end_time is not None


# -- exceptions that are not errors ----------------------------------------------------------


def test_generator_exit_from_an_early_break_is_not_a_failure() -> None:
    """A generator that runs an action and whose consumer takes only the first item: the
    action is not failed, so no dead-end and no disguised retry loop."""
    strict = Env(strict=True)

    def search(i: int) -> Iterator[str]:
        with action(f"search-{i}", "tool_call", name="search", tracer_provider=strict.provider) as act:
            act.record(["hit1", "hit2"])
            yield from ("hit1", "hit2")

    with session("s1"):
        for i in range(5):
            for _hit in search(i):
                break
    strict.processor.end_sessions()
    assert {s.status.status_code for s in strict.spans()} == {StatusCode.UNSET}
    assert all(sc.ACTION_STATUS not in s.attributes for s in strict.spans())
    assert strict.rules() == []
    strict.provider.shutdown()


class Unprintable(Exception):
    """An exception whose text cannot be made (a library's bug, a lazy message that fails)."""

    def __str__(self) -> str:
        raise RuntimeError("no text")

    __repr__ = __str__


def test_an_exception_whose_text_fails_still_marks_the_action_failed(env: Env) -> None:
    """Its ``str()`` raising inside the marking left the span without ``status=error`` and
    with status UNSET: the failed action read as a success to the rules and the exporter."""

    @action("fetch", "external_read", tracer_provider=env.provider)
    def fetch() -> None:
        raise Unprintable()

    with pytest.raises(Unprintable), session("s"):
        fetch()
    span = env.action_span()
    assert span.attributes[sc.ACTION_STATUS] == "error"
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description.startswith("Unprintable: ")


def test_arguments_of_the_wrong_type_fail_open(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An action id no journal can key (a list, from a callable id that returned one) and a
    digest that is not text: logged or reported, never an exception in the agent's code."""

    @action(lambda order: order["lines"], "external_read", tracer_provider=env.provider)
    def lines(order: dict[str, Any]) -> int:
        return len(order["lines"])

    journal = SqliteJournal(tmp_path / "journal.db")
    with caplog.at_level(logging.ERROR, logger="durable_sessions"), session("s", journal=journal):
        assert lines({"lines": ["a", "b"]}) == 2
        with action("ref", "external_read", tracer_provider=env.provider) as act:
            act.record_ref("s3://bucket/result.json", digest=b"sha256:00")  # type: ignore[arg-type]
    assert "is not journaled" in caplog.text
    assert "missing-field" in env.rules()


class Detached:
    """A value whose text cannot be made: an ORM row read after its session closed."""

    def __str__(self) -> str:
        raise RuntimeError("instance is not bound to a session")

    __repr__ = __str__


def test_an_id_or_field_whose_text_fails_fails_open(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK makes an attribute value of no attribute type its ``str()``; that raising
    inside the span's start (or ``act.set``, ``act.record_ref``) raised into the agent,
    and a decorated payment never ran. The value is left off the span (said at warning
    level, naming the field), as the SDK leaves off one it cannot make text of, the
    action runs, and the rules report what is missing."""
    charged: list[int] = []
    journal = SqliteJournal(tmp_path / "journal.db")

    @action(lambda amount: Detached(), "payment", tracer_provider=env.provider)
    def charge_without_id(amount: int) -> int:
        charged.append(amount)
        return amount

    @action("p2", "payment", idempotency_key=Detached(), tracer_provider=env.provider)
    def charge_without_key(amount: int) -> int:
        charged.append(amount)
        return amount

    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s", journal=journal):
        assert charge_without_id(10) == 10  # and not journaled: no id to key its entry
        assert charge_without_key(20) == 20
        with action("r1", "llm_call", tracer_provider=env.provider) as act:
            act.set(retryable=Detached(), attempts=2)
            act.record_ref(Detached())  # type: ignore[arg-type]
    assert charged == [10, 20]
    assert [s.name for s in env.spans()] == ["payment <unprintable Detached>", "payment p2", "llm_call r1"]
    assert [sorted(k for k in s.attributes if k.startswith("agent.action.")) for s in env.spans()] == [
        [sc.ACTION_KIND, sc.ACTION_RESULT, sc.ACTION_RESULT_DIGEST],
        [sc.ACTION_ID, sc.ACTION_KIND, sc.ACTION_RESULT, sc.ACTION_RESULT_DIGEST],
        [sc.ACTION_ATTEMPTS, sc.ACTION_ID, sc.ACTION_KIND],
    ]
    for field in (sc.ACTION_ID, sc.ACTION_IDEMPOTENCY_KEY, sc.ACTION_RETRYABLE, sc.ACTION_RESULT_REF):
        assert f"{field} is left off the span" in caplog.text
    assert "action id <unprintable Detached> is a Detached, which cannot key a journal entry" in caplog.text
    assert [entry.action_id for entry in journal.entries("s")] == ["p2", "r1"]
    assert sorted(env.rules()) == ["missing-field", "unkeyed-side-effect", "unrecorded-result"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt("^C"), SystemExit(0)])
def test_interrupted_action_is_started_not_failed(env: Env, interruption: BaseException) -> None:
    """KeyboardInterrupt and SystemExit are not errors of the action (OpenTelemetry does
    not record them either), but the action did not finish: ``started``, never ``ok``."""

    @action("pay", "payment", tracer_provider=env.provider, idempotency_key="k")
    def pay() -> None:
        raise interruption

    with pytest.raises(type(interruption)) as raised, session("s"):
        pay()
    assert raised.value is interruption
    span = env.action_span()
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes[sc.ACTION_STATUS] == "started"
    assert span.events == ()


def test_cancelled_action_is_started_and_its_unkeyed_effect_unresolved(env: Env) -> None:
    @action("charge", "payment", tracer_provider=env.provider)
    async def charge() -> None:
        await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(charge())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with session("s-cancel"):
        asyncio.run(main())
    span = env.action_span()
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes[sc.ACTION_STATUS] == "started"
    assert env.rules() == []  # not an unkeyed *completed* payment, nor a failure
    env.processor.end_sessions()  # ends the session: the effect may or may not have happened
    assert env.rules() == ["unresolved-side-effect"]


def test_interruption_after_the_outcome_is_recorded_leaves_it_ok(env: Env) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        session("s"),
        action("a1", "llm_call", tracer_provider=env.provider) as act,
    ):
        act.record("done")
        raise KeyboardInterrupt
    with pytest.raises(SystemExit), action("a2", "tool_call", tracer_provider=env.provider) as act:
        act.set(status="ok")
        raise SystemExit(0)
    statuses = {s.attributes[sc.ACTION_ID]: s.attributes.get(sc.ACTION_STATUS) for s in env.spans()}
    assert statuses == {"a1": None, "a2": "ok"}
    assert {s.status.status_code for s in env.spans()} == {StatusCode.UNSET}


# -- results JSON cannot hold as orjson writes them ------------------------------------------


class Level(enum.Enum):
    TOP = float("inf")


@dataclasses.dataclass
class Score:
    value: float


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        {"score": float("nan")},
        [1.0, float("inf")],
        {"deep": [{"x": -float("inf")}]},
        {float("nan"): "key"},
        Score(float("nan")),
        Level.TOP,
    ],
)
def test_nan_and_infinity_are_refused_not_recorded_as_null(
    env: Env, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider) as act:
        assert act.record(value) is value
        assert act.recorded is False
        act.record({"answer": None, "text": "null"})  # null itself is a value
        assert act.recorded is True
    assert "NaN and Infinity" in caplog.text
    assert json.loads(env.action_span().attributes[sc.ACTION_RESULT]) == {"answer": None, "text": "null"}


@pytest.mark.parametrize(
    "value",
    [
        {1: "the int", "1": "the text"},
        {"plan": [{True: "yes", "true": "also yes"}]},
        {None: 0, "null": 1},
        {uuid.UUID(int=1): "uuid", "00000000-0000-0000-0000-000000000001": "text"},
    ],
)
def test_a_dictionary_whose_keys_share_a_text_is_refused(
    env: Env, caplog: pytest.LogCaptureFixture, value: Any
) -> None:
    """Keys become text in JSON; two keys with one text were written twice, and reading the
    record back (a journal's replay) kept only the last: a replay silently lost an entry."""
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider) as act:
        assert act.record(value) is value
        assert act.recorded is False
    assert "not JSON-serialisable" in caplog.text and "share the text" in caplog.text
    assert sc.ACTION_RESULT not in env.action_span().attributes


@pytest.mark.parametrize(
    "value",
    [
        {"wei": 10**20, "b": [2**64, -(2**63) - 1]},
        2**200,
        "nest",
    ],
)
def test_valid_json_orjson_refuses_is_recorded_canonically(env: Env, value: Any) -> None:
    if value == "nest":  # deeper than orjson's limit
        value = {"z": 1, "a": []}
        inner = value["a"]
        for _ in range(300):
            inner.append([])
            inner = inner[0]
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider) as act:
        act.record(value)
        assert act.recorded is True
    attributes = env.action_span().attributes
    text = attributes[sc.ACTION_RESULT]
    assert json.loads(text) == value
    assert text == json.dumps(value, sort_keys=True, separators=(",", ":"))
    assert attributes[sc.ACTION_RESULT_DIGEST] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert env.rules() == []


# -- the span's attribute length limit -------------------------------------------------------


def test_result_not_shorter_than_the_attribute_limit_goes_to_the_store(tmp_path: Path) -> None:
    """Under ``SpanLimits(max_span_attribute_length=4096)`` (the SDK cuts longer values,
    and the rules read one exactly at the limit as cut) a result is inline only when its
    JSON is shorter than 4096 characters; otherwise it is stored by reference."""
    limited = Env(SpanLimits(max_span_attribute_length=4096))
    values = {length: "y" * (length - 2) for length in (4095, 4096, 10_000)}  # quotes count
    with session("s"):
        for length, value in values.items():
            store = FileResultStore(tmp_path)
            with action(
                f"a{length}", "llm_call", tracer_provider=limited.provider, result_store=store
            ) as act:
                act.record(value)
    where = {}
    for span in limited.spans():
        attributes = span.attributes
        length = int(attributes[sc.ACTION_ID][1:])
        if sc.ACTION_RESULT in attributes:
            where[length] = "inline"
            assert json.loads(attributes[sc.ACTION_RESULT]) == values[length]
        else:
            where[length] = "store"
            stored = Path(attributes[sc.ACTION_RESULT_REF].removeprefix("file://"))
            assert json.loads(stored.read_bytes()) == values[length]
    assert where == {4095: "inline", 4096: "store", 10_000: "store"}
    limited.processor.end_sessions()
    assert limited.rules() == []
    limited.provider.shutdown()


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="fills the disk with RLIMIT_FSIZE")
def test_a_result_the_disk_has_no_room_for_leaves_no_partial_file(tmp_path: Path) -> None:
    """A full disk fails the result store (logged, not recorded, the agent goes on); the
    part it managed to write, under a temporary name no one would ever read or remove,
    stayed behind, taking the room the disk lacked."""
    script = textwrap.dedent(
        """
        import resource, signal, sys
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.instrument import FileResultStore, action, session
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail, nothing kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        store = FileResultStore(sys.argv[1])
        with session("s"), action("big", "llm_call", tracer_provider=TracerProvider(), result_store=store) as act:
            act.record("x" * 100_000)
        print("recorded" if act.recorded else "not recorded")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "results")], capture_output=True, text=True, timeout=60
    )
    assert done.stdout == "not recorded\n", done.stderr
    assert "could not record the result of action 'big'" in done.stderr
    assert [path.name for path in (tmp_path / "results").rglob("*") if path.is_file()] == []


def test_attribute_limit_from_the_environment_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4096")
    limited = Env()
    with (
        session("s"),
        action(
            "a1", "llm_call", tracer_provider=limited.provider, result_store=FileResultStore(tmp_path)
        ) as act,
    ):
        act.record({"text": "y" * 10_000})
    attributes = limited.action_span().attributes
    assert sc.ACTION_RESULT not in attributes and attributes[sc.ACTION_RESULT_REF].startswith("file://")
    limited.processor.end_sessions()
    assert limited.rules() == []
    limited.provider.shutdown()


# -- identities --------------------------------------------------------------------------------


@pytest.mark.parametrize("session_id", [uuid.UUID(int=7), 42, None, b"s-1"])
def test_session_id_that_is_not_a_str_is_a_type_error(session_id: Any) -> None:
    with pytest.raises(TypeError, match=r"session\(\): session_id must be a str"), session(session_id):
        pass


class SessionName(enum.StrEnum):
    TRIP = "trip-42"


def test_session_id_of_a_str_subclass_is_its_text(env: Env) -> None:
    with session(SessionName.TRIP), action("a1", "tool_call", tracer_provider=env.provider):
        pass
    value = env.action_span().attributes[sc.SESSION_ID]
    assert value == "trip-42" and type(value) is str


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        (("s", 7), {}, "action_id"),
        ((None, "a"), {}, "session_id"),
        ((uuid.UUID(int=7), "a"), {}, "session_id"),
        (("s", "a"), {"scope": None}, "scope"),
    ],
)
def test_idempotency_key_names_the_argument_that_is_not_a_str(
    args: tuple[Any, ...], kwargs: dict[str, Any], argument: str
) -> None:
    with pytest.raises(TypeError, match=rf"idempotency_key\(\): {argument} must be a str"):
        idempotency_key(*args, **kwargs)
    assert idempotency_key(SessionName.TRIP, "a07") == idempotency_key("trip-42", "a07")


def test_a_future_done_on_a_closed_loop_is_given_back_and_its_action_ended(env: Env) -> None:
    """A Future settled on an event loop since closed takes no done callback (its loop
    cannot schedule one: RuntimeError). The action it ends is ended at once, with its
    result, and the Future given back: the callback's error was raised into the caller."""
    loop = asyncio.new_event_loop()
    settled = loop.create_future()
    settled.set_result({"rate": 1.08})
    loop.close()

    rate = action("r1", "external_read", tracer_provider=env.provider)(lambda: settled)
    assert rate() is settled
    assert env.action_span().attributes[sc.ACTION_RESULT] == '{"rate":1.08}'
