"""WatchAlerts streams changes of a violation's status too: a resolution and a second
firing reach a watcher as alerts of their own, in commit order, filtered like new
violations, and a watcher that reconnects from a cursor (to another sidecar process on
the same store) gets what followed it, nothing missed and nothing twice.

Real sidecars (SQLite, and PostgreSQL when configured) over real gRPC channels, spans
from the real SDK exporter. The scenario is the resolved-alerts one: an email started
and never completed is ``unresolved-side-effect`` when the session goes idle; its
completion (status ``error``: nothing was sent) resolves it at the next end; a later
keyed start of the same action makes it hold again (and is itself a
``duplicate-action-id``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector.api.grpc_api import CURSOR_METADATA
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from sidecar_clients import Agent, grpc_exporter

SESSION, ACTION, EFFECT = "late", "mail-1", "unresolved-side-effect"
FIRING, RESOLVED = pb.ALERT_STATUS_FIRING, pb.ALERT_STATUS_RESOLVED


def send(sidecar: Sidecar, **fields: Any) -> None:
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "run-1")
    agent.action(SESSION, ACTION, "email", **fields)
    agent.shutdown()


def ended(sidecar: Sidecar) -> dict[str, Any]:
    """The session once its end-of-session rules ran on what was sent."""
    return wait_for(lambda: (found := sidecar.session(SESSION))["state"] == "ended" and found)  # type: ignore[no-any-return]


class Watch:
    """One WatchAlerts stream of a sidecar."""

    def __init__(self, sidecar: Sidecar, timeout: float = 30, **request: Any) -> None:
        self.channel = grpc.insecure_channel(sidecar.grpc_endpoint)
        self.call = pb_grpc.SessionServiceStub(self.channel).WatchAlerts(
            pb.WatchAlertsRequest(**request), timeout=timeout
        )
        self.start = dict(self.call.initial_metadata())[CURSOR_METADATA]  # established

    def take(self, count: int) -> list[pb.Alert]:
        return [next(self.call) for _ in range(count)]

    def rest(self) -> list[pb.Alert]:
        """Every alert until the stream's deadline: what a watcher would get besides."""
        found = []
        with pytest.raises(grpc.RpcError) as ended:
            found.extend(self.call)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return found

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def watches() -> Iterator[list[Watch]]:
    opened: list[Watch] = []
    yield opened
    for watch in opened:
        watch.close()


def described(alerts: list[pb.Alert]) -> list[tuple[str, int]]:
    return [(alert.violation.rule, alert.status) for alert in alerts]


def seconds(alert: pb.Alert) -> float:
    return alert.detected_at.ToNanoseconds() / 1e9


