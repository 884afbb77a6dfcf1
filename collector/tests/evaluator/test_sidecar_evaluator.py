"""The evaluator: rebuilding from the store gives exactly the engine's uninterrupted result."""

from __future__ import annotations

import random
from pathlib import Path

from durable_sessions_collector.evaluator import Evaluator, arrival
from durable_sessions_collector.store import open_store

from durable_sessions.engine import Checker
from durable_sessions.mapping import Mapped
from durable_sessions.record import Location
from durable_sessions.rules import select_rules

KINDS = ["payment", "user_prompt", "llm_call", "tool_call", "email"]


def stream(n: int, seed: int = 7) -> list[Mapped]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        session = f"s{rng.randrange(6)}"
        record = {
            "session_id": session,
            "action_id": f"a{rng.randrange(15)}",
            "kind": rng.choice(KINDS),
            "status": rng.choice(["ok", "ok", "error", "started"]),
            "incarnation": f"inc-{rng.randrange(3)}",
            "seq": i,
        }
        if rng.random() < 0.5:
            record["idempotency_key"] = f"k{rng.randrange(8)}"
        if rng.random() < 0.4:
            record["result_digest"] = f"sha256:{rng.randrange(3)}"
        if rng.random() < 0.2:
            record["replayed"] = True
        if rng.random() < 0.2:
            record.update(retryable=True, max_attempts=3, attempts=rng.randrange(1, 5))
        items.append(Mapped(record, Location(None, None, f"{i:032x}", f"{i + 1:016x}")))  # type: ignore[arg-type]
    return items


def test_a_tiny_memory_bound_gives_the_same_findings_as_an_unbounded_engine(tmp_path: Path) -> None:
    items = stream(400)
    reference = Checker(select_rules())
    expected = {v.key for item in items for v in reference.feed(dict(item.record), item.where)}  # type: ignore[arg-type]
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    evaluator = Evaluator(max_sessions=1)
    found = set()
    for start in range(0, len(items), 25):
        with store.writer() as writer:
            for item in items[start : start + 25]:
                stored, violations = evaluator.ingest(writer, arrival(item), 0.0)
                assert stored
                found.update(v.key for v in violations)
    assert evaluator.held == 1
    assert evaluator.rebuilt > 50  # sessions really were rebuilt over and over
    assert found == expected
    # End-of-session findings match too, for evicted and held sessions alike.
    end_expected = {v.key for v in reference.finish()}
    with store.writer() as writer:
        end_found = {v.key for s in {i.record["session_id"] for i in items} for v in evaluator.end(writer, s)}
    assert end_found == end_expected
    store.close()


def test_redelivered_spans_are_neither_stored_nor_checked_twice(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    evaluator = Evaluator()
    item = Mapped(
        {"session_id": "s", "action_id": "p", "kind": "payment", "status": "ok"},  # type: ignore[typeddict-item]
        Location(None, None, "1" * 32, "2" * 16),
    )
    with store.writer() as writer:
        stored, violations = evaluator.ingest(writer, arrival(item), 0.0)
        assert stored and [v.rule for v in violations] == ["unkeyed-side-effect"]
        assert evaluator.ingest(writer, arrival(item), 0.0) == (False, [])
    store.close()


def test_spans_of_one_span_id_in_two_traces_of_a_session_are_both_checked(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    # A span id is unique within its trace only: the same id in another trace is another
    # span, which the store keeps beside the first. The engine took it for the first
    # delivered again (it remembers an action's last span id, not its trace) and judged
    # nothing of it: here, a second run of action a1 went without its duplicate-action-id.
    import grpc
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span
    from sidecar_clients import any_value, export_call, request_of

    sidecar = start_sidecar(store_url, evaluation__idle_s=3600)
    attributes = {"session.id": "s", "agent.action.id": "a1", "agent.action.kind": "tool_call"}

    def span(trace: int) -> Span:
        return Span(
            trace_id=bytes([trace] * 16),
            span_id=bytes([7] * 8),
            name="action a1",
            start_time_unix_nano=1_700_000_000_000_000_000 + trace,
            end_time_unix_nano=1_700_000_000_000_000_000 + trace + 1,
            attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
        )

    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        for trace in (1, 2):
            response = export_call(channel)(request_of(span(trace)).SerializeToString(), timeout=20)
            assert not response.HasField("partial_success")
    detail = sidecar.session("s")
    assert [a["trace_id"] for a in detail["actions"]] == ["01" * 16, "02" * 16]
    assert [(v["rule"], v["trace_id"]) for v in detail["violations"]] == [("duplicate-action-id", "02" * 16)]
