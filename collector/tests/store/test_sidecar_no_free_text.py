"""What a span says in free text never reaches the store, nor the APIs' answers.

A span's ``agent.action.*`` attributes are its record, and traces may carry personal
data: an ``agent.action.question``, a 6 MB ``agent.action.notes`` or a prompt's text in
``agent.action.prompt_digest`` was stored word for word and returned by the APIs (the
6 MB one made the session unreadable over gRPC). Spans come from the real SDK
exporters; the store is read as bytes (the SQLite file and its WAL); the findings are
compared with the engine's over the records the spans describe, untouched.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.otlp.receiver import scrub
from durable_sessions_collector.store.stored import MAX_TEXT, STORED_FIELDS, stored_record
from google.protobuf import json_format
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sidecar_clients import grpc_exporter, http_exporter

from durable_sessions.digest import digest_value
from durable_sessions.engine import Checker
from durable_sessions.mapping import from_readable_span, map_span, with_problems
from durable_sessions.rules import select_rules

DIGEST = "sha256:" + "ab" * 32


class Agent:
    """One process run of an agent exporting to the sidecar, keeping a copy of its spans."""

    def __init__(self, exporter: SpanExporter, instance_id: str) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.instance.id": instance_id}))
        self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        self.tracer = self.provider.get_tracer("no-free-text")

    def action(self, session_id: str, action_id: str, kind: str, **fields: Any) -> None:
        attributes = {"session.id": session_id, "agent.action.id": action_id, "agent.action.kind": kind}
        attributes.update({f"agent.action.{name}": value for name, value in fields.items()})
        with self.tracer.start_as_current_span(f"{kind} {action_id[:20]}", attributes=attributes):
            pass

    def spans(self) -> list[Any]:
        return list(self.memory.get_finished_spans())

    def shutdown(self) -> None:
        self.provider.shutdown()


def engine_findings(spans: list[Any]) -> set[tuple[str, str | None]]:
    """(rule, span id) of what the engine finds in the records the spans describe, as the
    sidecar mapped them before it stored anything: the findings the sidecar must keep."""
    checker = Checker(select_rules())
    found = []
    for span in spans:
        mapped = map_span(from_readable_span(span), keep_result=False)
        assert mapped is not None
        scrub(mapped.record)  # type: ignore[arg-type]
        found += checker.feed(with_problems(mapped.record, mapped.problems), mapped.where)
    found += checker.finish()
    return {(v.rule, v.span_id) for v in found}


def sidecar_findings(sidecar: Sidecar, session_id: str) -> set[tuple[str, str | None]]:
    document = sidecar.session(session_id)
    return {(v["rule"], v["span_id"]) for v in document["violations"] if not v["resolved"]}


def store_bytes(store: Path) -> bytes:
    """The SQLite file and its write-ahead log, as bytes."""
    return b"".join(path.read_bytes() for path in (store, Path(f"{store}-wal")) if path.exists())


def api_answers(sidecar: Sidecar, session_id: str) -> Iterator[str]:
    """Every answer the APIs give about ``session_id``: HTTP detail and list, gRPC get and list."""
    for path in ("/api/sessions/" + urllib.parse.quote(session_id, safe=""), "/api/sessions?limit=1000"):
        status, document = sidecar.get(path)
        assert status == 200
        yield json.dumps(document, ensure_ascii=False)
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:  # gRPC's default 4 MiB limit
        api = pb_grpc.SessionServiceStub(channel)
        page = api.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10)
        yield json_format.MessageToJson(page)
        yield json_format.MessageToJson(api.ListSessions(pb.ListSessionsRequest(), timeout=10))


def assert_nowhere(markers: list[str], store: Path, sidecar: Sidecar, session_id: str) -> None:
    data = store_bytes(store)
    answers = list(api_answers(sidecar, session_id))
    for marker in markers:
        assert marker.encode() not in data, marker
        for answer in answers:
            assert marker not in answer, marker


def test_free_text_in_action_attributes_reaches_neither_the_store_nor_the_apis(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    agent = Agent(http_exporter(sidecar.http_url), "inc-1")
    session = "trip-7"
    markers = [f"PERSONAL-{n}-alice@example.com" for n in range(12)]
    agent.action(session, "a1", "tool_call", prompt_text=markers[0], notes=markers[1])
    agent.action(session, "a2", "user_prompt", question=markers[2], answer=markers[3], result="1")
    agent.action(session, "a3", "tool_call", input=markers[4], output=markers[5])
    agent.action(session, "a4", "user_prompt", prompt_digest=markers[6], result="1")  # not a digest
    agent.action(session, "a5", "llm_call", result_digest=markers[7])  # not a digest
    # A violation quotes a bad value's first 37 characters, as the offline checker does.
    agent.action(session, "a6", "tool_call", status="B" * 37 + markers[8])  # not a status
    agent.action(session, "a7", "tool_call", retryable=True, max_attempts="B" * 37 + markers[9])
    agent.action(session, "a8", "payment", idempotency_key=markers[10] + "-2026-01-02-" + "k" * MAX_TEXT)
    agent.action(session, "a9", "tool_call", **{markers[11]: "an attribute name is client text too"})
    agent.action(session, "a10", "user_prompt", prompt="What is your card number?", result="1")
    spans = agent.spans()
    agent.shutdown()

    wait_for(lambda: sidecar.session(session)["state"] == "ended")
    expected = engine_findings(spans)
    assert ("time-derived-key", spans[7].context.span_id.to_bytes(8, "big").hex()) in expected
    assert sidecar_findings(sidecar, session) == expected
    assert_nowhere([*markers, "What is your card number?"], store, sidecar, session)

    actions = sidecar.session(session)["actions"]
    assert len(actions) == 10
    for action in actions:
        assert set(action) - {"trace_id", "span_id", "received_at"} <= STORED_FIELDS
        assert all(len(value) <= MAX_TEXT for value in action.values() if isinstance(value, str))
    assert actions[0]["action_id"] == "a1" and actions[0]["kind"] == "tool_call"  # identifiers stay
    assert actions[3]["result_digest"].startswith("sha256:")  # a digest the mapping made stays
    for violation in sidecar.session(session)["violations"]:
        assert len(violation["message"]) < 2000


def test_a_multi_megabyte_attribute_is_not_stored_and_the_session_reads_over_grpc(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    notes = "N" * 6_000_000
    long_id = "session-" + "S" * 3_000_000
    agent.action("s-big", "big-1", "tool_call", notes=notes)
    agent.action("s-big", "big-2", "payment", idempotency_key="K" * 2_000_000, cache_key="C" * 1_000_000)
    agent.action(long_id, "A" * 1_000_000, "tool_call", retryable=True)
    spans = agent.spans()
    agent.shutdown()

    assert sidecar.metric("durable_sessions_actions_stored_total") == 3
    assert len(store_bytes(store)) < 2_000_000
    assert_nowhere(["N" * 1000, "K" * 1000, "C" * 1000, "S" * 1000, "A" * 1000], store, sidecar, "s-big")
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:  # gRPC's default 4 MiB limit
        api = pb_grpc.SessionServiceStub(channel)
        page = api.GetSession(pb.GetSessionRequest(session_id="s-big", actions_page_size=5000), timeout=10)
        assert [a.action_id for a in page.actions] == ["big-1", "big-2"]
        assert page.ByteSize() < 10_000
        # A long session id is found by the id the spans gave, and shown as its digest.
        long = api.GetSession(pb.GetSessionRequest(session_id=long_id), timeout=10)
        assert long.summary.session_id.startswith("hidden:sha256:")
        assert len(long.actions) == 1 and long.actions[0].action_id.startswith("hidden:sha256:")
        assert [v.rule for v in long.violations] == ["unbounded-retry"]
    wait_for(lambda: sidecar.session("s-big")["state"] == "ended")
    assert sidecar_findings(sidecar, "s-big") == engine_findings(spans[:2])


def test_a_restarted_sidecar_judges_long_keys_and_bad_digests_as_before(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The engine checks the record as stored, so that a session rebuilt from the store
    after a restart compares a long key digest to digest, as it did before: had it checked
    the key itself, the key of the next run's retry would differ from the rebuilt one."""
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, evaluation__idle_s=30)
    key = "pay-" + "K" * 400 + "-SECRET-KEY-TEXT"
    other = "pay-" + "K" * 400 + "-OTHER-KEY-TEXT"
    first = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    first.action("trip-9", "p1", "payment", idempotency_key=key, result_digest=DIGEST)
    first.action("trip-9", "m1", "llm_call", result_digest="NOT-A-DIGEST-answer-text")
    first.action("trip-9", "q1", "user_prompt", prompt_digest="QUESTION-TEXT", result="1")
    first.action("trip-9", "x" * 600, "tool_call", idempotency_key=other)
    spans = first.spans()
    first.shutdown()
    sidecar.stop()

    # Idle long enough that the restarted sidecar's sweep does not end (rebuilding it) the
    # session before the second run's spans come: at 0.3 s, on a loaded machine, it did,
    # and their arrival rebuilt it a second time.
    again = start_sidecar(store, evaluation__idle_s=3)
    second = Agent(grpc_exporter(again.grpc_endpoint), "inc-2")
    second.action("trip-9", "p1", "payment", idempotency_key=key, result_digest=DIGEST)  # same key
    second.action("trip-9", "p2", "payment", idempotency_key=key)  # a key already used by p1
    second.action("trip-9", "m1", "llm_call", result_digest="NOT-A-DIGEST-answer-text")  # same outcome
    second.action("trip-9", "q2", "user_prompt", prompt_digest="QUESTION-TEXT", result="1")  # re-asked
    second.action("trip-9", "x" * 600, "tool_call", idempotency_key=key)  # a different key
    spans += second.spans()
    second.shutdown()

    wait_for(lambda: again.session("trip-9")["state"] == "ended")
    assert again.metric("durable_sessions_sessions_rebuilt_total") == 1
    expected = engine_findings(spans)
    rules = {rule for rule, _ in expected}
    assert {
        "re-executed-side-effect",
        "shared-key",
        "re-asked",
        "unstable-key",
        "diverged-result",
    } <= rules, rules
    assert sidecar_findings(again, "trip-9") == expected
    assert_nowhere(
        ["SECRET-KEY-TEXT", "OTHER-KEY-TEXT", "NOT-A-DIGEST", "QUESTION-TEXT", "x" * 300],
        store,
        again,
        "trip-9",
    )


