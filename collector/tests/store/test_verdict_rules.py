"""The verdicts count the findings of the rules the sidecar runs (evaluation.strict), on
SQLite and PostgreSQL: turning strict off makes a session judged only by a strict-only
rule ok again, turning it on makes it unrecoverable again, and the list filter, /metrics,
the gRPC and HTTP details and the CLI agree; the recount survives an interruption; the
end-of-session step leaves findings of rules not run alone."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector import pipeline as pipeline_module
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.cli import main
from durable_sessions_collector.store import open_store
from durable_sessions_collector.store.base import RECOUNT, VERDICT_RULES
from durable_sessions_collector.verdict_rules import adopt, recount_step
from sidecar_clients import Agent, grpc_exporter

from durable_sessions.rules import select_rules
from durable_sessions.violation import Severity, Violation

LENIENT = frozenset(rule.id for rule in select_rules(strict=False))
STRICT = frozenset(rule.id for rule in select_rules(strict=True))


def run(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def events(sidecar: Sidecar, name: str) -> list[dict[str, Any]]:
    return [line for line in sidecar.log.lines() if line.get("event") == name]


def listed(sidecar: Sidecar, verdict: str) -> list[str]:
    status, document = sidecar.get(f"/api/sessions?verdict={verdict}")
    assert status == 200, document
    return sorted(session["session_id"] for session in document["sessions"])


def grpc_violations(sidecar: Sidecar, session_id: str) -> list[tuple[str, bool]]:
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        answer = pb_grpc.SessionServiceStub(channel).GetSession(
            pb.GetSessionRequest(session_id=session_id), timeout=10
        )
    return [(v.rule, v.not_counted) for v in answer.violations]


def dead_ends(sidecar: Sidecar, sessions: list[str]) -> None:
    """Each of ``sessions``: one failed tool call, a dead end only strict finds."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for session_id in sessions:
        agent.action(session_id, "t1", "tool_call", error=True)
    agent.shutdown()


def test_a_session_judged_by_a_strict_only_rule_follows_the_setting_across_restarts(
    start_sidecar, store_url, capsys
) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    dead_ends(sidecar, ["dead"])
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("fine", "a1", "payment", idempotency_key="k-fine")
    agent.shutdown()
    detail = sidecar.session("dead")
    assert (detail["verdict"], detail["errors"]) == ("unrecoverable", 1)
    assert [(v["rule"], v["not_counted"]) for v in detail["violations"]] == [("dead-end", False)]
    sidecar.stop()

    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=False)
    (changed,) = wait_for(lambda: events(sidecar, "verdict-rules-changed"))
    assert (changed["added"], changed["removed"], changed["recount"]) == ([], ["dead-end"], ["dead-end"])
    assert changed["level"] == ("warning" if store_url.startswith("postgresql") else "info")
    (done,) = wait_for(lambda: events(sidecar, "verdict-recount-done"))
    assert done["sessions"] == 1
    detail = sidecar.session("dead")
    assert (detail["verdict"], detail["errors"], detail["warnings"]) == ("ok", 0, 0)
    # The finding is kept, and shown as not counted, in every front end.
    assert [(v["rule"], v["not_counted"]) for v in detail["violations"]] == [("dead-end", True)]
    assert grpc_violations(sidecar, "dead") == [("dead-end", True)]
    code, out, _ = run(capsys, "sessions", "--endpoint", sidecar.http_url, "show", "dead")
    assert code == 0 and out.startswith("session dead: ok (active)")
    assert "  error  dead-end  action t1: " in out and "(not counted: rule not run)" in out
    assert listed(sidecar, "unrecoverable") == [] and listed(sidecar, "ok") == ["dead", "fine"]
    assert sidecar.metric("durable_sessions_sessions", verdict="unrecoverable") == 0
    assert sidecar.metric("durable_sessions_sessions", verdict="ok") == 2
    sidecar.stop()

    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    (changed,) = wait_for(lambda: events(sidecar, "verdict-rules-changed"))
    assert (changed["added"], changed["removed"]) == (["dead-end"], [])
    wait_for(lambda: events(sidecar, "verdict-recount-done"))
    detail = sidecar.session("dead")
    assert (detail["verdict"], detail["errors"]) == ("unrecoverable", 1)
    assert grpc_violations(sidecar, "dead") == [("dead-end", False)]
    assert listed(sidecar, "unrecoverable") == ["dead"]
    assert sidecar.metric("durable_sessions_sessions", verdict="unrecoverable") == 1
    sidecar.stop()

    # The same setting again: nothing changed, nothing recounted.
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    assert sidecar.session("dead")["verdict"] == "unrecoverable"
    assert not events(sidecar, "verdict-rules-changed") and not events(sidecar, "verdict-recount-done")