def test_a_watcher_sees_fire_resolve_fire_again_and_resumes_from_a_cursor(  # type: ignore[no-untyped-def]
    start_sidecar, store_url: str, watches: list[Watch]
) -> None:
    first = start_sidecar(store_url)
    watch = Watch(first)
    watches.append(watch)

    send(first, status="started")
    [violation] = ended(first)["violations"]
    [fired] = watch.take(1)
    assert (fired.violation.key, fired.status, fired.session_verdict) == (
        violation["key"],
        FIRING,
        pb.VERDICT_UNRECOVERABLE,
    )
    assert fired.detected_at == fired.violation.created_at

    send(first, status="error", error=True)  # nothing was sent: settled
    settled = ended(first)
    assert [v["resolved"] for v in settled["violations"]] == [True]
    [resolved] = watch.take(1)
    assert (resolved.violation.key, resolved.status, resolved.session_verdict) == (
        violation["key"],
        RESOLVED,
        pb.VERDICT_OK,
    )
    assert resolved.violation.resolved and resolved.cursor != fired.cursor
    assert seconds(resolved) == pytest.approx(settled["ended_at"], abs=1e-6)  # that end found it
    # The watch reads the commit; the log channel writes its line after it.
    [logged] = wait_for(lambda: [line for line in first.log.lines() if line["event"] == "violation-resolved"])
    assert seconds(resolved) == pytest.approx(logged["detected_at"], abs=1e-6)  # as the log channel says

    # The filters apply to changes as to new violations: by rule, and by the session's verdict now (ok).
    by_verdict = [
        Watch(first, cursor=watch.start, verdicts=[v], timeout=2) for v in (pb.VERDICT_OK, pb.VERDICT_AT_RISK)
    ]
    watches.extend(by_verdict)
    assert described(by_verdict[0].rest()) == [(EFFECT, FIRING), (EFFECT, RESOLVED)]
    assert by_verdict[1].rest() == []

    # The watcher goes away after the resolution; the sidecar is restarted meanwhile.
    watch.close()
    first.stop()
    second = start_sidecar(store_url)
    send(second, status="started", idempotency_key="mail-1-key")  # run again, keyed: holds again
    again = ended(second)
    assert again["verdict"] == "unrecoverable"

    resumed = Watch(second, cursor=resolved.cursor, timeout=3)
    watches.append(resumed)
    followed = resumed.rest()
    # In commit order: the new start's own violation (at ingest), then the end that found
    # the email holding again. Nothing from before the cursor, nothing twice.
    assert described(followed) == [("duplicate-action-id", FIRING), (EFFECT, FIRING)]
    fired_again = followed[1]
    assert fired_again.violation.key == violation["key"] and not fired_again.violation.resolved
    assert seconds(fired_again) == pytest.approx(again["ended_at"], abs=1e-6)
    assert seconds(fired_again) > seconds(resolved) > seconds(fired)

    # From the start, only the email's rule: its three alerts, each once, in order.
    only_effect = Watch(second, cursor=watch.start, rules=[EFFECT], timeout=3)
    watches.append(only_effect)
    everything = only_effect.rest()
    assert described(everything) == [(EFFECT, FIRING), (EFFECT, RESOLVED), (EFFECT, FIRING)]
    assert [a.cursor for a in everything[:2]] == [fired.cursor, resolved.cursor]
    assert everything[2].cursor == fired_again.cursor
    # And from each cursor, exactly what followed it.
    for position, alert in enumerate(everything):
        after = Watch(second, cursor=alert.cursor, rules=[EFFECT], timeout=2)
        watches.append(after)
        assert [a.cursor for a in after.rest()] == [a.cursor for a in everything[position + 1 :]]


def test_a_watch_of_unrecoverable_sessions_gets_the_resolution_of_an_alert_it_was_sent(  # type: ignore[no-untyped-def]
    start_sidecar, store_url: str, watches: list[Watch]
) -> None:
    # The resolution leaves the session ok: filtered by the session's verdict now, it
    # never reached a watch of VERDICT_UNRECOVERABLE, which was left with a firing alert
    # that never ended. It is filtered by the verdict the session had while the violation
    # held, live, resumed from the firing's cursor, or read from the start later.
    sidecar = start_sidecar(store_url)
    live = Watch(sidecar, verdicts=[pb.VERDICT_UNRECOVERABLE], timeout=20)
    watches.append(live)
    send(sidecar, status="started")
    ended(sidecar)
    [fired] = live.take(1)
    assert (fired.status, fired.session_verdict) == (FIRING, pb.VERDICT_UNRECOVERABLE)

    send(sidecar, status="error", error=True)
    assert ended(sidecar)["verdict"] == "ok"
    [resolved] = live.take(1)
    assert (resolved.violation.key, resolved.status) == (fired.violation.key, RESOLVED)
    assert resolved.session_verdict == pb.VERDICT_OK  # the verdict it left, as before

    def read_later(cursor: str) -> list[str]:
        # Opened only now: the client takes each message off the wire as it is read, so a
        # watch whose deadline ran out while another was read loses what it had not read.
        watch = Watch(sidecar, cursor=cursor, verdicts=[pb.VERDICT_UNRECOVERABLE], timeout=2)
        watches.append(watch)
        return [alert.cursor for alert in watch.rest()]

    assert read_later(fired.cursor) == [resolved.cursor]
    assert read_later(live.start) == [fired.cursor, resolved.cursor]
    # A verdict the session never had while it held still filters both out.
    at_risk = Watch(sidecar, cursor=live.start, verdicts=[pb.VERDICT_AT_RISK], timeout=2)
    watches.append(at_risk)
    assert at_risk.rest() == []


def unbounded_retries(sidecar: Sidecar, *sessions: str) -> None:
    """One violation (``retry-without-bound``) in each of ``sessions``, in that order."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "run-1")
    for session in sessions:
        agent.action(session, "t1", "tool_call", retryable=True)
    agent.shutdown()


def lose_sqlite_store(sidecar: Sidecar, directory: Path) -> None:
    """Stop ``sidecar`` and delete its SQLite file, as a pod's emptyDir volume goes with it."""
    sidecar.stop()
    for path in directory.glob("sessions.db*"):
        path.unlink()


