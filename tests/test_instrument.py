"""``durable_sessions.instrument``: actions, sessions, keys and the incarnation resource."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from durable_sessions import semconv as sc
from durable_sessions.digest import digest_value
from durable_sessions.instrument import (
    FileResultStore,
    action,
    current_session,
    idempotency_key,
    incarnation,
    resource,
    session,
)
from durable_sessions.processor import DurabilitySpanProcessor
from durable_sessions.rules.record_rules import time_component
from durable_sessions.violation import Violation


class Env:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.violations: list[Violation] = []
        self.provider = TracerProvider(resource=resource())
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(
            DurabilitySpanProcessor(mode="silent", on_violation=self.violations.append)
        )

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def span(self) -> ReadableSpan:
        (only,) = self.spans()
        return only


@pytest.fixture
def env() -> Iterator[Env]:
    e = Env()
    yield e
    e.provider.shutdown()


def test_action_context_manager_records_result_and_digest(env: Env) -> None:
    with session("s-1"), action("a1", "llm_call", tracer_provider=env.provider, name="gpt") as act:
        assert act.record({"text": "hi", "n": 1}) == {"text": "hi", "n": 1}
    span = env.span()
    assert span.name == "gpt"
    attributes = span.attributes
    assert attributes[sc.ACTION_ID] == "a1"
    assert attributes[sc.ACTION_KIND] == "llm_call"
    assert attributes[sc.ACTION_NAME] == "gpt"
    assert attributes[sc.SESSION_ID] == "s-1"
    assert json.loads(attributes[sc.ACTION_RESULT]) == {"text": "hi", "n": 1}
    assert attributes[sc.ACTION_RESULT_DIGEST] == digest_value({"n": 1, "text": "hi"})
    assert env.violations == []


def test_fields_become_attributes_as_given(env: Env) -> None:
    key = idempotency_key("s-1", "a7")
    with (
        session("s-1"),
        action(
            "a7", "payment", tracer_provider=env.provider, idempotency_key=key, retryable=True, max_attempts=3
        ) as act,
    ):
        act.set(attempts=1)
        act.record({"charge": "ch_1"})
    attributes = env.span().attributes
    assert attributes[sc.ACTION_IDEMPOTENCY_KEY] == key
    assert attributes[sc.ACTION_RETRYABLE] is True
    assert attributes[sc.ACTION_MAX_ATTEMPTS] == 3
    assert attributes[sc.ACTION_ATTEMPTS] == 1
    assert env.violations == []


def test_record_none_is_recorded(env: Env) -> None:
    with session("s"), action("a1", "clock", tracer_provider=env.provider) as act:
        act.record(None)
    assert env.span().attributes[sc.ACTION_RESULT] == "null"
    assert env.violations == []


def test_unrecorded_llm_call_is_reported(env: Env) -> None:
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider):
        pass
    assert [v.rule for v in env.violations] == ["unrecorded-result"]


def test_exception_sets_error_status_and_propagates(env: Env) -> None:
    with (
        pytest.raises(ValueError, match="card declined"),
        session("s"),
        action("a7", "payment", tracer_provider=env.provider, idempotency_key="k-s-a7"),
    ):
        raise ValueError("card declined")
    span = env.span()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[sc.ACTION_STATUS] == "error"
    assert any(event.name == "exception" for event in span.events)


def test_large_result_goes_to_the_store_by_reference(env: Env, tmp_path: Path) -> None:
    store = FileResultStore(tmp_path)
    big = {"rows": ["x" * 100] * 100}
    with (
        session("s/1"),
        action(
            "a1", "external_read", tracer_provider=env.provider, result_store=store, max_result_chars=1000
        ) as act,
    ):
        act.record(big)
    attributes = env.span().attributes
    assert sc.ACTION_RESULT not in attributes
    ref = attributes[sc.ACTION_RESULT_REF]
    assert ref.startswith("file://")
    path = Path(ref.removeprefix("file://"))
    assert path.is_relative_to(tmp_path)
    assert json.loads(path.read_bytes()) == big
    assert attributes[sc.ACTION_RESULT_DIGEST] == digest_value(big)
    assert env.violations == []


def test_unserialisable_result_is_logged_and_left_unrecorded(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider) as act:
        value = object()
        assert act.record(value) is value
    assert "not JSON-serialisable" in caplog.text
    assert [v.rule for v in env.violations] == ["unrecorded-result"]


def test_broken_store_fails_open(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def put(self, session_id: str | None, action_id: str, data: bytes) -> str:
            raise OSError("disk full")

    with (
        session("s"),
        action(
            "a1", "llm_call", tracer_provider=env.provider, result_store=Broken(), max_result_chars=1
        ) as act,
    ):
        act.record([1, 2, 3])
    assert "disk full" in caplog.text
    assert [v.rule for v in env.violations] == ["unrecorded-result"]


def test_record_ref(env: Env) -> None:
    with session("s"), action("a1", "llm_call", tracer_provider=env.provider) as act:
        act.record_ref("blob://s/a1.json", digest="sha256:" + "0" * 64)
    attributes = env.span().attributes
    assert attributes[sc.ACTION_RESULT_REF] == "blob://s/a1.json"
    assert env.violations == []


# -- decorator -------------------------------------------------------------------------


def test_decorator_records_the_return_value(env: Env) -> None:
    @action(lambda city: f"weather-{city}", "external_read", tracer_provider=env.provider)
    def weather(city: str) -> dict[str, Any]:
        return {"city": city, "temp": 12}

    with session("s"):
        assert weather("kyoto") == {"city": "kyoto", "temp": 12}
        assert weather("osaka")["city"] == "osaka"
    ids = [span.attributes[sc.ACTION_ID] for span in env.spans()]
    assert ids == ["weather-kyoto", "weather-osaka"]
    assert env.violations == []


def test_decorator_on_failure(env: Env) -> None:
    @action("a1", "tool_call", tracer_provider=env.provider, retryable=False, on_failure="ask_user")
    def visa_check() -> None:
        raise RuntimeError("visa service down")

    with pytest.raises(RuntimeError, match="visa service down"), session("s"):
        visa_check()
    assert env.span().attributes[sc.ACTION_STATUS] == "error"


def test_a_failed_first_attempt_uses_up_a_cap_of_one(env: Env) -> None:
    """The instrumentation writes no attempts on a first attempt: the checker counts it as
    attempt 1, so a retryable action with max_attempts 1 that fails has used its cap up."""

    @action("a5", "tool_call", tracer_provider=env.provider, retryable=True, max_attempts=1)
    def book() -> None:
        raise RuntimeError("upstream 503")

    with pytest.raises(RuntimeError, match="upstream 503"), session("s"):
        book()
    assert sc.ACTION_ATTEMPTS not in env.span().attributes
    env.provider.shutdown()  # the session ends: the end-of-session rules run
    assert [(v.rule, v.action_id) for v in env.violations] == [("retry-not-escalated", "a5")]
    assert "(1 of 1)" in env.violations[0].message


def test_async_decorator_and_tasks_inherit_the_session(env: Env) -> None:
    @action(lambda n: f"a{n}", "llm_call", tracer_provider=env.provider)
    async def think(n: int) -> str:
        await asyncio.sleep(0)
        return f"thought {n}"

    async def main() -> list[str]:
        with session("s-async"):
            return await asyncio.gather(*(asyncio.create_task(think(n)) for n in range(3)))

    assert asyncio.run(main()) == ["thought 0", "thought 1", "thought 2"]
    assert {span.attributes[sc.SESSION_ID] for span in env.spans()} == {"s-async"}
    assert env.violations == []


def test_callable_id_requires_the_decorator_form() -> None:
    with pytest.raises(TypeError, match="decorator form"), action(lambda: "x", "llm_call"):
        pass


# -- sessions --------------------------------------------------------------------------


def test_session_nests_and_restores() -> None:
    assert current_session() is None
    with session("outer"):
        assert current_session() == "outer"
        with session("inner"):
            assert current_session() == "inner"
        assert current_session() == "outer"
    assert current_session() is None


def test_session_crosses_threads_with_a_copied_context(env: Env) -> None:
    seen: list[str | None] = []

    def work() -> None:
        seen.append(current_session())
        with action("t1", "tool_call", tracer_provider=env.provider):
            pass

    with session("s-threads"):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(work,))
        thread.start()
        thread.join()
        plain = threading.Thread(target=lambda: seen.append(current_session()))
        plain.start()
        plain.join()
    assert seen == ["s-threads", None]  # a plain thread starts with an empty context
    assert env.span().attributes[sc.SESSION_ID] == "s-threads"


def test_a_block_exited_in_another_context_ends_its_span(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """An ``ExitStack`` entered by one task and closed by another (a fixture's set-up and
    tear-down) ends the block's span with its outcome, where it was left open for ever."""
    stack = contextlib.ExitStack()
    fetch = action("r1", "external_read", tracer_provider=env.provider)

    async def set_up() -> None:
        stack.enter_context(fetch).record({"rows": 3})

    async def tear_down() -> None:
        stack.close()

    async def run() -> None:
        await asyncio.create_task(set_up())
        await asyncio.create_task(tear_down())

    asyncio.run(run())
    assert json.loads(env.span().attributes[sc.ACTION_RESULT]) == {"rows": 3}
    assert "not entered in" not in caplog.text and "Failed to detach" not in caplog.text