def test_new_spans_are_judged_by_the_rules_counted_now(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    """A write batch's refresh of a verdict counts the current rules too: a span arriving
    for the session after strict was turned off leaves it ok."""
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    dead_ends(sidecar, ["dead"])
    sidecar.stop()
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-2")
    agent.action("dead", "t2", "payment", idempotency_key="k-dead")
    agent.shutdown()
    wait_for(lambda: events(sidecar, "verdict-recount-done"))
    assert sidecar.session("dead")["verdict"] == "ok"


def test_the_recount_resumes_where_an_interrupted_one_stopped(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    sessions = [f"d{n}" for n in range(5)]
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    dead_ends(sidecar, sessions)
    sidecar.stop()

    # A sidecar without strict that stopped (crashed) after the first step of its recount:
    # the selection is stored, two sessions are recounted, the place is kept.
    store = open_store(store_url)
    try:
        assert adopt(store, LENIENT).recount == {"dead-end"}
        with store.writer() as writer:
            assert recount_step(writer, lambda writer, ids: None, window=2) == (False, 2)
        with store.writer() as writer:
            assert writer.read_meta(RECOUNT) is not None
        assert sorted(s.session_id for s in store.list_sessions("unrecoverable")) == ["d2", "d3", "d4"]
    finally:
        store.close()

    sidecar = start_sidecar(store_url, evaluation__idle_s=3600)
    (resumed,) = wait_for(lambda: events(sidecar, "verdict-recount-resumed"))
    assert resumed["rules"] == ["dead-end"]
    (done,) = wait_for(lambda: events(sidecar, "verdict-recount-done"))
    assert done["sessions"] == 3  # those left, not all five again
    assert listed(sidecar, "unrecoverable") == [] and listed(sidecar, "ok") == sessions
    assert sidecar.metric("durable_sessions_sessions", verdict="ok") == 5
    assert not events(sidecar, "verdict-rules-changed")
    sidecar.stop()
    store = open_store(store_url)
    try:
        with store.writer() as writer:
            assert writer.read_meta(RECOUNT) is None
            assert writer.read_meta(VERDICT_RULES) is not None
    finally:
        store.close()


def test_a_change_during_an_unfinished_recount_recounts_from_the_start(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    """Strict off, interrupted after a first step, then strict on again: the sessions that
    step recounted are recounted again (the new recount starts over), the others too."""
    sessions = ["d0", "d1", "d2"]
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    dead_ends(sidecar, sessions)
    sidecar.stop()
    store = open_store(store_url)
    try:
        adopt(store, LENIENT)
        with store.writer() as writer:
            recount_step(writer, lambda writer, ids: None, window=2)
        assert sorted(s.session_id for s in store.list_sessions("ok")) == ["d0", "d1"]
    finally:
        store.close()
    sidecar = start_sidecar(store_url, evaluation__idle_s=3600, evaluation__strict=True)
    (changed,) = wait_for(lambda: events(sidecar, "verdict-rules-changed"))
    assert changed["recount"] == ["dead-end"]
    (done,) = wait_for(lambda: events(sidecar, "verdict-recount-done"))
    assert done["sessions"] == 3
    assert listed(sidecar, "unrecoverable") == sessions


def test_the_end_of_a_session_leaves_findings_of_rules_not_run_alone(store_url) -> None:  # type: ignore[no-untyped-def]
    """resolve_end_violations neither resolves an end-of-session finding whose rule did not
    run (not finding it again says nothing) nor holds one again, and the verdict leaves it
    out; the rules that ran settle theirs as before."""
    store = open_store(store_url)
    try:
        store.counted = frozenset({"retry-not-escalated"})
        not_run = Violation("unresolved-side-effect", Severity.ERROR, "pending", "s", "a1", span_id="p1")
        ran = Violation("retry-not-escalated", Severity.WARNING, "gave up", "s", "a2", span_id="p2")
        settled_before = Violation(
            "unresolved-side-effect", Severity.ERROR, "pending", "s", "a3", span_id="p3"
        )
        with store.writer() as writer:
            writer.touch_session("s", 1.0, 3)
            for violation in (not_run, ran, settled_before):
                assert writer.add_violation(violation, at_end=True, now=1.0)
        # One of the rule not run was resolved before (by a run that ran it).
        store.counted = None
        with store.writer() as writer:
            writer.resolve_end_violations("s", {not_run.key, ran.key}, now=2.0)
        store.counted = frozenset({"retry-not-escalated"})
        with store.writer() as writer:
            settled = writer.resolve_end_violations("s", {settled_before.key}, now=3.0)
            verdict = writer.refresh_verdict("s")
        assert [v["key"] for v in settled.resolved] == [ran.key]
        assert settled.held_again == set()  # the resolved one of the rule not run stays so
        assert verdict == "ok"
        detail = store.get_session("s")
        assert detail is not None
        state = {v["key"]: (v["resolved"], v["not_counted"]) for v in detail.violations}
        assert state == {not_run.key: (False, True), ran.key: (True, False), settled_before.key: (True, True)}
        assert (detail.summary.errors, detail.summary.warnings) == (0, 0)
        store.counted = None  # every rule counted: the unresolved finding counts again
        with store.writer() as writer:
            assert writer.refresh_verdict("s") == "unrecoverable"
    finally:
        store.close()


@pytest.mark.postgres
def test_replicas_with_other_rules_say_so(start_sidecar, postgres_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two replicas of one PostgreSQL store with different settings: the second logs the
    change as a warning, and the first, looking again, logs the conflict as an error."""
    monkeypatch.setattr(pipeline_module, "RULES_CHECK_EVERY_S", 0.2)
    first = start_sidecar(postgres_url, evaluation__idle_s=3600, evaluation__strict=True)
    dead_ends(first, ["dead"])
    second = start_sidecar(postgres_url, evaluation__idle_s=3600)
    (changed,) = wait_for(lambda: events(second, "verdict-rules-changed"))
    assert changed["level"] == "warning" and "same settings" in changed["note"]
    (conflict,) = wait_for(lambda: events(first, "verdict-rules-conflict"))
    assert conflict["level"] == "error"
    assert "dead-end" in conflict["ours"] and "dead-end" not in conflict["stored"]
    assert not events(second, "verdict-rules-conflict")