def last_of_three_alerts(sidecar: Sidecar, watches: list[Watch]) -> pb.Alert:
    """The last of the three alerts (unbounded retries) a watcher of ``sidecar`` gets."""
    watch = Watch(sidecar)
    watches.append(watch)
    unbounded_retries(sidecar, "old-1", "old-2", "old-3")
    last = watch.take(3)[-1]
    watch.close()
    return last


def cursor_of_a_lost_store(
    start_sidecar: Callable[..., Sidecar], directory: Path, watches: list[Watch]
) -> tuple[pb.Alert, Sidecar]:
    """The last of three alerts a watcher got from a sidecar whose SQLite store (in
    ``directory``) was then lost, and a sidecar started on a new store in its place."""
    store = directory / "sessions.db"
    first = start_sidecar(store)
    last = last_of_three_alerts(first, watches)
    lose_sqlite_store(first, directory)
    return last, start_sidecar(store)


def test_a_cursor_of_a_store_lost_since_resumes_from_the_new_stores_start(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path, watches: list[Watch]
) -> None:
    # The new store numbers its violations from 1 again, below the watcher's cursor.
    last, second = cursor_of_a_lost_store(start_sidecar, tmp_path, watches)
    unbounded_retries(second, "new-1", "new-2")

    resumed = Watch(second, cursor=last.cursor, timeout=3)
    watches.append(resumed)
    # Both committed after the watcher's cursor was given: both are sent.
    assert [alert.violation.session_id for alert in resumed.rest()] == ["new-1", "new-2"]


def test_a_cursor_of_a_lost_store_resumes_from_the_start_of_a_new_store_grown_past_it(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path, watches: list[Watch]
) -> None:
    """The new store's feed is already longer than the old one was when the watcher comes
    back: its cursor names the old store, so the new feed is sent from its start. Read as
    a position of the new store, it skipped the new store's first three alerts."""
    last, second = cursor_of_a_lost_store(start_sidecar, tmp_path, watches)
    new = [f"new-{n}" for n in range(1, 6)]
    unbounded_retries(second, *new)
    wait_for(lambda: len(second.get("/api/sessions")[1]["sessions"]) == 5)

    resumed = Watch(second, cursor=last.cursor, timeout=3)
    watches.append(resumed)
    alerts = resumed.rest()
    assert [alert.violation.session_id for alert in alerts] == new
    # The watch says where it started: the new store's start, a cursor of the new store.
    assert resumed.start != last.cursor
    again = Watch(second, cursor=resumed.start, timeout=2)
    watches.append(again)
    assert [a.cursor for a in again.rest()] == [a.cursor for a in alerts]


def test_a_cursor_of_the_same_store_resumes_after_a_restart_and_old_cursors_still_work(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path, watches: list[Watch]
) -> None:
    """The store keeps its id across restarts, so its cursors resume where they were; a
    cursor of the earlier form (the feed position alone, without the store) resumes as it
    did before."""
    store = tmp_path / "sessions.db"
    first = start_sidecar(store)
    watch = Watch(first)
    watches.append(watch)
    unbounded_retries(first, "a", "b")
    a, b = watch.take(2)
    assert a.cursor.rpartition("@")[2] == b.cursor.rpartition("@")[2] == watch.start.rpartition("@")[2]
    watch.close()
    first.stop()
    second = start_sidecar(store)
    unbounded_retries(second, "c")
    for cursor in (a.cursor, a.cursor.rpartition("@")[0]):
        resumed = Watch(second, cursor=cursor, timeout=2)
        watches.append(resumed)
        assert [alert.violation.session_id for alert in resumed.rest()] == ["b", "c"]
        assert resumed.start == a.cursor  # as this store gives it


