"""The gRPC SessionService over a real channel, on the same port as the OTLP receiver.

Spans come from the real SDK gRPC exporter; the API is called with the committed
generated stub. Also: the committed generated code is what the proto and the pinned
grpcio-tools produce today.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from durable_sessions_collector.api.grpc_api import CURSOR_METADATA
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.store import base as store_base
from durable_sessions_collector.store.stored import MAX_TEXT, stored_text
from google.protobuf import json_format
from sidecar_clients import Agent, grpc_exporter

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ROOT / "collector" / "src" / "durable_sessions_collector" / "api" / "v1"


@pytest.fixture
def api(sidecar):  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    yield pb_grpc.SessionServiceStub(channel)
    channel.close()


def test_get_and_list_with_a_verdict_filter_and_pages(sidecar, api) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    with agent.trace("work"):
        agent.action("bad", "t1", "tool_call", retryable=True)  # unbounded-retry: error
        agent.action("bad", "l1", "llm_call", result='{"text": "hi"}')
        for n in range(5):
            agent.action(f"good-{n}", "u1", "user_prompt", result='{"x": 1}')
    agent.shutdown()

    session = api.GetSession(pb.GetSessionRequest(session_id="bad"), timeout=10)
    assert session.summary.session_id == "bad"
    assert session.summary.verdict == pb.VERDICT_UNRECOVERABLE
    assert session.summary.state == pb.SESSION_STATE_ACTIVE and not session.summary.HasField("ended_at")
    assert session.summary.action_count == 2 and session.summary.errors == 1
    assert [(a.action_id, a.kind) for a in session.actions] == [("t1", "tool_call"), ("l1", "llm_call")]
    assert session.actions[0].record["retryable"] is True
    assert "result" not in session.actions[1].record  # digests only
    assert session.actions[1].record["result_digest"].startswith("sha256:")
    assert [(v.rule, v.severity, v.action_id) for v in session.violations] == [
        ("unbounded-retry", pb.SEVERITY_ERROR, "t1")
    ]
    assert session.summary.last_seen.ToNanoseconds() > 0
    # It is the same session the HTTP API shows.
    http = sidecar.session("bad")
    assert json_format.MessageToDict(session.summary)["actionCount"] == str(http["action_count"])

    with pytest.raises(grpc.RpcError) as missing:
        api.GetSession(pb.GetSessionRequest(session_id="nope"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as empty:
        api.GetSession(pb.GetSessionRequest(), timeout=10)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    bad = api.ListSessions(pb.ListSessionsRequest(verdict=pb.VERDICT_UNRECOVERABLE), timeout=10)
    assert [s.session_id for s in bad.sessions] == ["bad"] and bad.next_page_token == ""
    assert api.ListSessions(pb.ListSessionsRequest(verdict=pb.VERDICT_AT_RISK), timeout=10).sessions == []

    seen, token, pages = [], "", 0
    while True:
        page = api.ListSessions(
            pb.ListSessionsRequest(verdict=pb.VERDICT_OK, page_size=2, page_token=token), timeout=10
        )
        pages += 1
        seen += [s.session_id for s in page.sessions]
        assert all(s.verdict == pb.VERDICT_OK for s in page.sessions)
        token = page.next_page_token
        if not token:
            break
    assert pages == 3 and sorted(seen) == [f"good-{n}" for n in range(5)]
    everything = api.ListSessions(pb.ListSessionsRequest(), timeout=10)
    assert len(everything.sessions) == 6

    with pytest.raises(grpc.RpcError) as foreign:  # a token of another filter
        api.ListSessions(pb.ListSessionsRequest(verdict=pb.VERDICT_UNRECOVERABLE, page_token=token or "x"))
    assert foreign.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_pages_of_large_sessions_end_before_a_client_would_refuse_them(sidecar, api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A session id repeats in every record and every violation: 80 unbounded retries of a
    100 kB id were one 16 MB answer, which a client with gRPC's default 4 MiB limit
    refused. An id that long is now stored as its digest (and found by the id itself), and
    no stored value is longer than an identifier (256 characters); pages still end by size
    too (here after 5 kB, so that bounded records fill several), and the walk still finds
    every item."""
    monkeypatch.setattr(store_base, "MAX_PAGE_BYTES", 5_000)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    long_id = "s" * 100_000
    for n in range(80):
        agent.action(long_id, f"t{n}", "tool_call", retryable=True)  # unbounded-retry each
    listed = [f"{n:02d}" + "L" * (MAX_TEXT - 2) for n in range(30)]  # kept as they are
    for session_id in listed:
        agent.action(session_id, "u1", "user_prompt", result='{"x": 1}')
    agent.shutdown()

    def get(actions_token: str, violations_token: str, first: bool = False) -> pb.Session:
        page = api.GetSession(  # a client with gRPC's default limit refuses more than 4 MiB
            pb.GetSessionRequest(
                session_id=long_id,
                actions_page_size=5000 if first or actions_token else 1,
                actions_page_token=actions_token,
                violations_page_size=5000 if first or violations_token else 1,
                violations_page_token=violations_token,
            ),
            timeout=10,
        )
        assert page.ByteSize() < 4 * 1024 * 1024
        assert page.summary.session_id == stored_text(long_id) != long_id
        return page

    page, pages = get("", "", first=True), 1
    actions, violations = [a.action_id for a in page.actions], [v.action_id for v in page.violations]
    actions_token, violations_token = page.next_actions_page_token, page.next_violations_page_token
    while actions_token or violations_token:
        page, pages = get(actions_token, violations_token), pages + 1
        if actions_token:
            actions += [a.action_id for a in page.actions]
            actions_token = page.next_actions_page_token
        if violations_token:
            violations += [v.action_id for v in page.violations]
            violations_token = page.next_violations_page_token
    assert pages > 2
    assert actions == [f"t{n}" for n in range(80)]
    assert sorted(violations) == sorted(f"t{n}" for n in range(80))

    seen, token = [], ""
    while True:
        page = api.ListSessions(pb.ListSessionsRequest(page_size=1000, page_token=token), timeout=10)
        assert page.ByteSize() < 4 * 1024 * 1024
        assert token or (len(page.sessions) < 31 and page.next_page_token)  # the first page was cut
        seen += [s.session_id for s in page.sessions]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted([stored_text(long_id), *listed])


