"""``durable_sessions.journal`` with ``instrument.action``: record, replay, intents, doubt."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import enum
import functools
import gc
import hashlib
import inspect
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from durable_sessions import crash, instrument
from durable_sessions import semconv as sc
from durable_sessions.digest import digest_value, outcome_json
from durable_sessions.instrument import FileResultStore, action, current_session, resource, session
from durable_sessions.journal import (
    ActionInDoubt,
    AlreadyCompleted,
    AttemptsExhausted,
    Entry,
    SessionLive,
    SqliteJournal,
    loads_without_recursion,
    plan,
)
from durable_sessions.session_lock import SessionInUse

_REAL_INCARNATION = instrument.incarnation


@pytest.fixture(autouse=True)
def _own_incarnation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process of its own; :func:`restart` is undone afterwards."""
    monkeypatch.setattr(instrument, "incarnation", instrument.incarnation)
    restart()


def restart() -> None:
    """From here on, this test is the next process of the agent: a new incarnation
    (``service.instance.id``) for its spans and entries."""
    fresh = str(uuid.uuid4())
    instrument.incarnation = lambda: fresh  # type: ignore[assignment]


class Agent:
    """One process of an agent, as far as the instrumentation can tell: its own provider."""

    def __init__(self, journal: SqliteJournal) -> None:
        self.journal = journal
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=resource())
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.calls: list[str] = []

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def attributes(self, action_id: str) -> dict[str, Any]:
        (span,) = [s for s in self.spans() if s.attributes[sc.ACTION_ID] == action_id]
        return dict(span.attributes)

    def action(self, action_id: str, kind: str, **fields: Any) -> action:
        return action(action_id, kind, tracer_provider=self.provider, **fields)


@pytest.fixture
def journal(tmp_path: Path) -> SqliteJournal:
    return SqliteJournal(tmp_path / "state" / "journal.db")


def test_a_completed_action_is_replayed_not_run_again(journal: SqliteJournal) -> None:
    answers = iter([{"budget": 2400}, {"budget": 1800}])
    first, second = Agent(journal), Agent(journal)
    for agent in (first, second):
        restart()

        @agent.action("a01", "user_prompt")
        def ask(calls: list[str] = agent.calls) -> Any:
            calls.append("asked")
            return next(answers)

        with session("s-1", journal=journal):
            assert ask() == {"budget": 2400}
    assert first.calls == ["asked"] and second.calls == []
    replayed = second.attributes("a01")
    assert replayed[sc.ACTION_REPLAYED] is True
    assert replayed[sc.ACTION_RESULT_DIGEST] == first.attributes("a01")[sc.ACTION_RESULT_DIGEST]
    assert json.loads(replayed[sc.ACTION_RESULT]) == {"budget": 2400}
    assert sc.ACTION_REPLAYED not in first.attributes("a01")


def test_values_come_back_exactly_as_recorded(journal: SqliteJournal) -> None:
    value = {"big": 2**80, "float": 0.1, "text": "naïve ✓", "nested": [None, True, {"x": -1}]}
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            got = action("a01", "llm_call")(lambda: value)()
    assert got == value and type(got["big"]) is int


def test_the_context_manager_form_says_replayed_and_holds_the_result(journal: SqliteJournal) -> None:
    asked = []
    for _ in range(2):
        restart()
        with session("s-1", journal=journal), action("a01", "user_prompt") as act:
            answer = act.result if act.replayed else act.record(asked.append(1) or "aisle")
    assert answer == "aisle" and asked == [1]


def test_recording_again_in_a_replayed_block_is_no_replay(journal: SqliteJournal) -> None:
    """A block that ignores ``act.replayed`` ran the action again: its span must not say replayed."""
    agent = Agent(journal)
    for answer in ("aisle", "window"):
        restart()
        with session("s-1", journal=journal), agent.action("a01", "user_prompt") as act:
            act.record(answer)
    second = agent.spans()[1].attributes
    assert second[sc.ACTION_REPLAYED] is False
    assert json.loads(second[sc.ACTION_RESULT]) == "window"
    assert journal.get("s-1", "a01").outcome == "aisle"  # the record is the first outcome


def test_async_functions_are_replayed(journal: SqliteJournal) -> None:
    calls = []

    @action("a01", "external_read")
    async def fetch() -> int:
        calls.append(1)
        return 42

    async def run() -> int:
        restart()
        with session("s-1", journal=journal):
            return await fetch()

    assert asyncio.run(run()) == 42 and asyncio.run(run()) == 42
    assert calls == [1]


def test_a_write_ahead_entry_is_durable_before_the_body_runs(journal: SqliteJournal) -> None:
    seen = []

    @action("p1", "payment", idempotency_key="k-1")
    def pay() -> str:
        other = SqliteJournal(journal.path)  # another connection: what a new process would read
        seen.append(other.get("s-1", "p1"))
        return "paid"

    with session("s-1", journal=journal):
        pay()
    (entry,) = seen
    assert entry is not None and entry.status == "started" and entry.idempotency_key == "k-1"
    done = journal.get("s-1", "p1")
    assert done.status == "ok" and done.outcome == "paid" and done.result_digest == digest_value("paid")


def _started(journal: SqliteJournal, kind: str, **fields: Any) -> None:
    journal.put(Entry("s-1", "p1", kind, "started", 1, incarnation="dead", **fields))


def test_an_unkeyed_side_effect_in_doubt_is_not_repeated(journal: SqliteJournal) -> None:
    _started(journal, "payment")
    agent = Agent(journal)

    @agent.action("p1", "payment")
    def pay() -> None:
        agent.calls.append("charged")

    with session("s-1", journal=journal), pytest.raises(ActionInDoubt, match=r"journal\.resolve"):
        pay()
    assert agent.calls == []
    assert agent.attributes("p1")[sc.ACTION_STATUS] == "started"  # the trace shows the unresolved intent


def test_a_keyed_side_effect_in_doubt_runs_again_under_its_key(journal: SqliteJournal) -> None:
    _started(journal, "payment", idempotency_key="k-1")
    agent = Agent(journal)
    with session("s-1", journal=journal):
        agent.action("p1", "payment", idempotency_key="k-1")(lambda: "paid")()
    assert agent.attributes("p1")[sc.ACTION_ATTEMPTS] == 2
    assert journal.get("s-1", "p1").status == "ok"


class OrderKey(enum.StrEnum):
    CHARGE = "order-7-charge"


def test_a_key_given_as_a_str_subclass_is_journaled_as_its_text(journal: SqliteJournal) -> None:
    """A key that is text of a ``str`` subclass (a ``StrEnum`` member, a key type of the
    agent's own) is the key the span and the far side see: it was journaled as no key, so
    the payment cut short was in doubt "without an idempotency key" and never ran again."""
    first = Agent(journal)

    @first.action("p1", "payment", idempotency_key=OrderKey.CHARGE)
    def cut_short() -> None:
        raise KeyboardInterrupt  # killed mid-payment: did it go through?

    with session("s-1", journal=journal), pytest.raises(KeyboardInterrupt):
        cut_short()
    journaled = journal.get("s-1", "p1").idempotency_key
    assert journaled == "order-7-charge" and type(journaled) is str
    restart()
    second = Agent(journal)
    with session("s-1", journal=journal):
        assert second.action("p1", "payment", idempotency_key=OrderKey.CHARGE)(lambda: "paid")() == "paid"
    assert second.attributes("p1")[sc.ACTION_ATTEMPTS] == 2  # run again under its key
    assert journal.get("s-1", "p1").status == "ok"


def test_a_side_effect_in_doubt_under_another_key_is_not_repeated(journal: SqliteJournal) -> None:
    """A key made afresh in each process (a uuid4) cannot collapse the repeat: the journal
    knows the key the interrupted attempt used, and a resumed run under another is in doubt
    (a review found it charged again, and the new key replaced the journaled one)."""
    _started(journal, "payment", idempotency_key="order-7-first")
    agent = Agent(journal)

    @agent.action("p1", "payment", idempotency_key="order-7-second")
    def pay() -> None:
        agent.calls.append("charged")

    with session("s-1", journal=journal), pytest.raises(ActionInDoubt) as raised:
        pay()
    assert "'order-7-first'" in str(raised.value) and "'order-7-second'" in str(raised.value)
    assert "journal.resolve" in str(raised.value)
    assert agent.calls == []
    assert journal.get("s-1", "p1").idempotency_key == "order-7-first"


def test_a_side_effect_started_without_a_key_is_in_doubt_whatever_key_it_has_now(
    journal: SqliteJournal,
) -> None:
    _started(journal, "payment")
    with (
        session("s-1", journal=journal),
        pytest.raises(ActionInDoubt, match="started without an idempotency key"),
    ):
        action("p1", "payment", idempotency_key="k-now")(lambda: pytest.fail("ran"))()


def test_a_journaled_key_in_doubt_is_never_overwritten(journal: SqliteJournal) -> None:
    _started(journal, "payment", idempotency_key="k-1")
    journal.put(Entry("s-1", "p1", "payment", "started", 2, idempotency_key="k-2", incarnation="other"))
    kept = journal.get("s-1", "p1")
    assert (kept.idempotency_key, kept.attempts) == ("k-1", 2)
    # A settled attempt's key is no longer in doubt: the next attempt journals its own.
    journal.put(dataclasses.replace(kept, status="error"))
    journal.put(Entry("s-1", "p1", "payment", "started", 3, idempotency_key="k-3", incarnation="other"))
    assert journal.get("s-1", "p1").idempotency_key == "k-3"


def test_a_skippable_side_effect_in_doubt_is_stepped_over(journal: SqliteJournal) -> None:
    _started(journal, "email")
    agent = Agent(journal)

    @agent.action("p1", "email", replay="skip")
    def send() -> str:
        agent.calls.append("sent")
        return "sent"

    with session("s-1", journal=journal):
        assert send() is None
    assert agent.calls == []
    assert agent.attributes("p1")[sc.ACTION_STATUS] == "started"


def test_resolve_and_discard_settle_an_action_in_doubt(journal: SqliteJournal) -> None:
    _started(journal, "payment")
    journal.resolve("s-1", "p1", {"charged": 12})
    with session("s-1", journal=journal):
        assert action("p1", "payment")(lambda: pytest.fail("ran"))() == {"charged": 12}
    journal.discard("s-1", "p1")
    assert journal.get("s-1", "p1") is None
    with pytest.raises(KeyError, match="no action 'p1' of session 's-1'"):
        journal.discard("s-1", "p1")


def test_attempts_count_across_processes_up_to_the_cap(journal: SqliteJournal) -> None:
    def flaky() -> None:
        raise ConnectionError("down")

    attempts = []
    for _ in range(3):
        agent = Agent(journal)
        restart()
        with session("s-1", journal=journal), pytest.raises(ConnectionError):
            agent.action("t1", "tool_call", retryable=True, max_attempts=3)(flaky)()
        attempts.append(agent.attributes("t1").get(sc.ACTION_ATTEMPTS, 1))
    assert attempts == [1, 2, 3]
    with session("s-1", journal=journal), pytest.raises(AttemptsExhausted, match="used its 3 attempts"):
        action("t1", "tool_call", retryable=True, max_attempts=3)(flaky)()


def test_a_session_run_again_in_the_same_process_is_recovered(journal: SqliteJournal) -> None:
    """A server that runs a session's loop again after it failed, in the same process,
    must not ask or charge again: a completed action is replayed whichever process ran
    it (a review found a version that ran them again, unjournaled)."""
    agent = Agent(journal)

    @agent.action("q1", "user_prompt")
    def ask() -> dict[str, int]:
        agent.calls.append("asked")
        return {"budget": 2400}

    @agent.action("p1", "payment")
    def charge() -> dict[str, str]:
        agent.calls.append("charged")
        return {"charge": "ch_1"}

    def turn(fail: bool) -> None:
        with session("s-1", journal=journal):
            assert ask() == {"budget": 2400}
            assert charge() == {"charge": "ch_1"}
            if fail:
                raise RuntimeError("the model timed out")

    with pytest.raises(RuntimeError):
        turn(fail=True)
    turn(fail=False)  # the same process, the same session, again
    assert agent.calls == ["asked", "charged"]
    assert [span.attributes.get(sc.ACTION_REPLAYED) for span in agent.spans()][2:] == [True, True]


def test_a_side_effect_cancelled_in_this_process_is_in_doubt(journal: SqliteJournal) -> None:
    """A payment cut short by a timeout may have gone through, as one cut short by a
    crash: retried in the same process, it is in doubt, not charged again."""
    agent = Agent(journal)
    sent: list[int] = []

    @agent.action("p1", "payment")
    async def charge() -> dict[str, str]:
        sent.append(1)
        await asyncio.sleep(10)
        return {"charge": "ch_1"}

    async def run() -> None:
        with session("s-1", journal=journal):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(charge(), timeout=0.05)
            with pytest.raises(ActionInDoubt):
                await charge()

    asyncio.run(run())
    assert sent == [1]
    assert journal.get("s-1", "p1").status == "started"