def test_a_digest_in_upper_case_hex_is_stored_as_given_and_compared(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Java's and .NET's hex encoders write ``sha256:ABCD…``: the sidecar stored such a
    digest as ``hidden:sha256:…`` and never compared it with a recorded result, so a
    replay serving another result than the one recorded went unreported."""
    sidecar = start_sidecar(tmp_path / "sessions.db")
    upper = "sha256:" + digest_value({"plan": "B"})[7:].upper()
    first = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    first.action("trip-8", "m1", "llm_call", result='{"plan": "A"}')
    second = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-2")
    second.action("trip-8", "m1", "llm_call", replayed=True, result_digest=upper)
    spans = first.spans() + second.spans()
    first.shutdown()
    second.shutdown()

    wait_for(lambda: sidecar.session("trip-8")["state"] == "ended")
    replayed_span = spans[1].context.span_id.to_bytes(8, "big").hex()
    assert (
        sidecar_findings(sidecar, "trip-8") == engine_findings(spans) == {("replay-mismatch", replayed_span)}
    )
    assert [action["result_digest"] for action in sidecar.session("trip-8")["actions"]] == [
        digest_value({"plan": "A"}),
        upper,
    ]


@pytest.mark.parametrize(
    "record",
    [
        {"session_id": "s", "action_id": "a", "kind": "k", "status": "ok", "notes": "free text"},
        {"session_id": "s" * 1000, "action_id": "a" * 300, "status": "done", "result_digest": "x"},
        {"idempotency_key": "k-2026-01-02-" + "k" * 300, "max_attempts": "3", "kind": ["a", "b"]},
        {"prompt_digest": DIGEST, "incarnation": b"\x00" * 400, "cache_key": {"a": 1}, "ts": 1.5},
    ],
)
def test_a_stored_record_stored_again_is_the_same(record: dict[str, Any]) -> None:
    stored = stored_record(record)  # type: ignore[arg-type]
    assert stored_record(stored) == stored


def test_a_postgresql_store_keeps_no_free_text_either(start_sidecar, postgres_url: str) -> None:  # type: ignore[no-untyped-def]
    """Both stores write the row one builder makes: the same records in PostgreSQL."""
    import psycopg
    from durable_sessions_collector.store.postgres import split_url

    sidecar = start_sidecar(postgres_url)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    long_id = "trip-" + "S" * 5_000  # an HTTP request line holds it
    agent.action(long_id, "a1", "tool_call", notes="N" * 3_000_000, question="PERSONAL-QUESTION")
    agent.action(long_id, "a2", "llm_call", result_digest="PERSONAL-NOT-A-DIGEST")
    spans = agent.spans()
    agent.shutdown()

    wait_for(lambda: sidecar.session(long_id)["state"] == "ended")
    assert sidecar_findings(sidecar, long_id) == engine_findings(spans)
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn) as db:
        rows = db.execute(f'SELECT session_id, record FROM "{schema}".actions').fetchall()
        messages = db.execute(f'SELECT message FROM "{schema}".violations').fetchall()
    assert len(rows) == 2
    text = json.dumps([rows, messages])
    for marker in ("N" * 1000, "S" * 1000, "PERSONAL"):
        assert marker not in text
    for answer in api_answers(sidecar, long_id):
        assert "PERSONAL" not in answer and "S" * 1000 not in answer


def test_no_hidden_form_reads_as_a_time() -> None:
    """time-derived-key reads compact dates (``20261101``) and epoch numbers in a key: the
    hidden form's digits come in groups of seven, so a long key without a time never looks
    like one. In groups of eight, one key in a few thousand did (a date in a group)."""
    from durable_sessions_collector.store.stored import hidden

    from durable_sessions.rules.record_rules import time_component

    for n in range(20_000):
        shown = hidden(f"key-{n}")
        assert time_component(shown) is None, shown


def test_a_long_session_id_stored_whole_by_an_older_sidecar_is_still_found(
    start_sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Before the stored record, a session id of any length was stored as given: the API
    looks a long id up by its stored digest, and then by the id itself."""
    from durable_sessions_collector.store import stored

    sidecar = start_sidecar()
    long_id = "trip-" + "S" * 1_000
    monkeypatch.setattr(stored, "MAX_TEXT", 10_000)  # as an older sidecar stored it
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action(long_id, "a1", "tool_call")
    agent.shutdown()
    monkeypatch.undo()
    assert sidecar.session(long_id)["session_id"] == long_id