def test_watch_receives_alerts_committed_after_it_started(sidecar, api) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("before", "t0", "tool_call", retryable=True)  # committed before any watch: not sent

    everything = api.WatchAlerts(pb.WatchAlertsRequest(), timeout=20)
    only_retry = api.WatchAlerts(pb.WatchAlertsRequest(rules=["unbounded-retry"]), timeout=20)
    only_at_risk = api.WatchAlerts(pb.WatchAlertsRequest(verdicts=[pb.VERDICT_AT_RISK]), timeout=20)
    start = dict(everything.initial_metadata())[CURSOR_METADATA]  # the watch is established
    only_retry.initial_metadata()
    only_at_risk.initial_metadata()

    agent.action("s1", "p1", "payment", idempotency_key="K")
    agent.action("s1", "p2", "payment", idempotency_key="K")  # shared-key
    agent.action("s2", "t1", "tool_call", retryable=True)  # unbounded-retry
    agent.action("s3", "p1", "payment", idempotency_key="s3/p1")
    agent.shutdown()
    restarted = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-2")
    restarted.action("s3", "p1", "payment", idempotency_key="s3/p1")  # re-sent with its key: warning
    restarted.shutdown()

    first, second, third = next(everything), next(everything), next(everything)
    assert [(a.violation.session_id, a.violation.rule) for a in (first, second, third)] == [
        ("s1", "shared-key"),
        ("s2", "unbounded-retry"),
        ("s3", "re-executed-side-effect"),
    ]
    assert first.session_verdict == pb.VERDICT_UNRECOVERABLE and first.violation.key
    assert third.session_verdict == pb.VERDICT_AT_RISK
    assert third.violation.severity == pb.SEVERITY_WARNING
    assert [a.violation.session_id for a in [next(only_retry)]] == ["s2"]
    assert next(only_at_risk).violation.session_id == "s3"

    # Resuming: from the start cursor everything again; from an alert's cursor, what followed.
    resumed = api.WatchAlerts(pb.WatchAlertsRequest(cursor=start), timeout=20)
    assert [next(resumed).violation.key for _ in range(3)] == [
        a.violation.key for a in (first, second, third)
    ]
    after_first = api.WatchAlerts(pb.WatchAlertsRequest(cursor=first.cursor), timeout=20)
    assert next(after_first).violation.key == second.violation.key
    for call in (everything, only_retry, only_at_risk, resumed, after_first):
        call.cancel()

    with pytest.raises(grpc.RpcError) as bad_cursor:
        next(api.WatchAlerts(pb.WatchAlertsRequest(cursor="garbage"), timeout=5))
    assert bad_cursor.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watchers_are_bounded_and_end_when_the_sidecar_stops(sidecar, api) -> None:  # type: ignore[no-untyped-def]
    calls = [api.WatchAlerts(pb.WatchAlertsRequest(), timeout=30) for _ in range(8)]
    for call in calls:
        call.initial_metadata()
    with pytest.raises(grpc.RpcError) as full:
        next(api.WatchAlerts(pb.WatchAlertsRequest(), timeout=5))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ended = threading.Event()
    codes: list[grpc.StatusCode] = []

    def drain() -> None:
        try:
            for _ in calls[0]:
                pass
        except grpc.RpcError as error:
            codes.append(error.code())
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    sidecar.stop()
    assert ended.wait(5)  # the stream finished instead of hanging
    # Retryable, not OK: a client's loop over the stream would take OK for the watch's end.
    assert codes == [grpc.StatusCode.UNAVAILABLE]


def test_committed_generated_code_is_up_to_date(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "collector" / "scripts" / "generate_api.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for name in ("sessions_pb2.py", "sessions_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (GENERATED / name).read_text(), (
            f"{name} is stale: run `make proto` and commit the result"
        )


def test_an_action_record_holds_the_same_numbers_as_the_http_api(sidecar, api) -> None:  # type: ignore[no-untyped-def]
    # A Struct's numbers are doubles: seq (the span's start in nanoseconds, ~1.8e18) came
    # out rounded to a multiple of 256, another number than the HTTP API's. An integer past
    # 2**53 is now its decimal text (protobuf's JSON mapping of an int64), in both APIs;
    # smaller ones stay numbers.
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("nums", "t1", "tool_call", max_attempts=3)
    agent.shutdown()
    [http] = sidecar.session("nums")["actions"]
    [action] = api.GetSession(pb.GetSessionRequest(session_id="nums"), timeout=10).actions
    assert int(http["seq"]) > 2**53
    assert action.record["seq"] == http["seq"]
    assert action.record["max_attempts"] == http["max_attempts"] == 3
    assert action.record["ts"] == http["ts"]