def test_an_action_in_flight_in_this_process_is_no_action_in_doubt(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry by recursion meets its own ``started`` entry: nothing crashed, so nothing is
    in doubt; the outer call's completion, the inner one's outcome again, is no conflict."""
    agent = Agent(journal)

    @agent.action("p1", "payment", retryable=True, max_attempts=3)
    def pay(attempt: int = 1) -> dict[str, int]:
        agent.calls.append(str(attempt))
        return pay(attempt + 1) if attempt == 1 else {"charged": 2400}

    with session("s-1", journal=journal):
        assert pay() == {"charged": 2400}
    assert agent.calls == ["1", "2"]
    assert sorted(span.attributes.get(sc.ACTION_ATTEMPTS, 1) for span in agent.spans()) == [1, 2]
    assert journal.get("s-1", "p1").status == "ok"
    assert "completed by another run first" not in caplog.text


def test_an_action_still_in_flight_when_its_inner_retry_is_cut_short_is_no_action_in_doubt(
    journal: SqliteJournal,
) -> None:
    """An inner retry cancelled by a timeout left its entry ``started`` and, ending, took
    the action off the in-flight set although the outer run still ran it: the next retry
    from inside it raised ActionInDoubt, where the docs say an action this process is
    running, entered again, runs."""
    agent = Agent(journal)

    @agent.action("p1", "payment", retryable=True, max_attempts=5)
    async def pay(attempt: int = 1) -> dict[str, int]:
        agent.calls.append(str(attempt))
        if attempt == 1:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(pay(2), timeout=0.05)  # cut short mid-call
            return await pay(3)
        if attempt == 2:
            await asyncio.sleep(30)
        return {"charged": 2400}

    async def run() -> dict[str, int]:
        with session("s-1", journal=journal):
            return await pay()

    assert asyncio.run(run()) == {"charged": 2400}
    assert agent.calls == ["1", "2", "3"]
    assert journal.get("s-1", "p1").status == "ok"


def test_attempts_in_one_process_count_up_to_the_cap(journal: SqliteJournal) -> None:
    agent = Agent(journal)

    @agent.action("t1", "tool_call", retryable=True, max_attempts=3)
    def flaky() -> None:
        agent.calls.append("tried")
        raise ConnectionError("down")

    with session("s-1", journal=journal):
        for _ in range(3):
            with pytest.raises(ConnectionError):
                flaky()
        with pytest.raises(AttemptsExhausted, match="used its 3 attempts"):
            flaky()
    assert agent.calls == ["tried"] * 3
    assert [span.attributes.get(sc.ACTION_ATTEMPTS, 1) for span in agent.spans()] == [1, 2, 3]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_relative_journal_path_names_one_file_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal given a relative path opened it relative to the working directory of
    each connection: a forked child that changed directory (a daemon's chdir) reconnected
    to another, empty journal, and ran again what the parent had completed."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    journal = SqliteJournal("state/journal.db")
    with session("s-1", journal=journal):
        action("a1", "clock")(lambda: "09:00")()
    pid = os.fork()
    if pid == 0:  # the daemon: a new working directory, then the session goes on
        code = 1
        try:
            os.chdir(elsewhere)
            with session("s-1", journal=journal, exclusive=False):
                replayed = action("a1", "clock")(lambda: "10:00")()
                action("a2", "clock")(lambda: "10:01")()
            code = 0 if replayed == "09:00" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child replayed the parent's outcome
    assert journal.get("s-1", "a2").outcome == "10:01"  # and wrote to the same file
    assert not (elsewhere / "state").exists()
    assert journal.path == home / "state" / "journal.db"


def _child_completes(path: str) -> None:
    with session("s-1", journal=SqliteJournal(path)):
        action("w1", "external_read")(lambda: {"city": "Paris"})()


def test_what_a_forked_process_completed_is_replayed_here(
    journal: SqliteJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real processes, real incarnations: another process's entry is replayed here."""
    monkeypatch.setattr(instrument, "incarnation", _REAL_INCARNATION)
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_child_completes, args=(str(journal.path),))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    ran = []
    with session("s-1", journal=journal):
        assert action("w1", "external_read")(lambda: ran.append(1) or {"city": "Oslo"})() == {"city": "Paris"}
    assert ran == []


def _pay_in_a_worker(path: str) -> None:
    with session("s-1", journal=SqliteJournal(path)):
        action("a1", "payment")(lambda: {"charged": 5})()


def test_an_action_in_doubt_in_a_process_pool_worker_reaches_the_caller(journal: SqliteJournal) -> None:
    """Agents run sessions in process pools. An exception pickles as its message by
    default, which ActionInDoubt's constructor cannot take: unpickling it in the parent
    failed, the executor took that for a dead worker and broke the pool (BrokenProcessPool,
    every other worker killed midway), and ActionInDoubt never reached the caller."""
    journal.put(Entry("s-1", "a1", "payment", "started", idempotency_key="k-1"))
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        with pytest.raises(ActionInDoubt) as raised:
            pool.submit(_pay_in_a_worker, str(journal.path)).result(timeout=60)
        assert raised.value.entry == journal.get("s-1", "a1")
        assert raised.value.key_now is None and "'k-1'" in str(raised.value)
        assert pool.submit(os.getpid).result(timeout=60) != os.getpid()  # the pool still works


def test_attempts_exhausted_pickles_as_itself() -> None:
    entry = Entry("s-1", "a1", "llm_call", "error", 3)
    error = AttemptsExhausted(entry, 3)
    error.add_note("escalated to the on-call person")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.entry, copy.max_attempts, str(copy)) == (AttemptsExhausted, entry, 3, str(error))
    assert copy.__notes__ == ["escalated to the on-call person"]


def test_a_crash_loop_is_counted_by_the_write_ahead_entries(journal: SqliteJournal) -> None:
    journal.put(Entry("s-1", "a1", "llm_call", "started", 2))  # two processes died inside it
    assert plan(journal.get("s-1", "a1"), "llm_call", {}).attempts == 3
    with pytest.raises(AttemptsExhausted, match="never finished"):
        plan(journal.get("s-1", "a1"), "llm_call", {"max_attempts": 2})
    assert plan(journal.get("s-1", "a1"), "llm_call", {"max_attempts": True}).decision == "run"  # no int cap


def test_a_failed_action_is_journaled_as_an_error_and_the_exception_propagates(
    journal: SqliteJournal,
) -> None:
    with session("s-1", journal=journal), pytest.raises(ValueError, match="bad"), action("a1", "llm_call"):
        raise ValueError("bad")
    assert journal.get("s-1", "a1").status == "error"


def test_an_interrupted_action_stays_started(journal: SqliteJournal) -> None:
    with session("s-1", journal=journal), pytest.raises(KeyboardInterrupt), action("a1", "payment"):
        raise KeyboardInterrupt
    assert journal.get("s-1", "a1").status == "started"


def test_long_results_replay_by_reference(journal: SqliteJournal, tmp_path: Path) -> None:
    store = FileResultStore(tmp_path / "results")
    big = "x" * 100
    agents = [Agent(journal), Agent(journal)]
    for agent in agents:
        restart()
        with session("s-1", journal=journal):
            got = action(
                "a1", "llm_call", max_result_chars=10, result_store=store, tracer_provider=agent.provider
            )(lambda: big)()
        assert got == big
    first, second = (agent.attributes("a1") for agent in agents)
    assert second[sc.ACTION_RESULT_REF] == first[sc.ACTION_RESULT_REF]
    assert sc.ACTION_RESULT not in second


def test_a_failing_result_store_does_not_lose_the_journaled_outcome(
    journal: SqliteJournal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A result too long for the span, whose store fails (a read-only disk), was journaled
    ``ok`` without an outcome: the next process asked the person again. The journal keeps
    it; the span carries its digest, which counts as recorded."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the store wants a directory")
    store = FileResultStore(blocked / "results")
    answer = {"budget": "x" * 100}
    agents = [Agent(journal), Agent(journal)]
    for agent in agents:
        restart()

        @action("a1", "user_prompt", max_result_chars=10, result_store=store, tracer_provider=agent.provider)
        def ask(calls: list[str] = agent.calls) -> Any:
            calls.append("asked")
            return answer

        with caplog.at_level(logging.WARNING, "durable_sessions"), session("s-1", journal=journal):
            assert ask() == answer
    assert [agent.calls for agent in agents] == [["asked"], []]  # asked once, replayed after
    assert journal.get("s-1", "a1").outcome == answer
    first, second = (agent.attributes("a1") for agent in agents)
    assert first[sc.ACTION_RESULT_DIGEST] == second[sc.ACTION_RESULT_DIGEST] == digest_value(answer)
    assert second[sc.ACTION_REPLAYED] is True
    assert "the journal keeps the outcome" in caplog.text


def test_a_result_store_that_returns_no_text_fails_open_and_the_journal_keeps_the_outcome(
    journal: SqliteJournal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store of the agent's own that returns a ``Path`` where the protocol asks for a URI
    (text): the journal could not take it as the completed entry's ``result_ref``, so the
    payment that went through stayed ``started`` and the next process charged again. It is
    a store that failed: the journal keeps the outcome, the span carries its digest."""

    class PathStore:
        def put(self, session_id: str | None, action_id: str, data: bytes) -> Any:
            path = tmp_path / f"{action_id}.json"
            path.write_bytes(data)
            return path

    receipt = {"receipt": "r" * 100}
    agents = [Agent(journal), Agent(journal)]
    for agent in agents:
        restart()
        pay = agent.action(
            "p1", "payment", idempotency_key="k-1", max_result_chars=10, result_store=PathStore()
        )
        with caplog.at_level(logging.WARNING, "durable_sessions"), session("s-1", journal=journal):
            assert pay(lambda calls=agent.calls: calls.append("charged") or receipt)() == receipt
    assert [agent.calls for agent in agents] == [["charged"], []]  # charged once, replayed after
    assert journal.get("s-1", "p1").outcome == receipt
    assert sc.ACTION_RESULT_REF not in agents[0].attributes("p1")
    assert agents[0].attributes("p1")[sc.ACTION_RESULT_DIGEST] == digest_value(receipt)
    assert "returned a PosixPath, not a str" in caplog.text and "'p1'" in caplog.text


@pytest.mark.parametrize("how", ["path", "digest"])
def test_a_reference_or_digest_that_is_no_text_leaves_the_payment_completed(
    journal: SqliteJournal, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """``act.record_ref(path)`` with a ``Path``, or a digest given as an object, was
    journaled as it was: SQLite could not bind it in the completed entry, so the payment
    that went through stayed ``started`` and the next process found it in doubt. A
    reference must be text (it is not recorded otherwise, with a warning naming the action),
    and a digest that is no text stays off the journal."""
    receipt = tmp_path / "receipt.json"
    charged: list[str] = []

    def pay() -> Any:
        with action("p1", "payment") as act:
            if act.replayed:
                return "replayed"
            charged.append("charged")
            if how == "path":
                act.record_ref(receipt)  # type: ignore[arg-type]
            else:
                act.record_ref(receipt.as_uri(), digest=hashlib.sha256(b"receipt"))  # type: ignore[arg-type]
            return "charged"

    with caplog.at_level(logging.WARNING, "durable_sessions"):
        for _ in range(2):
            restart()
            with session("s-1", journal=journal):
                pay()
    assert charged == ["charged"]
    assert journal.get("s-1", "p1").status == "ok"
    if how == "path":
        assert "the reference of action 'p1' is a PosixPath, not a str URI; it is not recorded" in caplog.text
    else:
        assert journal.get("s-1", "p1").result_ref == receipt.as_uri()


class _CappedJournal(SqliteJournal):
    """A journal whose SQLite takes no string or BLOB above 1,000 bytes, as SQLite takes
    none above its SQLITE_MAX_LENGTH (1,000,000,000 by default): the same refusal without
    writing a gigabyte."""

    def _connected(self) -> sqlite3.Connection:
        connection = super()._connected()
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1000)
        return connection


@pytest.mark.parametrize(("kind", "runs"), [("payment", 1), ("llm_call", 2)])
def test_an_outcome_too_long_for_the_journal_completes_the_action_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, runs: int
) -> None:
    """The completed entry with its outcome did not fit: the entry stayed ``started``,
    and the payment that went through was in doubt for the next process (ActionInDoubt).
    It is completed without its outcome, as a value JSON cannot hold: a side effect is
    replayed as None, anything else runs again."""
    journal = _CappedJournal(tmp_path / "journal.db")
    receipt = {"lines": "x" * 5000}
    calls: list[str] = []
    for run in range(2):
        restart()
        with caplog.at_level(logging.WARNING, "durable_sessions"), session("s-1", journal=journal):
            got = action("p1", kind)(lambda: calls.append("ran") or receipt)()
        assert got == (None if run == 1 and kind == "payment" else receipt)
    assert len(calls) == runs
    entry = journal.get("s-1", "p1")
    assert (entry.status, entry.result, entry.result_digest) == ("ok", None, digest_value(receipt))
    assert "could not take the outcome of action 'p1'" in caplog.text
    assert "string or blob too big" in caplog.text and "actions run unjournaled" not in caplog.text


def test_a_result_no_span_can_carry_is_journaled_and_replayed(journal: SqliteJournal) -> None:
    """Text with a lone surrogate is JSON the journal keeps (and replays exactly), but no
    span attribute can carry it: it was journaled without an outcome and ran again."""
    calls: list[int] = []
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            got = action("a1", "llm_call")(lambda: calls.append(1) or "half \ud800 a pair")()
        assert got == "half \ud800 a pair"
    assert calls == [1]


def test_a_failing_result_store_without_a_journal_leaves_the_result_unrecorded(tmp_path: Path) -> None:
    """Without a journal nothing keeps the outcome: the span says nothing was recorded."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    agent = Agent(SqliteJournal(tmp_path / "unused.db"))
    with session("s-1"):
        agent.action("a1", "llm_call", max_result_chars=10, result_store=FileResultStore(blocked))(
            lambda: "x" * 100
        )()
    attributes = agent.attributes("a1")
    assert sc.ACTION_RESULT_DIGEST not in attributes and sc.ACTION_RESULT_REF not in attributes


def _nested(depth: int) -> Any:
    value: Any = {"leaf": 2**70}
    for level in range(depth):
        value = [value] if level % 2 else {"down": value, "level": level}
    return value


@pytest.mark.parametrize("depth", [900, 5000])
def test_an_outcome_nested_deeper_than_the_recursion_limit_is_replayed_whole(
    journal: SqliteJournal, depth: int, tmp_path: Path
) -> None:
    """An outcome is recorded at any depth, but the journal read it back with json.loads,
    which raised RecursionError short of 1,000 levels (the sooner the deeper the caller's
    stack): the action was replayed as None, and its function not run again."""
    deep = _nested(depth)
    calls: list[int] = []

    def replay_from_a_deep_stack(frames: int) -> Any:  # as a replay inside a framework's call stack
        if frames:
            return replay_from_a_deep_stack(frames - 1)
        with session("s-1", journal=journal):
            store = FileResultStore(tmp_path / "results")  # too long for a span, at 5,000 levels
            return action("a1", "llm_call", result_store=store)(lambda: calls.append(1) or deep)()

    def same(value: Any) -> bool:  # == recurses too: compare the JSON, keys in their order
        return outcome_json(value, in_order=True) == outcome_json(deep, in_order=True)

    assert same(replay_from_a_deep_stack(0))
    restart()
    assert same(replay_from_a_deep_stack(200))
    assert calls == [1]
    assert same(loads_without_recursion(journal.get("s-1", "a1").result.decode()))


@pytest.mark.parametrize(
    "text",
    [
        '{"b": [1, 2.5, -0.0, 1e400, -3E-2, 123456789012345678901234567890], "a": {}, "b": null}',
        ' [ "\\u00e9\\ud800\\n", true, false, null, [], [[{}]], {"x": [{"y": []}]} ] ',
        '"text"',
        "7",
        "[NaN, Infinity, -Infinity]",
    ],
)
def test_reading_without_recursion_reads_as_json_does(text: str) -> None:
    read = loads_without_recursion(text)
    assert repr(read) == repr(json.loads(text))  # values, types and key order alike


@pytest.mark.parametrize(
    "text", ["", "[1,]", "[1 2]", '{"a" 1}', "{1: 2}", "[1]]", "[", '{"a": 1,}', "tru", '["\x01"]']
)
def test_reading_without_recursion_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        loads_without_recursion(text)


def test_without_a_session_or_journal_nothing_is_journaled(journal: SqliteJournal) -> None:
    calls = []
    for _ in range(2):
        action("a1", "llm_call", journal=journal)(lambda: calls.append(1))()  # no session: no journal
        with session("s-1"):
            action("a1", "llm_call")(lambda: calls.append(1))()  # no journal
    assert calls == [1, 1, 1, 1]
    assert journal.entries("s-1") == []


def test_a_session_decorating_a_coroutine_function_holds_its_whole_run(journal: SqliteJournal) -> None:
    """``session(...)`` decorates, as a ``contextlib`` block does; on an ``async def`` the
    block closed as soon as the coroutine was made, before its body ran: the actions
    inside ran with no session, unjournaled, and a resumed process charged again. A
    generator function, whose body runs between its consumer's steps, is refused."""
    charges: list[int] = []

    @action("p1", "payment")
    async def pay(amount: int) -> dict[str, int]:
        charges.append(amount)
        return {"charged": amount}

    @session("s-1", journal=journal)
    async def trip() -> tuple[str | None, Any]:
        return current_session(), await pay(2400)

    for _ in range(2):
        restart()
        assert asyncio.run(trip()) == ("s-1", {"charged": 2400})
    assert charges == [2400]  # replayed from the journal by the second process
    assert inspect.iscoroutinefunction(trip)
    assert session("s-2")(current_session)() == "s-2"  # a plain function, as before
    with pytest.raises(TypeError, match="generator function"):
        session("s-3")(lambda: (yield))


def test_an_inner_session_keeps_the_outer_journal(journal: SqliteJournal) -> None:
    with session("outer", journal=journal), session("inner"):
        action("a1", "clock")(lambda: "09:00")()
    assert journal.get("inner", "a1").outcome == "09:00"


def test_generators_are_not_journaled(journal: SqliteJournal) -> None:
    """Generator and async generator functions alike: their items go to the consumer,
    so there is no outcome to replay, and a resumed process runs them again."""
    ran: list[str] = []

    @action("g1", "llm_call")
    def stream() -> Any:
        ran.append("g1")
        yield "a"
        yield "b"

    @action("g2", "email")
    async def stream_async() -> AsyncIterator[str]:
        ran.append("g2")
        yield "c"

    async def run() -> tuple[list[str], list[str]]:
        restart()
        with session("s-1", journal=journal):
            return list(stream()), [item async for item in stream_async()]

    assert asyncio.run(run()) == asyncio.run(run()) == (["a", "b"], ["c"])
    assert ran == ["g1", "g2", "g1", "g2"]
    assert journal.entries("s-1") == []


def test_a_broken_journal_fails_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    broken = SqliteJournal(blocker / "journal.db")  # its directory cannot be made
    with caplog.at_level(logging.ERROR, logger="durable_sessions"), session("s-1", journal=broken):
        assert action("a1", "llm_call")(lambda: 7)() == 7
    assert "could not read action 'a1' from the journal" in caplog.text


def test_a_journal_that_is_not_sqlite_fails_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"this is not a database" * 100)
    with (
        caplog.at_level(logging.ERROR, logger="durable_sessions"),
        session("s-1", journal=SqliteJournal(path)),
    ):
        assert action("a1", "llm_call")(lambda: 7)() == 7
    # Its writes fail with the read's error: not logged again (one line, not three per action).
    [read] = [record.getMessage() for record in caplog.records]
    assert read.startswith(f"could not read action 'a1' from the journal {path} (")  # no doubled prefix