@pytest.mark.postgres
def test_a_cursor_of_another_postgresql_store_starts_from_this_stores_start(  # type: ignore[no-untyped-def]
    start_sidecar, postgres_url: str, tmp_path, watches: list[Watch]
) -> None:
    """Two stores of one PostgreSQL server (two schemas: one dropped and made anew reads the
    same): a cursor of the store written last names transactions after every row of the
    other, and read as a position of that other store it passed all of them."""
    from postgres_support import drop_schema, postgres_dsn

    dsn = postgres_dsn()
    schema = postgres_url.rpartition("schema=")[2]
    other_url = postgres_url.replace(schema, schema + "_b")
    try:
        earlier = start_sidecar(other_url)
        unbounded_retries(earlier, "b-1", "b-2")
        wait_for(lambda: len(earlier.get("/api/sessions")[1]["sessions"]) == 2)
        later = start_sidecar(postgres_url)
        watch = Watch(later)
        watches.append(watch)
        unbounded_retries(later, "a-1")
        [given] = watch.take(1)
        resumed = Watch(earlier, cursor=given.cursor, timeout=3)
        watches.append(resumed)
        assert [alert.violation.session_id for alert in resumed.rest()] == ["b-1", "b-2"]
        # Each store keeps its id: a second replica of the same store continues the cursor.
        # Only its start is read (the fixture closes it): a deadline long enough to be
        # established on a loaded machine costs nothing.
        replica = Watch(start_sidecar(postgres_url), cursor=given.cursor, timeout=10)
        watches.append(replica)
        assert replica.start == given.cursor
    finally:
        drop_schema(dsn, schema + "_b")


@pytest.mark.postgres
def test_a_cursor_past_this_servers_transactions_resumes_from_the_stores_start(  # type: ignore[no-untyped-def]
    start_sidecar, postgres_url: str, watches: list[Watch]
) -> None:
    """A store restored from a dump (pg_dump, pg_restore) into another server keeps its id,
    but not its transaction ids: the new server's may be far below those of the cursors
    given before. Such a cursor names a transaction this server has not begun, so it was
    not given by it: the feed is sent from its start, as a SQLite cursor past the end of
    its feed is. Read as a position, every alert until the server's ids passed it was
    skipped (a watch sent nothing at all)."""
    sidecar = start_sidecar(postgres_url)
    watch = Watch(sidecar)
    watches.append(watch)
    unbounded_retries(sidecar, "r-1", "r-2")
    given = watch.take(2)
    position, _, store_id = given[-1].cursor.rpartition("@")
    _, xid, row = position.split(":", 2)
    ahead = f"pg:{int(xid) + 10**12}:{row}@{store_id}"  # as given by the server dumped from
    resumed = Watch(sidecar, cursor=ahead, timeout=3)
    watches.append(resumed)
    assert [alert.violation.session_id for alert in resumed.rest()] == ["r-1", "r-2"]
    # A cursor this server gave, the last one included, still resumes where it was.
    after_first, at_end = (
        Watch(sidecar, cursor=given[0].cursor, timeout=2),
        Watch(sidecar, cursor=given[1].cursor, timeout=1),
    )
    watches.extend((after_first, at_end))
    assert [alert.violation.session_id for alert in after_first.rest()] == ["r-2"]
    assert at_end.rest() == []


def test_a_cursor_past_a_restored_empty_feed_misses_nothing_of_a_burst(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path: Path, watches: list[Watch]
) -> None:
    """A SQLite store restored from a backup made before its first violation keeps its id:
    a watcher's cursor of the store as it was is past the end of the restored, empty feed,
    and is read from the start. While the feed stayed empty the watch kept that cursor as
    its position, so a first commit of more violations than the cursor's position (one
    Export of a batch of spans) was read after it: its first violations were never sent."""

    store = tmp_path / "sessions.db"
    first = start_sidecar(store)
    agent = Agent(grpc_exporter(first.grpc_endpoint), "run-1")
    agent.action("calm", "t1", "tool_call", idempotency_key="k-1")  # the store, and its id, made
    agent.shutdown()
    wait_for(lambda: first.get("/api/sessions")[1]["sessions"])
    first.stop()
    backup = tmp_path / "backup.db"
    shutil.copy(store, backup)
    second = start_sidecar(store)
    last = last_of_three_alerts(second, watches)
    second.stop()
    for path in tmp_path.glob("sessions.db*"):
        path.unlink()
    shutil.copy(backup, store)  # restored: the same store id, a feed without a violation

    third = start_sidecar(store)
    resumed = Watch(third, cursor=last.cursor, timeout=4)
    watches.append(resumed)
    assert resumed.start.rpartition("@")[2] == last.cursor.rpartition("@")[2]  # the same store
    time.sleep(0.5)  # the watch reads the empty feed a few times
    burst = [f"new-{n}" for n in range(1, 6)]
    unbounded_retries(third, *burst)  # one Export: one commit of five violations
    assert [alert.violation.session_id for alert in resumed.rest()] == burst