def test_an_exit_in_another_context_with_several_blocks_open_ends_none(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Which of two open blocks a foreign exit means cannot be told: none is ended (and
    it says so), and each block's own exit still ends its own span."""
    fetch = action("r1", "external_read", tracer_provider=env.provider)
    first, second = contextvars.copy_context(), contextvars.copy_context()
    first.run(fetch.__enter__)
    second.run(fetch.__enter__)
    fetch.__exit__(None, None, None)  # in neither
    assert env.spans() == [] and "with 2 blocks open" in caplog.text
    first.run(fetch.__exit__, None, None, None)
    second.run(fetch.__exit__, None, None, None)
    assert len(env.spans()) == 2


# -- keys and incarnations ---------------------------------------------------------------


def test_idempotency_key_is_stable_and_distinct() -> None:
    key = idempotency_key("trip-42", "a07")
    assert key == idempotency_key("trip-42", "a07")
    assert key != idempotency_key("trip-42", "a08")
    assert key != idempotency_key("trip-4", "2a07")
    assert key != idempotency_key("trip-42", "a07", scope="refund")
    assert re.fullmatch(r"ds1-[a-z2-7]{32}", key)


def test_idempotency_key_is_the_same_in_another_process() -> None:
    code = "from durable_sessions.instrument import idempotency_key; print(idempotency_key('trip-42', 'a07'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == idempotency_key("trip-42", "a07")


def test_idempotency_keys_never_look_time_derived() -> None:
    for n in range(5000):
        key = idempotency_key(f"session-2026-11-{n}", f"{1764581640 + n}")
        assert time_component(key) is None, key


def test_resource_sets_one_incarnation_per_process() -> None:
    first = resource({"service.name": "agent"})
    assert first.attributes["service.instance.id"] == incarnation()
    assert resource().attributes["service.instance.id"] == incarnation()
    assert first.attributes["service.name"] == "agent"
    assert resource({"service.instance.id": "given"}).attributes["service.instance.id"] == "given"
    code = "from durable_sessions.instrument import incarnation; print(incarnation())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() != incarnation()


def test_the_incarnation_is_looked_up_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Resource.create`` runs every resource detector: not once per journaled action."""
    from durable_sessions import instrument

    created = []
    real_create = instrument.Resource.create
    monkeypatch.setattr(instrument, "_incarnation", None, raising=False)
    monkeypatch.setattr(
        instrument.Resource, "create", lambda *a, **k: created.append(1) or real_create(*a, **k)
    )
    assert incarnation() == incarnation() == incarnation()
    assert created == [1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_fresh_incarnation() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        os.write(write, incarnation().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.close(read)
    assert child and child != incarnation()


def test_resource_respects_otel_resource_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=from-env")
    assert resource().attributes["service.instance.id"] == "from-env"


def test_a_store_that_keeps_failing_is_logged_once_until_it_works_again(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A result directory on a read-only or full disk fails at every long result: one line,
    not one per result."""
    blocker = tmp_path / "results"
    blocker.write_text("not a directory")
    store = FileResultStore(blocker)
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s"):
        for n in range(20):
            with action(
                f"a{n}", "llm_call", tracer_provider=env.provider, result_store=store, max_result_chars=1
            ) as act:
                act.record([n, n])
        [failed] = [record.getMessage() for record in caplog.records]
        assert failed.startswith("durable_sessions: could not record the result of action 'a0'")
        assert "repeats of this error are not logged until the result store works again" in failed
        caplog.clear()
        blocker.unlink()
        with action(
            "b1", "llm_call", tracer_provider=env.provider, result_store=store, max_result_chars=1
        ) as act:
            act.record([1, 2])
    [recovered] = [record.getMessage() for record in caplog.records]
    assert f"the result store FileResultStore({str(blocker)!r}) works again (19 more results" in recovered
    assert act.result_ref is not None and act.result_ref.startswith("file://")