def test_a_journal_that_keeps_failing_is_logged_once_until_it_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("not a directory")  # as a read-only or full file system, every call fails
    journal = SqliteJournal(blocker / "journal.db")
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1", journal=journal):
        assert [action(f"a{n}", "llm_call")(lambda n=n: n)() for n in range(50)] == list(range(50))
        [failed] = [record for record in caplog.records if record.levelno == logging.ERROR]
        assert failed.getMessage().startswith(f"could not read action 'a0' from the journal {journal.path} (")
        assert "repeats of this error are not logged until the journal works again" in failed.getMessage()
        caplog.clear()
        blocker.unlink()  # the disk is writable again: the next action is journaled, and that is said
        assert action("b1", "llm_call")(lambda: 7)() == 7
    assert journal.get("s-1", "b1") is not None and journal.get("s-1", "b1").status == "ok"
    [recovered] = caplog.records
    assert f"the journal {journal.path} works again (149 more failures" in recovered.getMessage()


def test_a_journal_that_reads_but_cannot_write_is_logged_once(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk: reads work, every write fails. A read that works ends no write failure."""
    journal.put(Entry("s-1", "seed", "clock", "ok"))
    journal.close()
    readonly = SqliteJournal(journal.path, readonly=True)
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1", journal=readonly):
        assert [action(f"a{n}", "llm_call")(lambda n=n: n)() for n in range(20)] == list(range(20))
    [failed] = caplog.records
    assert failed.getMessage().startswith(
        f"could not write action 'a0' (started) to the journal {journal.path} ("
    )


def test_entries_list_a_session_in_order(journal: SqliteJournal) -> None:
    with session("s-1", journal=journal):
        for action_id in ("b", "a", "c"):
            action(action_id, "clock")(lambda: 1)()
    assert [e.action_id for e in journal.entries("s-1")] == ["b", "a", "c"]
    assert all(e.status == "ok" and e.incarnation for e in journal.entries("s-1"))


def _child_records(path: str) -> None:
    with session("s-1", journal=SqliteJournal(path)):
        action("child", "clock")(lambda: "from the child")()


def test_a_forked_child_uses_its_own_connection(journal: SqliteJournal) -> None:
    with session("s-1", journal=journal):
        action("parent", "clock")(lambda: 1)()
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_child_records, args=(str(journal.path),))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert journal.get("s-1", "child").outcome == "from the child"


def test_the_file_is_wal_and_fully_synchronous(journal: SqliteJournal) -> None:
    journal.put(Entry("s-1", "a1", "clock", "ok", 1))
    connection = journal._connected()
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert connection.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert sqlite3.connect(journal.path).execute("SELECT count(*) FROM journal").fetchone()[0] == 1


def test_an_action_completed_without_a_recorded_outcome_runs_again(journal: SqliteJournal) -> None:
    """``record=False`` or a value JSON cannot hold leaves nothing to replay: returning
    ``None`` in its place would change what the agent sees."""
    calls = []
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            assert action("a1", "llm_call", record=False)(lambda: calls.append(1) or {"x": 1})() == {"x": 1}
            assert action("a2", "clock")(lambda: calls.append(2) or {1, 2})() == {1, 2}  # a set: not JSON
    assert calls == [1, 2, 1, 2]


def test_a_side_effect_completed_without_a_recorded_outcome_is_not_repeated(journal: SqliteJournal) -> None:
    calls = []
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            action("p1", "payment", idempotency_key="k", record=False)(lambda: calls.append(1) or "ch_1")()
    assert calls == [1]


def test_an_outcome_recorded_by_reference_is_replayed_with_its_reference(journal: SqliteJournal) -> None:
    agents = [Agent(journal), Agent(journal)]
    for agent in agents:
        restart()
        with session("s-1", journal=journal), agent.action("a1", "llm_call") as act:
            if not act.replayed:
                act.record_ref("s3://bucket/a1.json", digest="sha256:" + "0" * 64)
    # The block of the replay is told where the outcome is: the journal holds only that.
    assert (act.replayed, act.result, act.result_ref) == (True, None, "s3://bucket/a1.json")
    replayed = agents[1].attributes("a1")
    assert replayed[sc.ACTION_REPLAYED] is True
    assert replayed[sc.ACTION_RESULT_REF] == "s3://bucket/a1.json"
    assert replayed[sc.ACTION_RESULT_DIGEST] == "sha256:" + "0" * 64


def test_a_journal_row_that_does_not_read_fails_open(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    journal.put(Entry("s-1", "a1", "llm_call", "error", "three"))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="durable_sessions"), session("s-1", journal=journal):
        assert action("a1", "llm_call", max_attempts=3)(lambda: 5)() == 5
    assert "could not read action 'a1' from the journal" in caplog.text


@pytest.mark.parametrize(("kind", "replayed"), [("llm_call", "ran again"), ("payment", None)])
def test_an_outcome_that_does_not_read_is_no_outcome_to_replay(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture, kind: str, replayed: Any
) -> None:
    """An integer of 5,000 digits, recorded by a process that lifted Python's limit on
    integer text (sys.set_int_max_str_digits(0)), does not read in one that did not. It
    was replayed as None: the agent's code got None for a value it had computed. Now it
    is as an outcome not recorded: an action runs again, a side effect is replayed as None
    (never run twice)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with session("s-1", journal=journal):
            action("a1", kind)(lambda: 10**5000)()
    finally:
        sys.set_int_max_str_digits(limit)
    assert journal.get("s-1", "a1").result is not None  # type: ignore[union-attr]
    restart()
    with caplog.at_level(logging.WARNING, "durable_sessions"), session("s-1", journal=journal):
        assert action("a1", kind)(lambda: "ran again")() == replayed
    assert "the journal's outcome of action 'a1' does not read" in caplog.text
    assert "completed by another run first" not in caplog.text  # its row, not another run, kept it


@pytest.mark.parametrize(
    ("status", "fields"),
    [("ok", {}), ("started", {"side_effects": True, "replay": "skip"})],
    ids=["replayed", "skipped"],
)
def test_a_journal_row_whose_attempts_do_not_read_is_served_and_fails_open(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture, status: str, fields: dict[str, Any]
) -> None:
    """A row damaged or edited by hand whose attempts are no number: an action replayed
    or stepped over from it raised TypeError into the agent's code, from the comparison
    that sets the span's attempts. The journal's decision stands (never run again), and
    the attempts are counted as 1."""
    journal.put(Entry("s-1", "a1", "llm_call", status, "three", result=b'"seven"'))  # type: ignore[arg-type]
    agent = Agent(journal)
    with caplog.at_level(logging.ERROR, logger="durable_sessions"), session("s-1", journal=journal):
        done = agent.action("a1", "llm_call", **fields)(lambda: agent.calls.append("ran"))()
    assert agent.calls == []  # served from the journal, never run again
    assert done == ("seven" if status == "ok" else None)
    assert sc.ACTION_ATTEMPTS not in agent.attributes("a1")
    assert "counts 'three' attempts of action 'a1'" in caplog.text


def test_a_completed_action_that_runs_again_is_not_capped(journal: SqliteJournal) -> None:
    """An ``ok`` without a recorded outcome runs again; it used no failed attempt."""
    calls = []
    for _ in range(3):
        restart()
        with session("s-1", journal=journal):
            action("a1", "tool_call", record=False, max_attempts=1)(lambda: calls.append(1))()
    assert calls == [1, 1, 1]


def test_entries_keep_the_order_actions_were_first_journaled(journal: SqliteJournal) -> None:
    for action_id in ("a", "b"):
        journal.put(Entry("s-1", action_id, "clock", "started", 1))
    journal.put(Entry("s-1", "a", "clock", "ok", 1))  # a's completion, written after b's start
    assert [(e.action_id, e.status) for e in journal.entries("s-1")] == [("a", "ok"), ("b", "started")]
    assert [e.action_id for e in journal.entries(status="started")] == ["b"]


# -- durable-sessions journal ---------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from durable_sessions.cli import main

    code = main(["journal", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_journal_command_lists_and_settles_an_action_in_doubt(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    with session("s-1", journal=journal):
        action("a1", "user_prompt")(lambda: "aisle")()
    _started(journal, "payment")
    path = str(journal.path)
    code, out, _ = _cli(capsys, "list", path, "--status", "started")
    assert code == 0 and out.splitlines()[1].split() == ["s-1", "p1", "payment", "started", "1", "-", "-"]
    code, out, _ = _cli(capsys, "list", path, "--format", "json")
    listed = json.loads(out)
    assert [(e["action_id"], e["status"], e["result"]) for e in listed] == [
        ("a1", "ok", '"aisle"'),
        ("p1", "started", None),
    ]

    code, out, _ = _cli(capsys, "resolve", path, "s-1", "p1", '{"charged": 2400}')
    assert (code, out) == (0, "p1 of session s-1: ok, replayed from now on\n")
    with session("s-1", journal=journal):
        assert action("p1", "payment")(lambda: pytest.fail("charged twice"))() == {"charged": 2400}
    assert _cli(capsys, "discard", path, "s-1", "p1")[:2] == (0, "p1 of session s-1: forgotten, runs again\n")
    assert journal.get("s-1", "p1") is None


def test_the_journal_command_refuses_what_is_no_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    assert _cli(capsys, "list", str(missing))[0] == 2 and not missing.exists()  # no empty journal made
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.commit()
    code, _, err = _cli(capsys, "list", str(other))
    assert code == 2 and "is not a journal" in err
    text = tmp_path / "notes.txt"
    text.write_text("hello" * 100)
    assert _cli(capsys, "list", str(text))[0] == 2


def test_the_journal_command_s_errors(journal: SqliteJournal, capsys: pytest.CaptureFixture[str]) -> None:
    journal.put(Entry("s-1", "a1", "clock", "ok", 1))
    path = str(journal.path)
    code, _, err = _cli(capsys, "resolve", path, "s-1", "nope", "1")
    assert code == 1 and "no action 'nope' of session 's-1'" in err
    code, _, err = _cli(capsys, "resolve", path, "s-1", "a1", "{not json")
    assert code == 2 and "OUTCOME_JSON is not JSON" in err
    assert _cli(capsys, "list", path, "--session", "other")[1] == "no entries\n"


def test_resolve_refuses_a_completed_action_and_what_is_not_json(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    journal.put(Entry("s-1", "a1", "clock", "ok", 1, result=b'"09:00"'))
    _started(journal, "payment")
    path = str(journal.path)
    code, _, err = _cli(capsys, "resolve", path, "s-1", "a1", '"10:00"')
    assert code == 1 and "completed already" in err
    assert journal.get("s-1", "a1").outcome == "09:00"
    for bad in ("NaN", '{"a": -Infinity}', "[" * 5000):
        code, _, err = _cli(capsys, "resolve", path, "s-1", "p1", bad)
        assert code == 2 and "OUTCOME_JSON is not JSON" in err, bad
    with pytest.raises(ValueError, match="NaN and Infinity"):
        journal.resolve("s-1", "p1", float("nan"))
    with pytest.raises(ValueError, match="share the text '1'"):
        journal.resolve("s-1", "p1", {1: "a", "1": "b"})
    for not_json in ({"seat": {1, 2}}, b"receipt"):  # of no JSON type
        with pytest.raises(TypeError, match="not JSON serializable"):
            journal.resolve("s-1", "p1", not_json)
    assert journal.get("s-1", "p1").status == "started"  # nothing recorded
    assert journal.resolve("s-1", "p1", (None, 1)).outcome == [None, 1]  # a tuple with a null is no NaN


def test_resolve_gives_an_outcome_to_an_action_completed_without_one(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    """A payment whose receipt JSON could not hold is journaled ``ok`` without an outcome
    and replayed as None for ever; nothing recorded stands, so an operator who looked the
    receipt up records it (it was refused as completed, and discarding it charges again)."""
    with session("s-1", journal=journal):
        action("p1", "payment")(lambda: {"receipt": b"\x01"})()
    assert journal.get("s-1", "p1").status == "ok"
    assert journal.resolve("s-1", "p1", {"receipt": "r-1"}).outcome == {"receipt": "r-1"}
    restart()
    with session("s-1", journal=journal):
        assert action("p1", "payment")(lambda: pytest.fail("charged twice"))() == {"receipt": "r-1"}
    code, _, err = _cli(capsys, "resolve", str(journal.path), "s-1", "p1", '"r-2"')
    assert code == 1 and "completed already" in err  # now an outcome is recorded, and it stands


def test_the_refusal_of_a_recorded_outcome_says_what_discard_does(journal: SqliteJournal) -> None:
    """It said 'discard it first to record another', but a discarded action is gone from
    the journal, and resolving it then fails (no such action): discard runs it again."""
    journal.put(Entry("s-1", "p1", "payment", "ok", 1, result=b'"r-1"'))
    with pytest.raises(AlreadyCompleted) as refused:
        journal.resolve("s-1", "p1", "r-2")
    assert "discard it first" not in str(refused.value)
    assert "(a discard forgets it: the next run runs the action again)" in str(refused.value)
    journal.discard("s-1", "p1")
    with pytest.raises(KeyError):
        journal.resolve("s-1", "p1", "r-2")


def test_listing_a_journal_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "j.db"
    with sqlite3.connect(path) as db:  # a journal in rollback mode, as another tool may leave one
        db.execute(
            "CREATE TABLE journal (session_id, action_id, kind, status, attempts, result, result_digest, "
            "result_ref, idempotency_key, incarnation, PRIMARY KEY (session_id, action_id))"
        )
        db.execute("INSERT INTO journal VALUES ('s', 'a', 'clock', 'ok', 1, NULL, NULL, NULL, NULL, NULL)")
    before = path.read_bytes()
    assert _cli(capsys, "list", str(path))[0] == 0
    assert path.read_bytes() == before
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_listing_an_outcome_with_a_lone_surrogate_as_json(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    journal.put(Entry("s-1", "a1", "llm_call", "ok", 1, result='"\ud800"'.encode("utf-8", "surrogatepass")))
    code, out, _ = _cli(capsys, "list", str(journal.path), "--format", "json")
    assert code == 0 and "\\ud800" in out


# -- a sync function that returns an awaitable ----------------------------------------------


@pytest.fixture
def boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Count crash points as the harness does (no crash point is set): the file of ``after``s."""
    monkeypatch.setenv(crash.COUNT_ENV, str(tmp_path / "count"))
    monkeypatch.delenv(crash.ENV, raising=False)
    monkeypatch.setattr(crash, "_TARGET", crash._Target())
    return tmp_path / ("count" + crash.AFTER_SUFFIX)


def test_an_awaitable_returned_by_a_sync_function_runs_inside_the_action(
    journal: SqliteJournal, boundaries: Path
) -> None:
    """Its effect happens when it is awaited: the journal's completion, the ``after``
    crash point and the span's end come after the await, with its outcome."""
    agent = Agent(journal)
    current = []

    async def declined(amount: int) -> None:
        await asyncio.sleep(0)
        current.append(trace.get_current_span().attributes[sc.ACTION_ID])
        raise ConnectionError("card declined")

    async def charged(amount: int) -> dict[str, int]:
        await asyncio.sleep(0)
        return {"charged": amount}

    pay = agent.action("p1", "payment", idempotency_key="k-1")(lambda amount: declined(amount))
    refund = agent.action("r1", "payment", idempotency_key="k-2")(lambda amount: charged(amount))

    async def run() -> None:
        with session("s-1", journal=journal):
            pending = pay(2400)
            assert journal.get("s-1", "p1").status == "started" and not boundaries.exists()
            assert agent.spans() == []
            with pytest.raises(ConnectionError):
                await pending
            assert await refund(100) == {"charged": 100}

    asyncio.run(run())
    assert current == ["p1"]  # the span is current while the awaitable runs
    assert journal.get("s-1", "p1").status == "error"
    failed = agent.attributes("p1")
    assert failed[sc.ACTION_STATUS] == "error" and sc.ACTION_RESULT not in failed
    assert journal.get("s-1", "r1").outcome == {"charged": 100}
    assert json.loads(agent.attributes("r1")[sc.ACTION_RESULT]) == {"charged": 100}
    assert boundaries.read_text().split() == ["2"]  # only the refund passed its ``after``


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_an_awaitable_never_awaited_ends_its_action_as_failed(journal: SqliteJournal) -> None:
    """Its effect never ran: the span is exported as an error and the journal says so, so
    the next process runs it. Left ``started``, the span was never exported and the next
    process found an unkeyed payment in doubt that had never been made."""
    agent = Agent(journal)
    charges: list[int] = []

    async def charged(amount: int) -> dict[str, int]:
        charges.append(amount)
        return {"charged": amount}

    pay = agent.action("p1", "payment")(lambda amount: charged(amount))

    async def forgotten() -> None:
        with session("s-1", journal=journal):
            pay(2400)  # the caller forgot ``await``
            gc.collect()

    async def resumed() -> Any:
        with session("s-1", journal=journal):
            return await pay(2400)

    asyncio.run(forgotten())
    assert journal.get("s-1", "p1").status == "error"
    (span,) = agent.spans()
    assert span.status.status_code is trace.StatusCode.ERROR and "never awaited" in span.status.description
    assert span.attributes[sc.ACTION_STATUS] == "error"
    restart()
    assert asyncio.run(resumed()) == {"charged": 2400}
    assert charges == [2400]
    assert journal.get("s-1", "p1").status == "ok" and journal.get("s-1", "p1").attempts == 2


def test_a_callable_object_with_async_call_is_a_coroutine_function(journal: SqliteJournal) -> None:
    """Seen at decoration, so that a replay is awaited as the first run was."""
    calls = []

    class Charger:
        async def __call__(self, amount: int) -> dict[str, int]:
            calls.append(amount)
            return {"charged": amount}

    pay = action("p1", "payment", idempotency_key="k-1")(Charger())
    assert inspect.iscoroutinefunction(pay)

    async def run() -> Any:
        restart()
        with session("s-1", journal=journal):
            return await pay(2400)

    assert asyncio.run(run()) == asyncio.run(run()) == {"charged": 2400}
    assert calls == [2400]


def test_a_partial_of_a_callable_object_with_async_call_is_a_coroutine_function(
    journal: SqliteJournal,
) -> None:
    """``functools.partial(Charger(), 2400)`` was wrapped as a plain function that returned
    a coroutine: killed before it returned (an entry still ``started``, not noted awaited),
    its skip was handed back as a bare ``None`` and the caller's ``await`` raised TypeError.
    Its form is seen at decoration, through the partial, as ``Charger()``'s is."""
    sent: list[str] = []

    class Mailer:
        async def __call__(self, to: str) -> dict[str, str]:
            sent.append(to)
            return {"sent": to}

    notify = action("p1", "email", replay="skip")(functools.partial(Mailer(), "ana"))
    assert inspect.iscoroutinefunction(notify)
    _started(journal, "email")  # a process killed at the action's start

    async def resumed() -> Any:
        with session("s-1", journal=journal):
            return await notify()

    assert asyncio.run(resumed()) is None  # stepped over, awaitable
    assert sent == []


def test_a_callable_object_whose_call_is_a_generator_streams_as_a_generator_function(
    journal: SqliteJournal,
) -> None:
    """Seen at decoration, as an ``async def __call__`` is: a streaming client object's
    ``__call__`` that yields was wrapped as a plain function, so its generator was
    "recorded" (not JSON: a warning), journaled ``ok`` without an outcome, and a side
    effect's resumed call got ``None`` back to iterate (TypeError in the caller's code)."""
    sent: list[int] = []

    class Streamer:
        def __call__(self, count: int) -> Iterator[int]:
            for item in range(count):
                sent.append(item)
                yield item

    class AsyncStreamer:
        async def __call__(self, count: int) -> AsyncIterator[int]:
            for item in range(count):
                sent.append(item)
                yield item

    stream = action("g1", "email")(Streamer())
    stream_async = action("g2", "email")(AsyncStreamer())
    assert inspect.isgeneratorfunction(stream) and inspect.isasyncgenfunction(stream_async)

    async def run() -> tuple[list[int], list[int]]:
        restart()
        with session("s-1", journal=journal):
            return list(stream(2)), [item async for item in stream_async(3)]

    assert asyncio.run(run()) == asyncio.run(run()) == ([0, 1], [0, 1, 2])
    assert journal.get("s-1", "g1") is None and journal.get("s-1", "g2") is None  # as generator functions


def test_a_block_in_a_generator_closed_early_is_journaled_as_completed(journal: SqliteJournal) -> None:
    """``GeneratorExit`` ends the action normally: the journal says ``ok``, as the span does."""

    def receipts() -> Any:
        with action("p1", "payment") as act:  # no key: left `started`, it would be in doubt
            if act.replayed:
                yield from act.result
                return
            act.record(["receipt", "more"])
            yield "receipt"
            yield "more"

    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            stream = receipts()
            assert next(stream) == "receipt"
            stream.close()
        entry = journal.get("s-1", "p1")
        assert (entry.status, entry.outcome) == ("ok", ["receipt", "more"])


def test_a_side_effect_in_a_generator_closed_before_its_outcome_is_in_doubt(journal: SqliteJournal) -> None:
    """A consumer that stops a generator inside a side effect's block, before the block
    recorded an outcome, cut the effect short: it may not have happened (here it did not).
    Journaled ``ok`` without an outcome, it was replayed as ``None`` from then on, and the
    payment was never made; it is in doubt instead, as after a cancellation."""
    charges: list[int] = []
    agent = Agent(journal)

    def checkout(**fields: Any) -> Any:
        with agent.action("p1", "payment", **fields) as act:
            if act.replayed or act.skipped:
                return
            yield "confirm?"  # the consumer stops here: nothing is charged
            charges.append(2400)
            act.record({"charged": 2400})

    with session("s-1", journal=journal):
        steps = checkout()
        assert next(steps) == "confirm?"
        steps.close()
    assert journal.get("s-1", "p1").status == "started"
    assert agent.attributes("p1")[sc.ACTION_STATUS] == "started"  # the span says what the journal says
    restart()
    with session("s-1", journal=journal), pytest.raises(ActionInDoubt):
        list(checkout())
    key = instrument.idempotency_key("s-1", "p1")
    journal.discard("s-1", "p1")
    with session("s-1", journal=journal):  # under a key, a resumed run makes the payment
        steps = checkout(idempotency_key=key)
        next(steps)
        steps.close()
    restart()
    with session("s-1", journal=journal):
        assert list(checkout(idempotency_key=key)) == ["confirm?"]
    assert charges == [2400]


def test_a_read_in_a_generator_closed_before_its_outcome_ends_normally(journal: SqliteJournal) -> None:
    """Not a side effect: a consumer's early stop is a normal end, and the read runs again."""
    agent = Agent(journal)

    def pages() -> Any:
        with agent.action("r1", "external_read") as act:
            yield "page 1"
            yield "page 2"
            act.record("done")

    with session("s-1", journal=journal):
        steps = pages()
        next(steps)
        steps.close()
    assert journal.get("s-1", "r1").status == "ok"
    assert sc.ACTION_STATUS not in agent.attributes("r1")


# -- fork ------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_while_another_thread_writes_can_use_the_journal(tmp_path: Path) -> None:
    """A thread inside SQLite at the fork would leave SQLite's mutexes held in the child,
    whose journal then hangs: the fork waits for the journal call under way instead."""
    # The child's put waits for the writer thread's transactions: a loaded machine made it
    # wait past a 3 s busy timeout (failed once in CI). A hang still fails, at the alarm.
    journal = SqliteJournal(tmp_path / "journal.db", timeout_s=60)
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            journal.put(Entry("busy", f"a{n % 50}", "tool_call", "ok", result=b"1"))
            n += 1

    writer = threading.Thread(target=write)
    writer.start()
    failed = []
    try:
        time.sleep(0.1)
        for n in range(50):
            pid = os.fork()
            if pid == 0:  # pragma: no cover (child)
                signal.alarm(120)  # a child that hangs dies of SIGALRM
                try:
                    journal.put(Entry("child", f"c{n}", "payment", "started"))
                    ok = journal.get("child", f"c{n}") is not None
                except BaseException:
                    ok = False
                os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                failed.append((n, status))
                break
    finally:
        stop.set()
        writer.join()
    assert failed == []
    assert len(journal.entries("child")) == 50


def _open_files(directory: Path) -> dict[str, str]:
    """This process's descriptors open on files in ``directory``: number → file name."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)):
                found[fd] = os.path.basename(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_forked_child_leaves_the_inherited_connection_open(journal: SqliteJournal) -> None:
    """Closing a connection opened before the fork would close files, and release locks,
    that the parent's connection uses: the child keeps it, unused, and opens its own."""
    journal.put(Entry("s-1", "a1", "clock", "ok", 1))
    inherited = _open_files(journal.path.parent)
    assert "journal.db-wal" in inherited.values()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        journal.put(Entry("s-1", "a2", "clock", "ok", 1))
        gc.collect()
        still = _open_files(journal.path.parent)
        os.write(
            write, b"kept" if all(still.get(fd) == name for fd, name in inherited.items()) else b"closed"
        )
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    answer = os.read(read, 10)
    os.close(read)
    assert answer == b"kept"
    assert journal.get("s-1", "a2") is not None


def test_replayed_outcomes_are_converted_as_recovery_md_lists(journal: SqliteJournal) -> None:
    """docs/recovery.md lists what a replay gives back for each type that is not JSON's own."""

    class Colour(enum.Enum):
        RED = "red"

    class Text(str):
        pass

    @dataclasses.dataclass
    class Booking:
        ref: str
        when: datetime.date

    recorded = {
        "tuple": (1, (2,)),
        "keys": {2: "a", 1.5: "b", True: "c", None: "d", datetime.date(2026, 1, 2): "e"},
        "datetime": datetime.datetime(2026, 1, 2, 3, 4, 5),
        "aware": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "date": datetime.date(2026, 1, 2),
        "time": datetime.time(3, 4, 5),
        "uuid": uuid.UUID(int=5),
        "enum": Colour.RED,
        "dataclass": Booking("B1", datetime.date(2026, 1, 2)),
        "subclass": Text("plain"),
        "exact": [2**80, -0.0, 0.1, "naïve ✓"],
    }
    replayed = {
        "tuple": [1, [2]],
        "keys": {"2": "a", "1.5": "b", "true": "c", "null": "d", "2026-01-02": "e"},
        "datetime": "2026-01-02T03:04:05",
        "aware": "2026-01-02T03:04:05+00:00",
        "date": "2026-01-02",
        "time": "03:04:05",
        "uuid": "00000000-0000-0000-0000-000000000005",
        "enum": "red",
        "dataclass": {"ref": "B1", "when": "2026-01-02"},
        "subclass": "plain",
        "exact": [2**80, -0.0, 0.1, "naïve ✓"],
    }
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            got = {
                name: action(name, "llm_call")(lambda value=value: value)()
                for name, value in recorded.items()
            }
    assert got == replayed
    assert type(got["subclass"]) is str and math.copysign(1, got["exact"][1]) == -1
    assert all(journal.get("s-1", name).status == "ok" for name in recorded)


def test_a_replayed_dictionary_keeps_the_order_of_its_keys(journal: SqliteJournal) -> None:
    """The journal kept the canonical JSON (keys sorted) and the replay read it back, so a
    ranking's first key, a dataclass's first field, the order an agent shows its options in,
    all changed after a restart. The digest stays the canonical one: it is the same outcome."""

    @dataclasses.dataclass
    class Flight:
        to: str
        at: str

    ranked = {"zurich": 120, "athens": 90, "deep": [{"b": 2, "a": 1}], "flight": Flight("LIS", "09:00")}
    ordered = ["zurich", "athens", "deep", "flight"]
    agent = Agent(journal)
    runs = []
    for _ in range(2):
        restart()
        with session("s-1", journal=journal):
            runs.append(agent.action("rank", "llm_call")(lambda: ranked)())
            with agent.action("pick", "user_prompt") as act:
                runs.append(act.result if act.replayed else act.record({"z": 1, "a": 2}))
    _, _, replayed, picked_again = runs
    assert list(replayed) == ordered and list(replayed["deep"][0]) == ["b", "a"]
    assert list(replayed["flight"]) == ["to", "at"] and list(picked_again) == ["z", "a"]
    spans = [span for span in agent.spans() if span.attributes[sc.ACTION_ID] == "rank"]
    assert spans[1].attributes[sc.ACTION_REPLAYED] is True
    assert spans[0].attributes[sc.ACTION_RESULT_DIGEST] == spans[1].attributes[sc.ACTION_RESULT_DIGEST]
    assert spans[0].attributes[sc.ACTION_RESULT_DIGEST] == digest_value(ranked)
    journal.discard("s-1", "rank")
    journal.put(Entry("s-1", "rank", "llm_call", "started"))
    resolved = journal.resolve("s-1", "rank", {"b": 1, "a": 2})  # an operator's outcome keeps its order too
    assert resolved.result_digest == digest_value({"a": 2, "b": 1})
    assert list(journal.get("s-1", "rank").outcome) == ["b", "a"]


FIXED_INSTANCE_AGENT = """
import os, sys
from pathlib import Path
from durable_sessions.instrument import action, session
from durable_sessions.journal import ActionInDoubt, SqliteJournal

state = Path(sys.argv[1])
def ran(name):
    with open(state / name, "a") as runs:
        runs.write("x")

@action("q1", "user_prompt")
def ask():
    ran("asked")
    return {"budget": 2400}

@action("p1", "payment")
def pay():
    ran("charged")
    if sys.argv[2] == "die":
        os._exit(9)  # killed inside the payment: it may or may not have gone through
    return {"charge": "ch_1"}

with session("s-1", journal=SqliteJournal(str(state / "journal.db"))):
    assert ask() == {"budget": 2400}
    try:
        pay()
    except ActionInDoubt:
        print("in doubt")
"""


def test_a_restart_with_the_same_service_instance_id_is_still_recovered(tmp_path: Path) -> None:
    """The journal tells its own process's entries from a dead one's by what this process
    journaled, not by the incarnation: a service.instance.id derived from a pod's name
    (as OpenTelemetry recommends on Kubernetes) stays the same across container restarts,
    and the next process would have asked again and charged again."""
    import subprocess
    import sys

    script = tmp_path / "agent.py"
    script.write_text(FIXED_INSTANCE_AGENT)
    env = {**os.environ, "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=pod-7"}
    first = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "die"], env=env, timeout=60, check=False
    )
    assert first.returncode == 9
    second = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "live"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "asked").read_text() == "x"  # replayed, not asked again
    assert (tmp_path / "charged").read_text() == "x"  # in doubt, not charged again
    assert second.stdout.strip() == "in doubt"


def test_a_task_returned_by_a_sync_function_is_given_back_as_it_is(journal: SqliteJournal) -> None:
    """Only a coroutine is awaited inside the action: a Task given back as a coroutine
    broke a caller that cancels it or adds a callback (AttributeError in user code)."""

    async def charge() -> dict[str, int]:
        await asyncio.sleep(0)
        return {"charged": 1}

    start = action("p1", "payment", idempotency_key="k-1")(lambda: asyncio.ensure_future(charge()))

    async def run() -> Any:
        with session("s-1", journal=journal):
            task = start()
            assert isinstance(task, asyncio.Task)
            task.add_done_callback(lambda _: None)
            return await task

    assert asyncio.run(run()) == {"charged": 1}
    assert journal.get("s-1", "p1").status == "ok"


def card_charger(charges: list[str]) -> Callable[[str], Coroutine[Any, Any, dict[str, str]]]:
    """A coroutine function that charges a card after one turn of the loop (appending it to
    ``charges``), or fails for the card ``declined``."""

    async def charge(card: str) -> dict[str, str]:
        await asyncio.sleep(0)
        if card == "declined":
            raise ValueError("card declined")
        charges.append(card)
        return {"charged": card}

    return charge


def test_a_task_or_future_returned_by_a_sync_function_is_journaled_when_done_and_replayed_awaitable(
    journal: SqliteJournal,
) -> None:
    """A payment that returns a Task or a Future has happened when it is done, not when it
    is returned: it was journaled ``ok`` then, without an outcome, so the resumed call got
    ``None`` back and the caller's ``await`` raised TypeError in its code; a Task that
    failed was journaled ``ok`` all the same."""
    charges: list[str] = []
    charge = card_charger(charges)

    def settled_later(card: str) -> asyncio.Future[dict[str, str]]:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, {"charged": card})
        return future

    by_task = action("p-task", "payment", idempotency_key="k-1")(
        lambda: asyncio.ensure_future(charge("visa"))
    )
    by_future = action("p-future", "payment", idempotency_key="k-2")(lambda: settled_later("amex"))
    declined = action("p-declined", "payment", idempotency_key="k-3")(
        lambda: asyncio.ensure_future(charge("declined"))
    )

    async def run() -> tuple[Any, Any]:
        with session("s-1", journal=journal):
            with contextlib.suppress(ValueError):
                await declined()
            return await by_task(), await by_future()

    assert asyncio.run(run()) == ({"charged": "visa"}, {"charged": "amex"})
    assert journal.get("s-1", "p-task").outcome == {"charged": "visa"}
    assert journal.get("s-1", "p-future").outcome == {"charged": "amex"}
    assert journal.get("s-1", "p-declined").status == "error"
    restart()
    assert asyncio.run(run()) == ({"charged": "visa"}, {"charged": "amex"})  # replayed, awaitable
    assert charges == ["visa"]


def test_the_replay_of_a_task_or_future_is_a_done_future_of_the_running_loop(journal: SqliteJournal) -> None:
    """Its caller used what it got as a Future (a callback, ``done()``, ``result()``): a
    replay that handed back a coroutine of the outcome raised AttributeError there, in the
    process that resumed the session. Stepped over or settled by an operator, the call is
    handed back a done Future too."""
    charges: list[str] = []

    async def charge(card: str) -> dict[str, str]:
        await asyncio.sleep(0)
        charges.append(card)
        return {"charged": card}

    async def hanging(card: str) -> None:
        await asyncio.sleep(10)  # cancelled here: did it charge?

    paid = action("p-paid", "payment", idempotency_key="k-1")(lambda: asyncio.ensure_future(charge("visa")))
    cut = action("p-cut", "payment", replay="skip")(lambda: asyncio.ensure_future(hanging("amex")))
    settled = action("p-settled", "payment")(lambda: asyncio.ensure_future(hanging("diners")))

    async def first_run() -> None:
        with session("s-1", journal=journal):
            await paid()
            for call in (cut, settled):
                task = call()
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

    asyncio.run(first_run())
    assert [journal.get("s-1", a).shape for a in ("p-paid", "p-cut", "p-settled")] == ["future"] * 3
    journal.resolve("s-1", "p-settled", {"charged": "diners"})  # the operator found it went through
    restart()

    async def resumed() -> list[Any]:
        with session("s-1", journal=journal):
            futures = [paid(), cut(), settled()]
            called: list[Any] = []
            for future in futures:
                assert isinstance(future, asyncio.Future) and future.done() and not future.cancel()
                assert future.get_loop() is asyncio.get_running_loop()
                future.add_done_callback(lambda done: called.append(done.result()))
            await asyncio.sleep(0)  # the callbacks run
            assert called == [future.result() for future in futures]
            return [await future for future in futures]

    assert asyncio.run(resumed()) == [{"charged": "visa"}, None, {"charged": "diners"}]
    assert charges == ["visa"]


def test_a_task_replayed_with_no_loop_running_is_a_coroutine_and_said(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """No loop is running to bind a Future to: the replay is a coroutine of the outcome,
    which a loop started later awaits, and the log says why it is no Future."""

    async def charge() -> dict[str, int]:
        return {"charged": 1}

    pay = action("p1", "payment", idempotency_key="k-1")(lambda: asyncio.ensure_future(charge()))

    async def first_run() -> Any:
        with session("s-1", journal=journal):
            return await pay()

    asyncio.run(first_run())
    restart()
    with session("s-1", journal=journal):
        replayed = pay()
    assert inspect.iscoroutine(replayed)
    assert asyncio.run(replayed) == {"charged": 1}
    assert (
        "'p1' returned a Task or a Future when it ran, but is replayed with no event loop running"
        in caplog.text
    )


def test_an_entry_of_a_task_written_before_the_shape_was_noted_replays_as_a_coroutine(tmp_path: Path) -> None:
    """A journal written before 2026-12 noted a Task's action only as awaited: its replay
    stays what it was then, a coroutine of the outcome (``await`` takes it)."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE journal (session_id TEXT NOT NULL, action_id TEXT NOT NULL, kind TEXT NOT NULL, "
            "status TEXT NOT NULL, attempts INTEGER NOT NULL, result BLOB, result_digest TEXT, result_ref TEXT, "
            "idempotency_key TEXT, incarnation TEXT, awaited INTEGER NOT NULL DEFAULT 0, "
            "PRIMARY KEY (session_id, action_id))"
        )
        old.execute(
            "INSERT INTO journal VALUES ('s-1', 'p1', 'payment', 'ok', 1, X'7b2263223a317d', NULL, NULL, 'k-1', "
            "'dead', 1)"
        )
    old.close()
    old_entry = SqliteJournal(path, readonly=True).get("s-1", "p1")
    assert old_entry.awaited is True and old_entry.shape is None  # the column it has is read
    charges: list[int] = []

    async def charge() -> dict[str, int]:
        charges.append(1)
        return {"c": 2}

    pay = action("p1", "payment", idempotency_key="k-1")(lambda: asyncio.ensure_future(charge()))

    async def resumed() -> Any:
        with session("s-1", journal=SqliteJournal(path)):
            replayed = pay()
            assert inspect.iscoroutine(replayed)
            return await replayed

    assert asyncio.run(resumed()) == {"c": 1}
    assert charges == []


def _starting(task: Callable[[str], Any]) -> Callable[[str], Any]:
    """A coroutine function whose await gives a Task of ``task(card)``, as ``async def
    start(): return asyncio.ensure_future(charge())`` does."""

    async def start(card: str) -> asyncio.Task[Any]:
        await asyncio.sleep(0)
        return asyncio.ensure_future(task(card))

    return start


def test_a_task_or_future_a_coroutine_function_gives_is_journaled_when_done_and_replayed_as_a_done_future(
    journal: SqliteJournal,
) -> None:
    """``async def start(): return asyncio.ensure_future(charge())`` has its effect when the
    Task is done: the action ends then, with its result recorded, and the await of a
    resumed call gives a done Future of the running loop holding it, as a sync function's
    replay does. The Task was "recorded" at the await (not JSON: a warning), journaled
    ``ok`` without an outcome, and the resumed call's await gave ``None``. One that failed
    ends ``error``, and runs again."""
    agent = Agent(journal)
    charges: list[str] = []
    charge = card_charger(charges)

    async def settled_later(card: str) -> asyncio.Future[dict[str, str]]:
        future = asyncio.get_running_loop().create_future()

        def charged() -> None:
            charges.append(card)
            future.set_result({"charged": card})

        asyncio.get_running_loop().call_soon(charged)
        return future

    by_task = agent.action("p-task", "payment", idempotency_key="k-1")(_starting(charge))
    by_future = agent.action("p-future", "payment", idempotency_key="k-2")(settled_later)
    retried = agent.action("p-retried", "payment", idempotency_key="k-3")(_starting(charge))

    async def first() -> list[Any]:
        with session("s-1", journal=journal):
            task = await by_task("visa")
            assert isinstance(task, asyncio.Task) and not task.done()
            entry = journal.get("s-1", "p-task")
            assert (entry.status, entry.shape) == ("started", "future") and agent.spans() == []
            with pytest.raises(ValueError, match="card declined"):
                await (await retried("declined"))
            return [await task, await (await by_future("amex"))]

    assert asyncio.run(first()) == [{"charged": "visa"}, {"charged": "amex"}]
    assert journal.get("s-1", "p-task").outcome == {"charged": "visa"}
    assert journal.get("s-1", "p-future").outcome == {"charged": "amex"}
    assert json.loads(agent.attributes("p-task")[sc.ACTION_RESULT]) == {"charged": "visa"}
    assert journal.get("s-1", "p-retried").status == "error"
    restart()

    async def resumed() -> list[Any]:
        with session("s-1", journal=journal):
            futures = [await by_task("visa"), await by_future("amex")]
            for future in futures:
                assert isinstance(future, asyncio.Future) and future.done() and not future.cancel()
                assert future.get_loop() is asyncio.get_running_loop()
            return [future.result() for future in futures] + [await (await retried("mastercard"))]

    assert asyncio.run(resumed()) == [{"charged": "visa"}, {"charged": "amex"}, {"charged": "mastercard"}]
    assert charges == ["visa", "amex", "mastercard"]
    assert journal.get("s-1", "p-retried").outcome == {"charged": "mastercard"}


def test_a_task_a_coroutine_function_gives_cancelled_is_in_doubt_and_its_skip_or_resolution_a_done_future(
    journal: SqliteJournal,
) -> None:
    """Cancelled, the Task may or may not have charged: the entry stays ``started``, in
    doubt, as a sync function's Task's does (it was journaled ``ok`` at the await, and
    replayed as ``None``). Stepped over, or settled by an operator, the await of the
    resumed call gives a done Future of ``None``, or of the outcome given; otherwise the
    resumed call raises ActionInDoubt, not charging again."""
    charges: list[str] = []

    async def hanging(card: str) -> None:
        await asyncio.sleep(10)  # cancelled here: did it charge?
        charges.append(card)

    cut = action("p-cut", "payment", replay="skip")(_starting(hanging))
    settled = action("p-settled", "payment")(_starting(hanging))
    doubted = action("p-doubted", "payment")(_starting(hanging))

    async def first_run() -> None:
        with session("s-1", journal=journal):
            for call, card in ((cut, "amex"), (settled, "diners"), (doubted, "visa")):
                task = await call(card)
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

    asyncio.run(first_run())
    entries = [journal.get("s-1", a) for a in ("p-cut", "p-settled", "p-doubted")]
    assert [(e.status, e.shape) for e in entries] == [("started", "future")] * 3
    journal.resolve("s-1", "p-settled", {"charged": "diners"})  # the operator found it went through
    restart()

    async def resumed() -> list[Any]:
        with session("s-1", journal=journal):
            with pytest.raises(ActionInDoubt):
                await doubted("visa")
            futures = [await cut("amex"), await settled("diners")]
            for future in futures:
                assert isinstance(future, asyncio.Future) and future.done()
                assert future.get_loop() is asyncio.get_running_loop()
            return [await future for future in futures]

    assert asyncio.run(resumed()) == [None, {"charged": "diners"}]
    assert charges == []


def _assert_sent_to_ana_and_bo(agent: Agent, boundaries: Path) -> None:
    """Action ``n1`` of session ``s-1`` completed with its items, ana's and bo's emails, as
    its outcome, in the journal and on its span, past its ``after`` crash point once."""
    items = [{"sent": "ana"}, {"sent": "bo"}]
    assert agent.journal.get("s-1", "n1").outcome == items
    assert json.loads(agent.attributes("n1")[sc.ACTION_RESULT]) == items
    assert boundaries.read_text().split() == ["1"]


def test_a_generator_returned_by_a_sync_function_is_journaled_when_exhausted_and_replayed(
    journal: SqliteJournal, boundaries: Path
) -> None:
    """A sync function that returns a generator has its effect as the generator is
    iterated, after it returned: it was journaled ``ok`` at once, without an outcome (a
    generator is no JSON), so a side effect's resumed call got ``None`` and the caller's
    loop raised TypeError. Now the items are its outcome, journaled when it is exhausted,
    with the span current in its steps and the ``after`` crash point after the last."""
    agent = Agent(journal)
    sent: list[str] = []
    current: list[str] = []

    def sending(to: list[str]) -> Iterator[dict[str, str]]:
        def each() -> Iterator[dict[str, str]]:
            for name in to:
                current.append(trace.get_current_span().attributes[sc.ACTION_ID])
                sent.append(name)
                yield {"sent": name}
            return "all sent"

        return each()

    notify = agent.action("n1", "email")(sending)

    with session("s-1", journal=journal):
        stream = notify(["ana", "bo"])
        assert inspect.isgenerator(stream) and sent == [] and agent.spans() == []
        assert journal.get("s-1", "n1").shape == "iterator"  # noted before the effect
        assert next(stream) == {"sent": "ana"}
        assert journal.get("s-1", "n1").status == "started" and not boundaries.exists()
        assert next(stream) == {"sent": "bo"}
        with pytest.raises(StopIteration) as stop:
            next(stream)
    assert stop.value.value == "all sent"
    assert current == ["n1", "n1"]
    _assert_sent_to_ana_and_bo(agent, boundaries)
    restart()
    with session("s-1", journal=journal):
        replayed = notify(["ana", "bo"])
        assert inspect.isgenerator(replayed)
        assert list(replayed) == [{"sent": "ana"}, {"sent": "bo"}]
    assert sent == ["ana", "bo"]


@pytest.mark.parametrize("kind", ["email", "llm_call"])
def test_a_returned_generator_closed_early_or_failed_is_not_replayed_as_its_items(
    journal: SqliteJournal, kind: str
) -> None:
    """Stopped early, its items are not all there is: a side effect is in doubt (stepped
    over as an empty generator, never sent twice), anything else runs again. Failed, it
    ends ``error`` and runs again. Unrecorded (``record=False``), a side effect is
    replayed as an empty generator, anything else runs again."""
    sent: list[str] = []
    sending = _returned_stream(_mailing(sent), asynchronous=False)
    stopped = action("n-stopped", kind, replay="skip")(sending)
    failed = action("n-failed", kind)(sending)
    unrecorded = action("n-unrecorded", kind, record=False)(sending)
    with session("s-1", journal=journal):
        stream = stopped(["ana", "bo"])
        assert next(stream) == "ana"
        stream.close()
        with pytest.raises(ValueError, match="no such address"):
            list(failed(["cy", "bad"]))
        assert list(unrecorded(["eve"])) == ["eve"]
    assert journal.get("s-1", "n-stopped").status == ("started" if kind == "email" else "ok")
    assert journal.get("s-1", "n-stopped").result is None
    assert journal.get("s-1", "n-failed").status == "error"
    restart()
    with session("s-1", journal=journal):
        assert list(stopped(["ana", "bo"])) == ([] if kind == "email" else ["ana", "bo"])
        assert list(failed(["cy", "dee"])) == ["cy", "dee"]
        assert list(unrecorded(["eve"])) == ([] if kind == "email" else ["eve"])
    resumed = ["cy", "dee"] if kind == "email" else ["ana", "bo", "cy", "dee", "eve"]
    assert sent == ["ana", "cy", "eve", *resumed]


def _mailing(sent: list[str]) -> Callable[[list[str]], Iterator[str]]:
    """A generator function that sends to each address it is given (noted in ``sent``) and
    yields it, and raises ValueError at the address ``"bad"``."""

    def each(to: list[str]) -> Iterator[str]:
        for name in to:
            if name == "bad":
                raise ValueError("no such address")
            sent.append(name)
            yield name

    return each


def _returned_stream(each: Callable[..., Iterator[Any]], asynchronous: bool) -> Callable[..., Any]:
    """A sync function that returns the generator ``each(...)`` builds or, when
    ``asynchronous``, an async generator of its items (an await between them)."""

    def build(*args: Any) -> Any:
        steps = each(*args)
        if not asynchronous:
            return steps

        async def stepping() -> AsyncIterator[Any]:
            for item in steps:
                await asyncio.sleep(0)
                yield item

        return stepping()

    return build


def _items(stream: Any) -> Any:
    """The items of a generator, or of an async generator (run in an event loop of its own);
    anything else as it is."""
    if not inspect.isasyncgen(stream):
        return list(stream) if inspect.isgenerator(stream) else stream

    async def collect() -> list[Any]:
        return [item async for item in stream]

    return asyncio.run(collect())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["generator", "async-generator"])
def test_a_returned_generator_never_iterated_ends_its_action_as_failed(
    journal: SqliteJournal, asynchronous: bool
) -> None:
    """Its effect never ran: the action fails and the next process runs it, as a coroutine
    never awaited does (left ``started``, an unkeyed side effect was in doubt for ever).
    An async generator alike (it was journaled ``ok`` at once, and replayed as ``None``)."""
    agent = Agent(journal)
    sent: list[str] = []

    def each() -> Iterator[str]:
        sent.append("ana")
        yield "ana"

    notify = agent.action("n1", "email")(_returned_stream(each, asynchronous))
    with session("s-1", journal=journal):
        notify()  # dropped: never iterated
        gc.collect()
    assert journal.get("s-1", "n1").status == "error"
    (span,) = agent.spans()
    assert span.status.status_code is trace.StatusCode.ERROR and "never iterated" in span.status.description
    restart()
    with session("s-1", journal=journal):
        resumed = notify()
    assert inspect.isasyncgen(resumed) is asynchronous
    assert _items(resumed) == ["ana"]
    assert sent == ["ana"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["generator", "async-generator"])
def test_a_returned_generator_resolved_by_hand_is_replayed_as_given(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture, asynchronous: bool
) -> None:
    """An operator settles a generator's side effect with the list of its items (a
    generator of them comes back, an async one for an async generator); one settled with
    another value gets that value, and the log says so, rather than a failure inside the
    agent."""
    shape = "async_iterator" if asynchronous else "iterator"
    listed = action("n-list", "email")(_returned_stream(lambda: (to for to in ["ana"]), asynchronous))
    other = action("n-other", "email")(_returned_stream(lambda: (to for to in ["bo"]), asynchronous))
    for action_id in ("n-list", "n-other"):
        journal.put(Entry("s-1", action_id, "email", "started", 1, incarnation="dead", shape=shape))
    journal.resolve("s-1", "n-list", ["ana"])
    journal.resolve("s-1", "n-other", {"sent": 1})
    with session("s-1", journal=journal):
        replayed = listed()
        assert inspect.isasyncgen(replayed) is asynchronous
        assert _items(replayed) == ["ana"]
        assert other() == {"sent": 1}
    returned = "an async generator" if asynchronous else "a generator"
    assert f"'n-other' returned {returned} when it ran, but its journaled outcome is a dict" in caplog.text


def test_an_async_generator_returned_by_a_sync_function_is_journaled_when_exhausted_and_replayed(
    journal: SqliteJournal, boundaries: Path
) -> None:
    """As a returned generator is: the action is open across the async generator's steps
    (the span current in them, sent values passed on), and journaled with the list of its
    items when it is exhausted. It was "recorded" at once (not JSON: a warning), journaled
    ``ok`` without an outcome with the span ended before the first item, and a side
    effect's resumed call got ``None``, which the caller's ``async for`` refuses."""
    agent = Agent(journal)
    sent: list[str] = []
    current: list[str] = []

    def sending(to: list[str]) -> AsyncIterator[dict[str, str]]:
        async def each() -> AsyncIterator[dict[str, str]]:
            for name in to:
                await asyncio.sleep(0)
                current.append(trace.get_current_span().attributes[sc.ACTION_ID])
                sent.append(name)
                reply = yield {"sent": name}
                if reply is not None:
                    sent.append(reply)

        return each()

    notify = agent.action("n1", "email")(sending)

    async def first() -> list[Any]:
        with session("s-1", journal=journal):
            stream = notify(["ana", "bo"])
            assert inspect.isasyncgen(stream) and sent == [] and agent.spans() == []
            assert journal.get("s-1", "n1").shape == "async_iterator"  # noted before the effect
            got = [await stream.__anext__()]
            assert journal.get("s-1", "n1").status == "started" and not boundaries.exists()
            got.append(await stream.asend("ana read it"))
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            return got

    assert asyncio.run(first()) == [{"sent": "ana"}, {"sent": "bo"}]
    assert current == ["n1", "n1"] and sent == ["ana", "ana read it", "bo"]
    _assert_sent_to_ana_and_bo(agent, boundaries)
    restart()

    async def resumed() -> list[Any]:
        with session("s-1", journal=journal):
            replayed = notify(["ana", "bo"])
            assert inspect.isasyncgen(replayed)
            return [item async for item in replayed]

    assert asyncio.run(resumed()) == [{"sent": "ana"}, {"sent": "bo"}]
    assert sent == ["ana", "ana read it", "bo"]


@pytest.mark.parametrize("kind", ["email", "llm_call"])
def test_a_returned_async_generator_closed_early_or_failed_is_not_replayed_as_its_items(
    journal: SqliteJournal, kind: str
) -> None:
    """As a returned generator: closed early (``aclose()``, or left open when the loop
    ends), a side effect is in doubt (stepped over as an empty async generator), anything
    else runs again; failed, it ends ``error`` and runs again."""
    sent: list[str] = []
    sending = _returned_stream(_mailing(sent), asynchronous=True)
    stopped = action("n-stopped", kind, replay="skip")(sending)
    left_open = action("n-left-open", kind, replay="skip")(sending)
    failed = action("n-failed", kind)(sending)
    kept: list[Any] = []

    async def first() -> None:
        with session("s-1", journal=journal):
            stream = stopped(["ana", "bo"])
            assert await stream.__anext__() == "ana"
            await stream.aclose()
            kept.append(left_open(["cy"]))
            assert await kept[0].__anext__() == "cy"  # asyncio.run closes it when it ends
            with pytest.raises(ValueError, match="no such address"):
                [item async for item in failed(["dee", "bad"])]

    async def resumed() -> list[list[str]]:
        with session("s-1", journal=journal):
            return [
                [item async for item in run(to)]
                for run, to in ((stopped, ["ana", "bo"]), (left_open, ["cy"]), (failed, ["dee", "eve"]))
            ]

    asyncio.run(first())
    for action_id in ("n-stopped", "n-left-open"):
        entry = journal.get("s-1", action_id)
        assert (entry.status, entry.result) == ("started" if kind == "email" else "ok", None), action_id
    assert journal.get("s-1", "n-failed").status == "error"
    restart()
    outputs = asyncio.run(resumed())
    if kind == "email":
        assert outputs == [[], [], ["dee", "eve"]]
        assert sent == ["ana", "cy", "dee", "dee", "eve"]
    else:
        assert outputs == [["ana", "bo"], ["cy"], ["dee", "eve"]]
        assert sent == ["ana", "cy", "dee", "ana", "bo", "cy", "dee", "eve"]


def _awaited_stream(each: Callable[..., Iterator[Any]], asynchronous: bool) -> Callable[..., Any]:
    """A coroutine function whose await gives what ``_returned_stream(each, asynchronous)``
    returns, after an await of its own."""
    build = _returned_stream(each, asynchronous)

    async def stream(*args: Any) -> Any:
        await asyncio.sleep(0)
        return build(*args)

    return stream


async def _drained(stream: Any) -> list[Any]:
    """The items of a generator or an async generator, from inside an event loop."""
    if inspect.isasyncgen(stream):
        return [item async for item in stream]
    return list(stream)


_STREAM_KINDS = pytest.mark.parametrize("asynchronous", [False, True], ids=["generator", "async-generator"])


@_STREAM_KINDS
def test_a_stream_a_coroutine_function_gives_is_journaled_when_exhausted_and_replayed(
    journal: SqliteJournal, boundaries: Path, asynchronous: bool
) -> None:
    """``async def f(): return stream()`` has its effect as what the await gave is iterated:
    the action spans the iteration (the span current in its steps) and is journaled with
    the list of its items when it is exhausted, and the await of a resumed call gives a
    stream of the same kind. It was "recorded" at the await (not JSON: a warning), journaled
    ``ok`` without an outcome, and a side effect's resumed call gave ``None``."""
    agent = Agent(journal)
    sent: list[str] = []
    current: list[str] = []

    def each(to: list[str]) -> Iterator[dict[str, str]]:
        for name in to:
            current.append(trace.get_current_span().attributes[sc.ACTION_ID])
            sent.append(name)
            yield {"sent": name}

    notify = agent.action("n1", "email")(_awaited_stream(each, asynchronous))
    assert inspect.iscoroutinefunction(notify)
    is_stream = inspect.isasyncgen if asynchronous else inspect.isgenerator

    async def first() -> list[Any]:
        with session("s-1", journal=journal):
            stream = await notify(["ana", "bo"])
            assert is_stream(stream) and sent == [] and agent.spans() == []
            assert journal.get("s-1", "n1").shape == ("async_iterator" if asynchronous else "iterator")
            got = [await stream.__anext__() if asynchronous else next(stream)]
            assert journal.get("s-1", "n1").status == "started" and not boundaries.exists()
            return got + await _drained(stream)

    assert asyncio.run(first()) == [{"sent": "ana"}, {"sent": "bo"}]
    assert current == ["n1", "n1"] and sent == ["ana", "bo"]
    _assert_sent_to_ana_and_bo(agent, boundaries)
    restart()

    async def resumed() -> list[Any]:
        with session("s-1", journal=journal):
            replayed = await notify(["ana", "bo"])
            assert is_stream(replayed)
            return await _drained(replayed)

    assert asyncio.run(resumed()) == [{"sent": "ana"}, {"sent": "bo"}]
    assert sent == ["ana", "bo"]


@_STREAM_KINDS
@pytest.mark.parametrize("kind", ["email", "llm_call"])
def test_a_stream_a_coroutine_function_gives_stopped_failed_or_never_iterated_is_not_replayed(
    journal: SqliteJournal, kind: str, asynchronous: bool
) -> None:
    """As a sync function's returned stream: closed early, a side effect is in doubt
    (stepped over as an empty stream), anything else runs again; failed, or never
    iterated, it ends ``error`` and runs again (all were journaled ``ok`` at the await)."""
    agent = Agent(journal)
    sent: list[str] = []
    sending = _awaited_stream(_mailing(sent), asynchronous)
    stopped = agent.action("n-stopped", kind, replay="skip")(sending)
    failed = agent.action("n-failed", kind)(sending)
    dropped = agent.action("n-dropped", kind)(sending)

    async def first() -> None:
        with session("s-1", journal=journal):
            stream = await stopped(["ana", "bo"])
            assert (await stream.__anext__() if asynchronous else next(stream)) == "ana"
            await stream.aclose() if asynchronous else stream.close()
            with pytest.raises(ValueError, match="no such address"):
                await _drained(await failed(["cy", "bad"]))
            await dropped(["dee"])  # never iterated
            gc.collect()

    async def resumed() -> list[list[str]]:
        with session("s-1", journal=journal):
            return [
                await _drained(await run(to))
                for run, to in ((stopped, ["ana", "bo"]), (failed, ["cy", "eve"]), (dropped, ["dee"]))
            ]

    asyncio.run(first())
    stopped_entry = journal.get("s-1", "n-stopped")
    assert (stopped_entry.status, stopped_entry.result) == ("started" if kind == "email" else "ok", None)
    assert [journal.get("s-1", a).status for a in ("n-failed", "n-dropped")] == ["error", "error"]
    (dropped_span,) = [s for s in agent.spans() if s.attributes[sc.ACTION_ID] == "n-dropped"]
    assert "never iterated" in dropped_span.status.description
    restart()
    outputs = asyncio.run(resumed())
    stopped_again = [] if kind == "email" else ["ana", "bo"]
    assert outputs == [stopped_again, ["cy", "eve"], ["dee"]]
    assert sent == ["ana", "cy", *stopped_again, "cy", "eve", "dee"]  # "dee" was never sent at first


@_STREAM_KINDS
def test_a_stream_a_coroutine_function_gives_resolved_by_hand_is_replayed_as_its_items(
    journal: SqliteJournal, asynchronous: bool
) -> None:
    """An operator settles the in-doubt side effect with the list of its items: the await
    of the resumed call gives a stream of them (it gave the list itself)."""
    listed = action("n1", "email")(_awaited_stream(lambda: (to for to in ["bo"]), asynchronous))
    shape = "async_iterator" if asynchronous else "iterator"
    journal.put(Entry("s-1", "n1", "email", "started", 1, incarnation="dead", shape=shape))
    journal.resolve("s-1", "n1", ["ana"])

    async def resumed() -> Any:
        with session("s-1", journal=journal):
            return await listed()

    replayed = asyncio.run(resumed())
    assert (inspect.isasyncgen if asynchronous else inspect.isgenerator)(replayed)
    assert _items(replayed) == ["ana"]


def test_a_returned_coroutine_closed_mid_await_leaves_its_action_in_doubt(journal: SqliteJournal) -> None:
    """Closed while it awaited (cancelled, collected), its effect may or may not have
    happened: the entry stays ``started``, as after a crash; it was written ``ok``."""

    async def charging() -> dict[str, str]:
        await asyncio.sleep(10)
        return {"charge": "ch_1"}

    pay = action("p1", "payment")(lambda: charging())

    async def run() -> None:
        with session("s-1", journal=journal):
            pending = asyncio.ensure_future(pay())
            await asyncio.sleep(0.01)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending

    asyncio.run(run())
    assert journal.get("s-1", "p1").status == "started"

    @types.coroutine
    def suspended() -> Any:
        yield  # where an event loop would take over

    async def charging_without_a_loop() -> dict[str, str]:
        await suspended()
        return {"charge": "ch_2"}

    pay_again = action("p2", "payment")(lambda: charging_without_a_loop())
    with session("s-1", journal=journal):
        step = pay_again().__await__()
        next(step)  # suspended inside the payment
        step.close()  # GeneratorExit: it was journaled ``ok``
    assert journal.get("s-1", "p2").status == "started"


def test_the_replay_of_a_sync_function_that_returned_a_coroutine_is_awaitable(journal: SqliteJournal) -> None:
    """Its caller awaits what it returns: a replay that handed back the value itself broke
    that ``await`` (TypeError) in the process that resumed the session."""
    charges: list[int] = []

    async def charged() -> dict[str, int]:
        charges.append(1)
        return {"charged": 1}

    pay = action("p-awaited", "payment", idempotency_key="k-1")(lambda: charged())
    plain = action("r-plain", "external_read")(lambda: {"city": "Paris"})

    async def run() -> tuple[Any, Any]:
        with session("s-1", journal=journal):
            return await pay(), plain()

    assert asyncio.run(run()) == ({"charged": 1}, {"city": "Paris"})
    assert journal.get("s-1", "p-awaited").awaited and not journal.get("s-1", "r-plain").awaited
    assert asyncio.run(run()) == ({"charged": 1}, {"city": "Paris"})  # replayed, both as first returned
    assert charges == [1]


def test_a_sync_function_that_returned_a_coroutine_is_awaitable_when_skipped_or_resolved(
    journal: SqliteJournal,
) -> None:
    """Cut short while its coroutine was awaited, the action is in doubt. Stepped over
    (``replay="skip"``) or settled with ``journal.resolve``, the resumed call's caller still
    awaits what it returns: a bare ``None`` or value there was a TypeError in its code."""
    sent: list[str] = []

    async def sending(to: str) -> dict[str, str]:
        await asyncio.sleep(10)  # cancelled here: did it send?
        sent.append(to)
        return {"sent": to}

    notify = action("n1", "email", replay="skip")(lambda: sending("ana"))
    remind = action("n2", "email")(lambda: sending("bo"))

    async def cut_short(call: Any) -> None:
        pending = asyncio.ensure_future(call())
        await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending

    async def first_run() -> None:
        with session("s-1", journal=journal):
            await cut_short(notify)
            await cut_short(remind)

    asyncio.run(first_run())
    journal.resolve("s-1", "n2", {"sent": "bo"})  # the operator found it was sent
    restart()

    async def resumed() -> tuple[Any, Any]:
        with session("s-1", journal=journal):
            return await notify(), await remind()

    assert asyncio.run(resumed()) == (None, {"sent": "bo"})
    assert sent == []


def test_a_sync_function_declared_awaitable_is_replayed_awaitable_whatever_the_journal_noted(
    journal: SqliteJournal,
) -> None:
    """Killed before the sync function returned, the journal has no ``awaited`` note (nor
    has one written by an earlier version): settled by an operator, or stepped over, the
    resumed call was handed back bare, and its caller's ``await`` raised TypeError.
    Declared ``awaitable=True``, the call is handed back awaitable all the same."""
    journal.put(Entry("s-1", "p1", "payment", "started", 1, incarnation="dead"))  # killed at ``before``
    journal.put(Entry("s-1", "n1", "email", "started", 1, incarnation="dead"))
    journal.put(Entry("s-1", "q1", "llm_call", "ok", 1, result=b'{"quote": 7}'))  # no note: an older journal
    journal.resolve("s-1", "p1", {"charged": 2400})  # the operator found it went through
    ran: list[str] = []

    async def effect(name: str) -> str:
        ran.append(name)
        return name

    def calls(awaitable: bool) -> tuple[Any, ...]:
        def declared(action_id: str, kind: str, **fields: Any) -> Any:
            return action(action_id, kind, awaitable=awaitable, **fields)(lambda: effect(action_id))

        return declared("p1", "payment"), declared("n1", "email", replay="skip"), declared("q1", "llm_call")

    async def resumed(awaitable: bool) -> list[Any]:
        with session("s-1", journal=journal):
            return [await call() for call in calls(awaitable)]

    with pytest.raises(TypeError, match="can't be used in 'await' expression"):
        asyncio.run(resumed(False))
    assert asyncio.run(resumed(True)) == [{"charged": 2400}, None, {"quote": 7}]
    assert ran == []


def test_awaitable_is_accepted_on_a_coroutine_function_and_refused_where_nothing_is_replayed(
    journal: SqliteJournal,
) -> None:
    """On an ``async def`` the option is redundant, not wrong: its calls are awaitable,
    replayed or not. A generator's action is never replayed, a ``with`` block returns
    nothing, and a value that is no bool is a typo: each is a TypeError at once, not a
    declaration that silently does nothing."""
    charges: list[int] = []

    @action("p1", "payment", idempotency_key="k-1", awaitable=True)
    async def pay(amount: int) -> dict[str, int]:
        charges.append(amount)
        return {"charged": amount}

    async def run() -> Any:
        with session("s-1", journal=journal):
            return await pay(2400)

    assert inspect.iscoroutinefunction(pay)
    assert asyncio.run(run()) == asyncio.run(run()) == {"charged": 2400}
    assert charges == [2400]

    def streamed() -> Iterator[str]:
        yield "token"

    async def streamed_async() -> AsyncIterator[str]:
        yield "token"

    class Streamer:
        def __call__(self) -> Iterator[str]:
            yield "token"

    for generator in (streamed, streamed_async, Streamer(), functools.partial(Streamer())):
        with pytest.raises(TypeError, match=r"awaitable=True\) cannot decorate the generator function"):
            action("g1", "llm_call", awaitable=True)(generator)
    with (
        pytest.raises(TypeError, match="awaitable=True is only for the decorator form"),
        action("b1", "llm_call", awaitable=True),
    ):
        pass
    with pytest.raises(TypeError, match="awaitable must be True or False, not str"):
        action("p1", "payment", awaitable="yes")  # type: ignore[arg-type]


def test_a_function_declared_awaitable_that_returns_a_value_is_said_once(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """Its first run returns the value as it is (fail open), but its replays will return a
    coroutine: a declaration that does not hold is logged, once per action."""
    lookup = action(lambda city: f"weather-{city}", "external_read", awaitable=True)(
        lambda city: {"city": city}
    )
    with caplog.at_level(logging.WARNING, "durable_sessions"), session("s-1", journal=journal):
        assert [lookup("Paris"), lookup("Oslo")] == [{"city": "Paris"}, {"city": "Oslo"}]
    (said,) = [record.getMessage() for record in caplog.records if "awaitable=True" in record.getMessage()]
    assert "'weather-Paris' is declared awaitable=True, but its function returned a dict" in said

    async def replayed() -> Any:
        with session("s-1", journal=journal):
            return await lookup("Paris")

    restart()
    assert asyncio.run(replayed()) == {"city": "Paris"}


def test_a_journal_of_an_earlier_version_gets_the_awaited_column(tmp_path: Path) -> None:
    """A file written before the column existed: read-only it reads as not awaited, and
    opened for writing it gets the column."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE journal (session_id TEXT NOT NULL, action_id TEXT NOT NULL, kind TEXT NOT NULL, "
            "status TEXT NOT NULL, attempts INTEGER NOT NULL, result BLOB, result_digest TEXT, result_ref TEXT, "
            "idempotency_key TEXT, incarnation TEXT, PRIMARY KEY (session_id, action_id))"
        )
        old.execute(
            "INSERT INTO journal VALUES ('s', 'a', 'llm_call', 'ok', 1, X'31', NULL, NULL, NULL, NULL)"
        )
    old.close()
    assert SqliteJournal(path, readonly=True).get("s", "a") == Entry("s", "a", "llm_call", "ok", result=b"1")
    writable = SqliteJournal(path)
    assert writable.get("s", "a").awaited is False
    writable.put(Entry("s", "b", "llm_call", "ok", result=b"2", awaited=True))
    assert writable.get("s", "b").awaited is True


TWO_PROCESSES_AGENT = """
import sys, time
from pathlib import Path
from durable_sessions.instrument import action, session
from durable_sessions.journal import SqliteJournal

state, name = Path(sys.argv[1]), sys.argv[2]

@action("q1", "user_prompt")
def ask():
    (state / f"{name}-asked").touch()
    while name == "slow" and not (state / "go").exists():  # the person takes their time
        time.sleep(0.01)
    return f"answer-{name}"

exclusive = sys.argv[3] == "exclusive"
with session("s-1", journal=SqliteJournal(str(state / "journal.db")), exclusive=exclusive):
    print("went on with", ask())
"""


@pytest.mark.parametrize("exclusive", ["exclusive", "not-exclusive"])
def test_two_processes_on_one_session_the_first_recorded_outcome_wins(tmp_path: Path, exclusive: str) -> None:
    """An overlapping restart. By default the second process is refused
    (:class:`SessionInUse`) and asks nothing. With ``exclusive=False`` both ask, and the
    journal kept the *last* answer, one the first process never acted on (a review): the
    first outcome recorded stands, and the process whose outcome is not kept says so."""
    import subprocess
    import sys

    script = tmp_path / "agent.py"
    script.write_text(TWO_PROCESSES_AGENT)
    slow = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "slow", exclusive],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "slow-asked").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        fast = subprocess.run(
            [sys.executable, str(script), str(tmp_path), "fast", exclusive],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        (tmp_path / "go").touch()
        out, err = slow.communicate(timeout=60)
    finally:
        slow.kill()
    assert out == "went on with answer-slow\n"
    kept = SqliteJournal(tmp_path / "journal.db").get("s-1", "q1")
    if exclusive == "exclusive":
        assert fast.returncode == 1 and fast.stdout == ""
        assert "SessionInUse: session 's-1' is open in another live process" in fast.stderr
        assert not (tmp_path / "fast-asked").exists()
        assert (kept.status, kept.outcome) == ("ok", "answer-slow")
        return
    assert fast.stdout == "went on with answer-fast\n", fast.stderr
    assert "was completed by another run first" in err and "one session in one process at a time" in err
    assert (kept.status, kept.outcome) == ("ok", "answer-fast")


def test_a_recorded_outcome_stands_whoever_writes_over_it(tmp_path: Path) -> None:
    first, second = SqliteJournal(tmp_path / "j.db"), SqliteJournal(tmp_path / "j.db")  # two connections
    first.put(Entry("s-1", "q1", "user_prompt", "started", 1))
    second.put(Entry("s-1", "q1", "user_prompt", "started", 2))
    second.put(Entry("s-1", "q1", "user_prompt", "ok", 2, result=b'"second"'))
    first.put(Entry("s-1", "q1", "user_prompt", "ok", 1, result=b'"first"'))
    first.put(Entry("s-1", "q1", "user_prompt", "error", 1))
    assert (first.get("s-1", "q1").outcome, first.get("s-1", "q1").attempts) == ("second", 2)
    # Completed without an outcome to replay (record=False), an action runs again, journaled.
    first.put(Entry("s-1", "t1", "tool_call", "ok", 1))
    first.put(Entry("s-1", "t1", "tool_call", "started", 1))
    assert first.get("s-1", "t1").status == "started"


@pytest.mark.parametrize(
    ("written", "outcome"), [("'{\"charged\": 2400}'", {"charged": 2400}), ("2400", 2400)]
)
def test_an_outcome_settled_by_hand_in_sqlite_is_replayed_and_listed(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str], written: str, outcome: Any
) -> None:
    """An operator's UPDATE stores TEXT (or an INTEGER), not the BLOB the journal writes."""
    _started(journal, "payment")
    journal.close()
    with contextlib.closing(sqlite3.connect(journal.path)) as by_hand, by_hand:
        by_hand.execute(f"UPDATE journal SET status = 'ok', result = {written} WHERE action_id = 'p1'")
    agent = Agent(journal)
    with session("s-1", journal=journal):
        assert agent.action("p1", "payment")(lambda: pytest.fail("charged twice"))() == outcome
    assert json.loads(agent.attributes("p1")[sc.ACTION_RESULT]) == outcome
    code, out, err = _cli(capsys, "list", str(journal.path), "--format", "json")
    assert (code, err) == (0, "")
    assert [json.loads(entry["result"]) for entry in json.loads(out)] == [outcome]


LIVE_AGENT = """
import pathlib, sys, time
from durable_sessions.instrument import action, session
from durable_sessions.journal import SqliteJournal

with session(sys.argv[3] if len(sys.argv) > 3 else "s-1", journal=SqliteJournal(sys.argv[1])):
    @action("p1", "payment", idempotency_key="k-1")
    def pay():
        pathlib.Path(sys.argv[2]).touch()
        time.sleep(60)

    pay()
"""


def test_an_action_running_in_a_live_process_is_not_settled(
    journal: SqliteJournal, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`started` in a live process is running, not in doubt: an outcome made up for it now
    would stand over the one it returns (the first outcome recorded wins)."""
    agent = _live_agent(journal, tmp_path)
    try:
        path = str(journal.path)
        for argv in (("resolve", path, "s-1", "p1", '{"charged": 2400}'), ("discard", path, "s-1", "p1")):
            code, out, err = _cli(capsys, *argv)
            assert (code, out) == (1, "")
            assert "session 's-1' is open in another live process" in err and "not in doubt" in err
        assert journal.get("s-1", "p1").status == "started"  # type: ignore[union-attr]
    finally:
        agent.kill()
        agent.wait()
    # Its process is gone: now it is in doubt, and settled.
    code, out, _ = _cli(capsys, "resolve", str(journal.path), "s-1", "p1", '{"charged": 2400}')
    assert (code, out) == (0, "p1 of session s-1: ok, replayed from now on\n")


def _live_agent(journal: SqliteJournal, tmp_path: Path, session_id: str = "s-1") -> subprocess.Popen[bytes]:
    """A live process of ``session_id``, paused inside its payment p1 (``started``)."""
    running = tmp_path / f"running-{session_id}"
    agent = subprocess.Popen([sys.executable, "-c", LIVE_AGENT, str(journal.path), str(running), session_id])
    deadline = time.monotonic() + 60
    while not running.exists() and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not running.exists():
        agent.kill()
        pytest.fail("the agent never started its payment")
    return agent


def test_the_api_does_not_settle_an_action_running_in_a_live_process(
    journal: SqliteJournal, tmp_path: Path
) -> None:
    """The CLI and the API share one code path: a program settling through the API is
    refused as the CLI is, and nothing is recorded over the running action."""
    agent = _live_agent(journal, tmp_path)
    try:
        for settle in (
            lambda: journal.resolve("s-1", "p1", {"charged": 2400}),
            lambda: journal.discard("s-1", "p1"),
        ):
            with pytest.raises(SessionLive, match="'s-1' is open in another live process") as refused:
                settle()
            assert isinstance(refused.value, SessionInUse) and "not in doubt" in str(refused.value)
        assert journal.get("s-1", "p1").status == "started"  # type: ignore[union-attr]
        assert pickle.loads(pickle.dumps(refused.value)).args == refused.value.args
    finally:
        agent.kill()
        agent.wait()
    assert journal.resolve("s-1", "p1", {"charged": 2400}).outcome == {"charged": 2400}


def test_a_process_settles_an_action_of_a_session_it_holds(journal: SqliteJournal) -> None:
    """The agent that meets ActionInDoubt inside its own block settles it there and goes on."""
    _started(journal, "payment")
    with session("s-1", journal=journal):
        with pytest.raises(ActionInDoubt):
            action("p1", "payment")(lambda: pytest.fail("charged twice"))()
        journal.resolve("s-1", "p1", {"charged": 12})
        assert action("p1", "payment")(lambda: pytest.fail("charged twice"))() == {"charged": 12}
        journal.discard("s-1", "p1")
    assert journal.get("s-1", "p1") is None


def test_the_listing_tells_an_action_running_now_from_one_in_doubt(
    journal: SqliteJournal, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both are ``started``; only the one whose process died is in doubt, to settle."""
    _live_agent(journal, tmp_path, "s-dead").kill()  # SIGKILL inside its payment
    live = _live_agent(journal, tmp_path, "s-live")
    path = str(journal.path)
    try:
        code, out, err = _cli(capsys, "list", path, "--status", "started")
        assert (code, err) == (0, "")
        assert [re.split(" {2,}", line)[:4] for line in out.splitlines()] == [
            ["SESSION", "ACTION", "KIND", "STATUS"],
            ["s-dead", "p1", "payment", "started"],
            ["s-live", "p1", "payment", "started (live)"],
        ]
        code, out, _ = _cli(capsys, "list", path, "--format", "json")
        assert [(e["session_id"], e["status"], e["live"]) for e in json.loads(out)] == [
            ("s-dead", "started", False),
            ("s-live", "started", True),
        ]
        assert journal.live_sessions(["s-dead", "s-live", "s-never"]) == {"s-live"}
        with session("s-dead", journal=journal):  # this process's own hold is live too
            assert journal.live_sessions(["s-dead", "s-live"]) == {"s-dead", "s-live"}
    finally:
        live.kill()
        live.wait()
    assert journal.live_sessions(["s-dead", "s-live"]) == set()


def test_the_listing_reads_the_lock_file_without_making_one(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    _started(journal, "payment")
    code, out, _ = _cli(capsys, "list", str(journal.path), "--format", "json")
    assert code == 0 and json.loads(out)[0]["live"] is False
    assert not Path(f"{journal.path}-sessions.lock").exists()


def test_settling_an_action_makes_no_lock_file(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's lock file would be theirs, one the agent's user might not open."""
    _started(journal, "payment")
    assert _cli(capsys, "resolve", str(journal.path), "s-1", "p1", "1")[0] == 0
    assert not Path(f"{journal.path}-sessions.lock").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_while_a_journal_failure_is_noted_can_note_its_own(tmp_path: Path) -> None:
    """The note of a failing journal is kept under a lock: another thread in it at the fork
    must not leave it held in the child, whose first action on that journal would hang."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    broken = SqliteJournal(blocker / "journal.db")
    taken, release = threading.Event(), threading.Event()

    def inside_the_note() -> None:
        with instrument._FAILURES._lock:  # a thread noting a failure as the fork happens
            taken.set()
            release.wait()

    holder = threading.Thread(target=inside_the_note)
    holder.start()
    taken.wait()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            signal.alarm(120)  # a child that hangs dies of SIGALRM (6 s is not a hang on a loaded machine)
            with session("s-1", journal=broken):
                os._exit(0 if action("a1", "llm_call")(lambda: 7)() == 7 else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0


def test_an_action_given_a_journal_outside_a_session_says_it_is_not_journaled(
    journal: SqliteJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """Entries are keyed by session: such an action runs again after every restart, which
    its author, who gave it a journal, must be told (once, not at every call)."""
    charges = []
    pay = action("p1", "payment", idempotency_key="k-1", journal=journal)(lambda: charges.append(1))
    with caplog.at_level(logging.WARNING, logger="durable_sessions"):
        for _ in range(3):
            pay()
    assert len(charges) == 3 and journal.entries() == []
    [warning] = [record.getMessage() for record in caplog.records]
    assert "action 'p1' is given a journal but runs outside a session block" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1"):
        pay()  # inside a session, the action's own journal is used: nothing to say
    assert caplog.records == [] and [e.action_id for e in journal.entries("s-1")] == ["p1"]


def test_the_journal_listing_does_not_read_the_outcomes_it_does_not_show(
    journal: SqliteJournal, capsys: pytest.CaptureFixture[str]
) -> None:
    """The journal keeps every outcome in full; the table shows their digests only."""
    big = b'"' + b"x" * 2_000_000 + b'"'
    for n in range(20):
        journal.put(Entry("s-1", f"a{n}", "tool_call", "ok", result=big, result_digest=f"sha256:{n}"))
    journal.close()
    tracemalloc.start()
    try:
        code, out, _ = _cli(capsys, "list", str(journal.path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0 and [line.split()[-1] for line in out.splitlines()[1:]] == [
        f"sha256:{n}" for n in range(20)
    ]
    assert peak < 4_000_000, f"{peak} bytes at the peak"  # 40 MB of outcomes were read before
    assert [e.result for e in journal.entries(outcomes=False)] == [None] * 20
    assert journal.entries()[0].result == big
