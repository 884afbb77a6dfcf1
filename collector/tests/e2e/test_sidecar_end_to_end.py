"""End to end: real SDK exporters (gRPC, HTTP protobuf, HTTP JSON) into a real sidecar.

One session (``trip-1``) runs across several traces and two process incarnations, the
first exporting over gRPC and the second over HTTP; other sessions arrive as OTLP/JSON.
The sidecar is then restarted on the same store, and a third incarnation continues the
session: the rebuilt state must still know what the first incarnation recorded, and no
alert may be raised a second time.
"""

from __future__ import annotations

import json
import sqlite3

from conftest import wait_for
from sidecar_clients import Agent, OtlpJsonExporter, grpc_exporter, http_exporter

ANSWER = json.dumps({"budget_gbp": 2400})
SECRET = "my card ends 4242"  # result text that must never reach the store


def run_first_incarnations(sidecar) -> tuple[Agent, Agent, OtlpJsonExporter]:  # type: ignore[no-untyped-def]
    first = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    with first.trace("plan"):
        first.action("trip-1", "a01", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")
        first.action("trip-1", "a02", "llm_call", result=json.dumps({"text": SECRET}))
    with first.trace("book"):
        first.action("trip-1", "a03", "payment", idempotency_key="trip-1/a03")
        first.action("trip-1", "a04", "tool_call", retryable=True)  # unbounded-retry
        first.action("trip-4", "p1", "payment", idempotency_key="trip-4/p1")

    # The process died; a new incarnation resumes the session over HTTP/protobuf.
    second = Agent(http_exporter(sidecar.http_url), "inc-2")
    with second.trace("resume"):
        first_answer_replayed = {"replayed": True, "result": ANSWER}
        second.action("trip-1", "a01", "user_prompt", **first_answer_replayed)
        second.action("trip-1", "a03", "payment", idempotency_key="trip-1/a03", replayed=True)
    with second.trace("resume-2"):
        second.action("trip-1", "a06", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")  # re-asked
        second.action("trip-1", "a05", "llm_call")  # unrecorded-result
        second.action("trip-4", "p1", "payment", idempotency_key="trip-4/p1")  # re-sent with its key: warning

    json_exporter = OtlpJsonExporter(sidecar.http_url + "/v1/traces")
    third = Agent(json_exporter, "inc-j")
    with third.trace("good"):
        third.action("trip-2", "b01", "user_prompt", result=ANSWER)
        third.action("trip-2", "b02", "email", idempotency_key="trip-2/b02")
    return first, second, json_exporter


def rules_of(session: dict) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return sorted((v["rule"], v["action_id"]) for v in session["violations"] if not v["resolved"])


def test_sessions_across_transports_incarnations_and_a_restart(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    first, second, json_exporter = run_first_incarnations(sidecar)

    # Every Export was acknowledged after commit: the records are readable at once.
    trip1 = sidecar.session("trip-1")
    assert [a["action_id"] for a in trip1["actions"]] == [
        "a01",
        "a02",
        "a03",
        "a04",
        "a01",
        "a03",
        "a06",
        "a05",
    ]
    assert [a["incarnation"] for a in trip1["actions"]] == ["inc-1"] * 4 + ["inc-2"] * 4
    assert len({a["trace_id"] for a in trip1["actions"]}) == 4
    assert trip1["verdict"] == "unrecoverable"
    assert rules_of(trip1) == [
        ("re-asked", "a06"),
        ("unbounded-retry", "a04"),
        ("unrecorded-result", "a05"),
    ]
    # Digests only: no result text is stored, but the recorded outcome still counts.
    assert all("result" not in action for action in trip1["actions"])
    assert trip1["actions"][1]["result_digest"].startswith("sha256:")
    raw = store.read_bytes() + (tmp_path / "sessions.db-wal").read_bytes()
    assert SECRET.encode() not in raw and b"budget_gbp" not in raw

    assert sidecar.session("trip-2")["verdict"] == "ok"
    assert sidecar.session("trip-2")["violations"] == []
    trip4 = sidecar.session("trip-4")
    assert trip4["verdict"] == "at_risk"
    assert [(v["rule"], v["severity"]) for v in trip4["violations"]] == [
        ("re-executed-side-effect", "warning")
    ]

    # OTLP/JSON full success: partial_success left unset.
    assert json_exporter.responses == [{}, {}, {}]

    status, listed = sidecar.get("/api/sessions?verdict=unrecoverable")
    assert status == 200 and [s["session_id"] for s in listed["sessions"]] == ["trip-1"]
    status, listed = sidecar.get("/api/sessions")
    assert sorted(s["session_id"] for s in listed["sessions"]) == ["trip-1", "trip-2", "trip-4"]
    assert sidecar.get("/api/sessions?verdict=bad")[0] == 400
    assert sidecar.get("/api/sessions/nope")[0] == 404
    assert sidecar.get("/healthz") == (200, {"status": "ok"})

    metrics = sidecar.metrics()
    # Each "with trace()" adds a root span that is no action.
    assert metrics[("durable_sessions_spans_received_total", (("transport", "grpc"),))] == 5 + 2
    assert metrics[("durable_sessions_spans_received_total", (("transport", "http"),))] == (5 + 2) + (2 + 1)
    assert metrics[("durable_sessions_spans_not_action_total", ())] == 5
    assert metrics[("durable_sessions_actions_stored_total", ())] == 12
    assert metrics[("durable_sessions_violations_total", (("rule", "re-asked"), ("severity", "error")))] == 1
    assert (
        metrics[
            (
                "durable_sessions_violations_total",
                (("rule", "re-executed-side-effect"), ("severity", "warning")),
            )
        ]
        == 1
    )
    assert metrics[("durable_sessions_sessions", (("verdict", "unrecoverable"),))] == 1
    assert metrics[("durable_sessions_sessions", (("verdict", "at_risk"),))] == 1
    assert metrics[("durable_sessions_sessions", (("verdict", "ok"),))] == 1
    assert metrics[("durable_sessions_export_duration_seconds_count", (("transport", "grpc"),))] == 7
    assert metrics[("durable_sessions_queue_capacity", ())] == 64

    # One alert line per violation, each once.
    stored = {v["key"] for s in ("trip-1", "trip-4") for v in sidecar.session(s)["violations"]}
    alerts = sidecar.alerts_once(len(stored))
    assert sorted(a["key"] for a in alerts) == sorted(stored)
    assert {a["session_verdict"] for a in alerts if a["session_id"] == "trip-1"} == {"unrecoverable"}

    # The sessions go idle: end-of-session rules run (nothing pending here), state ends.
    wait_for(lambda: sidecar.session("trip-1")["state"] == "ended")
    first.shutdown()
    second.shutdown()

    # Restart on the same store; a third incarnation re-runs a recorded llm_call. The
    # session must stay active across the two Exports of this incarnation, however slow the
    # machine: a short idle_s would end it between them and rebuild it again.
    sidecar.stop()
    again = start_sidecar(store, evaluation__idle_s=30)
    third = Agent(grpc_exporter(again.grpc_endpoint), "inc-3")
    with third.trace("resume-3"):
        third.action("trip-1", "a02", "llm_call", result=json.dumps({"text": "a different answer"}))
        third.action("trip-1", "a01", "user_prompt", replayed=True, result=ANSWER)
    trip1 = again.session("trip-1")
    assert trip1["state"] == "active"
    assert ("diverged-result", "a02") in rules_of(trip1)
    assert len(trip1["actions"]) == 10
    # Only the new finding is alerted by the new process; nothing old is raised again.
    assert [(a["rule"], a["action_id"]) for a in again.alerts_once(1)] == [("diverged-result", "a02")]
    assert again.metric("durable_sessions_sessions_rebuilt_total") == 1
    third.shutdown()

    again.stop()
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        keys = [key for (key,) in db.execute("SELECT violation_key FROM outbox WHERE channel = 'log'")]
        assert len(keys) == len(set(keys)) == db.execute("SELECT COUNT(*) FROM violations").fetchone()[0]


def test_idle_session_is_ended_and_judged_again_when_it_resumes(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # idle_s long enough that a busy machine cannot end the session between two steps below.
    sidecar = start_sidecar(evaluation__idle_s=2)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    # Write-ahead intent of an unkeyed email, then the process goes quiet.
    agent.action("s-idle", "e1", "email", status="started")
    assert sidecar.session("s-idle")["verdict"] == "ok"  # not judged before the session ends
    ended = wait_for(lambda: (s := sidecar.session("s-idle"))["state"] == "ended" and s)
    assert rules_of(ended) == [("unresolved-side-effect", "e1")]
    assert ended["verdict"] == "unrecoverable"
    assert [a["rule"] for a in sidecar.alerts_once(1)] == ["unresolved-side-effect"]

    # The completion arrives later (a slow exporter): the session reopens, is rebuilt
    # from the store, and its end-of-session rules run again: the finding is resolved.
    agent.action("s-idle", "e1", "email", replay="skip")
    assert sidecar.session("s-idle")["state"] == "active"
    resumed = wait_for(lambda: (s := sidecar.session("s-idle"))["state"] == "ended" and s)
    assert rules_of(resumed) == []
    assert resumed["verdict"] == "ok"
    assert [v["resolved"] for v in resumed["violations"]] == [True]
    # The sweep counts the ended session and writes the resolution's line after its
    # commit, which the API shows first.
    wait_for(lambda: sidecar.metric("durable_sessions_sessions_ended_total") == 2)
    wait_for(lambda: [line for line in sidecar.log.lines() if line.get("event") == "violation-resolved"])
    assert len(sidecar.alerts()) == 1  # resolved, not raised again
    agent.shutdown()


def test_sessions_beyond_the_memory_bound_are_rebuilt_from_the_store(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(evaluation__max_sessions=2, evaluation__idle_s=60)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(5):
        agent.action(f"s{n}", "k", "payment", idempotency_key=f"key-{n}")
    # s0 was evicted long ago; a second payment under the same key and another id is
    # only a shared-key violation if s0's history is rebuilt from the store.
    agent.action("s0", "k2", "payment", idempotency_key="key-0")
    assert rules_of(sidecar.session("s0")) == [("shared-key", "k2")]
    assert sidecar.metric("durable_sessions_sessions_in_memory") == 2
    assert sidecar.metric("durable_sessions_sessions_rebuilt_total") == 1
    agent.shutdown()
