"""The idle sweep ends idle sessions a batch at a time, between write batches."""

from __future__ import annotations

import sqlite3
import time

from conftest import wait_for
from durable_sessions_collector import pipeline
from sidecar_clients import Agent, grpc_exporter


def test_a_wave_of_idle_sessions_is_ended_one_batch_per_sweep(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pipeline, "IDLE_BATCH", 3)
    sidecar = start_sidecar(evaluation__idle_s=3600)  # the writer's own sweeps never find these idle
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(7):
        agent.action(f"s{n}", "e1", "email", status="started")  # unresolved at the end
    agent.shutdown()
    later = time.time() + 7200
    sweep = sidecar.service.pipeline.sweep
    assert [sweep(later), sweep(later), sweep(later), sweep(later)] == [3, 3, 1, 0]
    ended = [sidecar.session(f"s{n}") for n in range(7)]
    assert all(s["state"] == "ended" and s["verdict"] == "unrecoverable" for s in ended)
    assert sidecar.metric("durable_sessions_sessions_ended_total") == 7


def test_a_restart_longer_than_idle_s_ends_no_session_before_its_queued_spans_arrive(
    start_sidecar, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Idleness counts from when the sidecar began accepting spans at the earliest: the
    span a Collector queued during the restart arrives after it, and no session was ended
    (nor alerted on) for the outage."""
    # idle_s: long enough that a busy machine delivers the queued span within it of the
    # restart (with 1 s, starting the sidecar and an exporter took longer under load).
    idle_s = 3.0
    store = tmp_path / "restart.db"
    sidecar = start_sidecar(store, evaluation__idle_s=idle_s)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("mail", "e1", "email", status="started")  # pending until its completion
    agent.shutdown()
    sidecar.stop()
    time.sleep(idle_s + 0.2)  # the upgrade took longer than idle_s
    sidecar = start_sidecar(store, evaluation__idle_s=idle_s)
    time.sleep(0.4)  # the writer has swept a few times; the queued span is on its way
    assert sidecar.session("mail")["state"] == "active"
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("mail", "e1", "email", status="ok", idempotency_key="k-e1")  # the queued span
    agent.shutdown()
    wait_for(lambda: sidecar.session("mail")["state"] == "ended")
    assert sidecar.session("mail")["verdict"] == "ok"
    # An alert is queued in the commit that ends the session, and its line written after
    # it: the outbox, not the log, says at once whether any was raised.
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    db.close()
    assert sidecar.alerts() == []


def test_a_sweep_rebuilding_sessions_commits_once_it_has_re_fed_its_budget(
    start_sidecar, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """After a restart no session is in memory, and ending one rebuilds it from the store:
    a sweep stops at SWEEP_REFEED re-fed records and lets the next write batch in."""
    monkeypatch.setattr(pipeline, "SWEEP_REFEED", 5)
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, evaluation__idle_s=3600)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(3):
        for a in range(4):
            agent.action(f"s{n}", f"a{a}", "tool_call")
    agent.shutdown()
    sidecar.stop()
    sidecar = start_sidecar(store, evaluation__idle_s=3600)  # holds no session
    later = time.time() + 7200
    sweep = sidecar.service.pipeline.sweep
    assert [sweep(later), sweep(later), sweep(later)] == [2, 1, 0]  # 4 + 4 records re-fed, then 4
    assert all(sidecar.session(f"s{n}")["state"] == "ended" for n in range(3))
    assert sidecar.service.evaluator.refed == 12


def test_a_sweep_failing_again_and_again_is_logged_once_with_a_count_then_its_recovery(
    start_sidecar, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # With idle_s 0.3 the writer sweeps every 75 ms: a store refusing the sweep's writes
    # (a real trigger on the store file) logged a line each time.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, evaluation__idle_s=0.3)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("idle", "e1", "email", status="started")
    agent.shutdown()
    with sqlite3.connect(store) as db:  # before the session is idle
        db.execute("CREATE TRIGGER broken BEFORE UPDATE ON sessions BEGIN SELECT 1 FROM no_such_table; END")
    db.close()
    wait_for(lambda: any(line["event"] == "idle-sweep-failed" for line in sidecar.log.lines()))
    # Several failed sweeps, counted as they fail (a fixed second saw fewer under load).
    wait_for(lambda: sidecar.metric("durable_sessions_store_commit_failures_total") >= 5)
    with sqlite3.connect(store) as db:
        db.execute("DROP TRIGGER broken")
    db.close()
    wait_for(lambda: sidecar.session("idle")["state"] == "ended")
    # The recovery is logged once the sweep has returned, after the commit the API shows.
    wait_for(lambda: any(line["event"] == "idle-sweep-recovered" for line in sidecar.log.lines()))
    lines = sidecar.log.lines()
    assert [line["failures"] for line in lines if line["event"] == "idle-sweep-failed"] == [1]
    [recovered] = [line for line in lines if line["event"] == "idle-sweep-recovered"]
    assert recovered["failures"] >= 5
    assert sidecar.metric("durable_sessions_store_commit_failures_total") == recovered["failures"]
