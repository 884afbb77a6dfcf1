"""Session semantics of the sidecar at its edges, against the offline checker.

Real sidecars (``start_sidecar``) receive raw OTLP/HTTP protobuf requests whose span ids,
start times, statuses and incarnations the tests choose; the very same requests are
written as an OTLP/JSON file and judged by the offline checker (``durable-sessions
check``'s :class:`OfflineCheck`). After the sidecar has ended every session (idle
``idle_s``), its unresolved violations must be the offline checker's, session by
session, and each violation must have been alerted exactly once — across reopened
sessions, evictions (``evaluation.max_sessions``) and restarts on the same store file.
"""

from __future__ import annotations

import base64
import collections
import json
import random
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector.alerts import outbox_key
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from sidecar_clients import Agent, grpc_exporter

from durable_sessions.check import OfflineCheck, check_paths
from durable_sessions.engine import Checker
from durable_sessions.rules import select_rules
from durable_sessions.violation import Violation

NOW_NS = 1_767_225_600_000_000_000  # 2026-01-01
KINDS = ["payment", "user_prompt", "llm_call", "tool_call", "email", "clock"]
Finding = tuple[str, str | None, str | None, str, str]
"""(rule, action_id, span_id, severity, message): a violation as both front ends can name it."""


# --- building requests -----------------------------------------------------------------


def _value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=value)


def action_span(
    span: int,
    attrs: dict[str, Any],
    *,
    trace: int = 1,
    start: int = NOW_NS,
    error: bool = False,
    incarnation: str | None = "run-1",
) -> dict[str, Any]:
    """One span as the tests describe it (agent.action.* attributes named without prefix)."""
    attributes = {
        (key if key == "session.id" or "." in key else f"agent.action.{key}"): value
        for key, value in attrs.items()
    }
    return {
        "trace": trace,
        "span": span,
        "start": start,
        "error": error,
        "incarnation": incarnation,
        "attrs": attributes,
    }


def request(spans: list[dict[str, Any]]) -> ExportTraceServiceRequest:
    groups = []
    for item in spans:
        resource = [KeyValue(key="service.name", value=_value("agent"))]
        if item["incarnation"]:
            resource.append(KeyValue(key="service.instance.id", value=_value(item["incarnation"])))
        span = Span(
            trace_id=item["trace"].to_bytes(16, "big"),
            span_id=item["span"].to_bytes(8, "big"),
            name="action",
            start_time_unix_nano=item["start"],
            end_time_unix_nano=item["start"],
            attributes=[KeyValue(key=k, value=_value(v)) for k, v in item["attrs"].items()],
            status=Status(code=Status.STATUS_CODE_ERROR if item["error"] else Status.STATUS_CODE_UNSET),
        )
        groups.append(
            ResourceSpans(resource=Resource(attributes=resource), scope_spans=[ScopeSpans(spans=[span])])
        )
    return ExportTraceServiceRequest(resource_spans=groups)


def otlp_json_line(message: ExportTraceServiceRequest) -> str:
    """The request as the Collector's file exporter writes it (OTLP/JSON, hex ids)."""
    document = json_format.MessageToDict(message, use_integers_for_enums=True)
    for group in document.get("resourceSpans", []):
        for scope in group.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for name in ("traceId", "spanId"):
                    span[name] = base64.b64decode(span[name]).hex()
    return json.dumps(document)


class Run:
    """Sends requests to a sidecar and keeps them, in order, for the offline checker."""

    def __init__(self, sidecar: Sidecar, tmp_path: Path) -> None:
        self.sidecar = sidecar
        self.logs = [sidecar.log]
        self.lines: list[str] = []
        self.file = tmp_path / "spans.otlp.jsonl"

    def use(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.logs.append(sidecar.log)

    def send(self, spans: list[dict[str, Any]]) -> None:
        message = request(spans)
        http = urllib.request.Request(
            self.sidecar.http_url + "/v1/traces",
            data=message.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
            method="POST",
        )
        with urllib.request.urlopen(http, timeout=20) as response:
            assert response.status == 200
        self.lines.append(otlp_json_line(message))

    def wait_all_ended(self, expected: int | None = None) -> list[dict[str, Any]]:
        def ended() -> list[dict[str, Any]] | None:
            status, document = self.sidecar.get("/api/sessions?limit=1000")
            assert status == 200, document
            sessions = document["sessions"]
            if expected is not None and len(sessions) != expected:
                return None
            return sessions if all(s["state"] == "ended" for s in sessions) else None

        return wait_for(ended, 15)  # type: ignore[no-any-return]

    def offline(self, checker: Checker | None = None) -> list[Violation]:
        self.file.write_text("".join(line + "\n" for line in self.lines))
        if checker is not None:
            return list(check_paths([str(self.file)], checker, fmt="otlp-json"))
        return list(OfflineCheck([str(self.file)], select_rules(), fmt="otlp-json"))

    def sidecar_findings(
        self, page: int | None = None
    ) -> tuple[dict[str, set[Finding]], dict[str, str], set[str]]:
        """Unresolved findings and verdict per session, and every stored violation key
        (read in pages of ``page`` violations)."""
        findings: dict[str, set[Finding]] = {}
        verdicts: dict[str, str] = {}
        keys: set[str] = set()
        for summary in self.wait_all_ended():
            verdicts[summary["session_id"]] = self.sidecar.session(summary["session_id"])["verdict"]
            violations = self.sidecar.violations(summary["session_id"], page)
            keys |= {v["key"] for v in violations}
            findings[summary["session_id"]] = {
                (v["rule"], v["action_id"], v["span_id"], v["severity"], same_place(v["message"]))
                for v in violations
                if not v["resolved"]
            }
        return findings, verdicts, keys

    def alert_lines(self) -> list[dict[str, Any]]:
        """Every alert line the sidecars wrote: first alerts and changes of status."""
        return [
            line
            for log in self.logs
            for line in log.lines()
            if line.get("event") in ("violation", "violation-resolved")
        ]

    def alerted_keys(self) -> list[str]:
        """The keys in the violations' first alerts. A change of status (resolved, or
        firing again: ``"event": "violation"`` too) has a ``transition`` and is an alert of
        its own (collector/README.md, "Alerts"), not a second first alert: a session that
        ends more than once (its Exports further apart than ``idle_s``) may make one."""
        return [
            line["key"]
            for line in self.alert_lines()
            if line["event"] == "violation" and "transition" not in line
        ]

    def alerted_once(self, count: int) -> list[str]:
        """The alerted keys, once there are at least ``count`` (the lines of the last
        sweep's findings are written after the commit that shows its sessions ended),
        each alert line having been written once: no outbox key twice."""
        wait_for(lambda: len(self.alerted_keys()) >= count)
        written = collections.Counter(outbox_key(line) for line in self.alert_lines())
        assert [key for key, lines in written.items() if lines > 1] == []
        return self.alerted_keys()


def by_session(violations: list[Violation]) -> dict[str, set[Finding]]:
    found: dict[str, set[Finding]] = collections.defaultdict(set)
    for v in violations:
        found[v.session_id or ""].add(
            (v.rule, v.action_id, v.span_id, v.severity.value, same_place(v.message))
        )
    return dict(found)


def same_place(message: str) -> str:
    """``message`` with the place of an earlier action left out: a file's line offline, a
    span and trace in the sidecar."""
    return re.sub(r" at (line \d+|span [0-9a-f]+( \(trace [0-9a-f]+\))?)", " at …", message)


def verdict_of(findings: set[Finding]) -> str:
    severities = {finding[3] for finding in findings}
    return "unrecoverable" if "error" in severities else "at_risk" if severities else "ok"


# --- the property: a live sidecar judges as the offline checker does ----------------------


def random_phase(rng: random.Random, sessions: int, n: int, first_span: int) -> list[dict[str, Any]]:
    """Random actions over a few sessions; start times out of order (0, far past, now,
    far future); now and then the latest span of an action delivered again, with the same
    status (dropped as a duplicate) or another one."""
    spans: list[dict[str, Any]] = []
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for i in range(n):
        if latest and rng.random() < 0.12:
            again = dict(rng.choice(list(latest.values())))
            again["attrs"] = dict(again["attrs"])
            if rng.random() < 0.5:
                again["attrs"]["agent.action.status"] = rng.choice(["ok", "error", "started"])
            spans.append(again)
            latest[(again["attrs"]["session.id"], again["attrs"]["agent.action.id"])] = again
            continue
        attrs: dict[str, Any] = {
            "session.id": f"s{rng.randrange(sessions)}",
            "id": f"a{rng.randrange(6)}",
            "kind": rng.choice(KINDS),
            "status": rng.choice(["ok", "ok", "error", "started"]),
        }
        if rng.random() < 0.5:
            attrs["idempotency_key"] = f"k{rng.randrange(4)}"
        if rng.random() < 0.5:
            attrs["result_digest"] = f"sha256:{rng.randrange(3):064x}"
        if rng.random() < 0.2:
            attrs["replayed"] = True
        if rng.random() < 0.3:
            attrs.update(retryable=True, max_attempts=3, attempts=rng.randrange(1, 5))
        if rng.random() < 0.1:
            attrs["on_failure"] = "ask_user"
        if rng.random() < 0.3:
            attrs["name"] = "book"
        # What the mapping reads rather than copies (each found a difference once).
        if rng.random() < 0.3:
            attrs["prompt"] = rng.choice(["Budget?", "Seat?"])  # a digest, for re-asked
        if rng.random() < 0.3:
            attrs["result"] = rng.choice(['{"a": 1}', '"__REDACTED__"', "__REDACTED__", "not json"])
        if rng.random() < 0.1:
            attrs["retryable"] = "yes"  # with "not json": two problems, one violation
        start = rng.choice([0, rng.randrange(1, 10**18), NOW_NS + rng.randrange(10**14), 2**64 - 1])
        item = action_span(
            first_span + i,
            attrs,
            trace=rng.randrange(1, 4),
            start=start,
            incarnation=f"run-{rng.randrange(2)}",
        )
        spans.append(item)
        latest[(attrs["session.id"], attrs["id"])] = item
    return spans


@pytest.mark.parametrize(
    ("seed", "max_sessions", "restart"),
    [(11, 10_000, False), (12, 2, False), (13, 10_000, True), (14, 1, True)],
)
def test_live_sidecar_judges_random_sessions_as_the_offline_checker(
    start_sidecar, tmp_path: Path, seed: int, max_sessions: int, restart: bool
) -> None:  # type: ignore[no-untyped-def]
    """Two phases: every session is ended, then reopened by more spans and ended again
    (end-of-session rules run again; findings a late completion answers are resolved).
    Optionally evicted (max_sessions 1 or 2) and the sidecar restarted between phases."""
    rng = random.Random(seed)
    store = tmp_path / "sessions.db"
    run = Run(start_sidecar(store, evaluation__max_sessions=max_sessions), tmp_path)
    for number, phase in enumerate([random_phase(rng, 4, 36, 1), random_phase(rng, 4, 24, 1000)]):
        for start in range(0, len(phase), 6):
            run.send(phase[start : start + 6])
        run.wait_all_ended()
        if restart and number == 0:
            run.sidecar.stop()
            run.use(start_sidecar(store, evaluation__max_sessions=max_sessions))
    expected = by_session(run.offline())
    found, verdicts, keys = run.sidecar_findings()
    assert set(found) == set(expected) | {s for s in found if not found[s]}
    for session_id, findings in found.items():
        assert findings == expected.get(session_id, set()), session_id
        assert verdicts[session_id] == verdict_of(findings), session_id
    # Once per violation: reopened, rebuilt and restarted sessions raise nothing twice.
    alerted = run.alerted_once(len(keys))
    assert sorted(alerted) == sorted(keys)
    if max_sessions < 4:
        assert run.sidecar.metric("durable_sessions_sessions_rebuilt_total") > 0


# --- end-of-session rules, late completions, alerts once -----------------------------------


def test_late_completion_resolves_the_end_finding_across_a_restart_and_alerts_once(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sessions.db"
    run = Run(start_sidecar(store), tmp_path)
    started = action_span(0x51, {"session.id": "late", "id": "mail-1", "kind": "email", "status": "started"})
    run.send([started])
    (summary,) = run.wait_all_ended(1)
    assert summary["verdict"] == "unrecoverable"
    [violation] = run.sidecar.session("late")["violations"]
    assert (violation["rule"], violation["at_session_end"], violation["resolved"]) == (
        "unresolved-side-effect",
        True,
        False,
    )
    # A restart, then the completion (same span, another status: it failed, nothing sent).
    run.sidecar.stop()
    run.use(start_sidecar(store))
    run.send([{**started, "error": True, "attrs": {**started["attrs"], "agent.action.status": "error"}}])
    assert run.sidecar.session("late")["state"] == "active"
    (summary,) = run.wait_all_ended(1)
    detail = run.sidecar.session("late")
    assert summary["verdict"] == detail["verdict"] == "ok"
    assert [(v["rule"], v["resolved"]) for v in detail["violations"]] == [("unresolved-side-effect", True)]
    assert (detail["errors"], detail["warnings"], detail["action_count"]) == (0, 0, 2)
    assert run.offline() == []
    # The same started record delivered again: a duplicate, and nothing is re-alerted.
    run.send([started])
    run.wait_all_ended(1)
    assert run.sidecar.session("late")["verdict"] == "ok"
    assert run.alerted_keys() == [violation["key"]]


def test_a_violation_firing_again_after_a_restart_is_not_a_second_first_alert(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The session ends three times, the last two after a restart: the email's start is
    unresolved, its completion resolves that, a new start makes it hold again. The
    violation's key is on two ``"violation"`` lines, the first alert and the change back
    to firing (documented: three alerts, once each), and ``alerted_once`` takes them for
    what they are. It took the change for the first alert written twice when pauses
    longer than ``idle_s`` ended a session between its Exports (test_kept_states.py)."""
    store = tmp_path / "sessions.db"
    run = Run(start_sidecar(store), tmp_path)
    email = {"session.id": "again", "id": "mail-1", "kind": "email"}
    started = action_span(0x61, {**email, "status": "started"})
    run.send([started])
    run.wait_all_ended(1)
    [violation] = run.sidecar.session("again")["violations"]
    run.sidecar.stop()
    run.use(start_sidecar(store))

    def ended_with(resolved: bool) -> bool:
        detail = run.sidecar.session("again")
        return detail["state"] == "ended" and any(
            v["key"] == violation["key"] and v["resolved"] == resolved for v in detail["violations"]
        )

    # The completion (same span, another status: it failed, nothing was sent).
    run.send([{**started, "error": True, "attrs": {**started["attrs"], "agent.action.status": "error"}}])
    wait_for(lambda: ended_with(resolved=True))
    run.send([action_span(0x62, {**email, "status": "started", "idempotency_key": "mail-1-key"})])
    wait_for(lambda: ended_with(resolved=False))

    def changes() -> list[tuple[str, str]]:
        return [
            (line["event"], line["status"]) for line in run.alert_lines() if line["key"] == violation["key"]
        ]

    # The change's line is written after the commit that shows the session ended.
    wait_for(lambda: len(changes()) == 3)
    assert changes() == [("violation", "firing"), ("violation-resolved", "resolved"), ("violation", "firing")]
    _, _, keys = run.sidecar_findings()
    assert sorted(run.alerted_once(len(keys))) == sorted(keys)


def test_escalation_after_the_end_resolves_retry_not_escalated(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = Run(start_sidecar(evaluation__max_sessions=1), tmp_path)
    retry = {"session.id": "esc", "id": "t1", "kind": "tool_call", "retryable": True, "max_attempts": 2}
    run.send([action_span(i, {**retry, "status": "error", "attempts": i}, error=True) for i in (1, 2)])
    run.wait_all_ended(1)
    assert run.sidecar.session("esc")["verdict"] == "unrecoverable"
    other = action_span(9, {"session.id": "other", "id": "x", "kind": "tool_call", "status": "ok"})
    run.send([other])  # evicts "esc" (max_sessions 1): it is rebuilt from the store
    run.send(
        [
            action_span(
                3,
                {
                    "session.id": "esc",
                    "id": "ask",
                    "kind": "user_prompt",
                    "status": "ok",
                    "result_digest": "sha256:" + "1" * 64,
                },
            )
        ]
    )
    run.wait_all_ended(2)
    detail = run.sidecar.session("esc")
    assert detail["verdict"] == "ok"
    assert [(v["rule"], v["resolved"]) for v in detail["violations"]] == [("retry-not-escalated", True)]
    assert by_session(run.offline()) == {}
    assert len(run.alerted_keys()) == 1


def test_a_wave_of_idle_sessions_beyond_one_sweep_batch_is_ended(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """1,200 sessions idle at once: the sweep ends them 500 at a time, all of them."""
    run = Run(start_sidecar(), tmp_path)
    n = 1200
    spans = [
        action_span(i + 1, {"session.id": f"w{i:04d}", "id": "a", "kind": "email", "status": "started"})
        for i in range(n)
    ]
    for start in range(0, n, 400):
        run.send(spans[start : start + 400])
    wait_for(lambda: run.sidecar.metric("durable_sessions_sessions_ended_total") >= n, 15)
    assert run.sidecar.metric("durable_sessions_sessions_ended_total") == n
    # A scrape may serve the store's previous count while a slow one goes on (a loaded
    # machine), and the lines are written after the count: both are waited for.
    wait_for(lambda: run.sidecar.metric("durable_sessions_sessions", verdict="unrecoverable") == n)
    assert all(s["state"] == "ended" for s in run.sidecar.get("/api/sessions?limit=1000")[1]["sessions"])
    alerted = run.alerted_once(n)
    assert len(set(alerted)) == len(alerted) == n


# --- sessions without session.id, clocks, memory bounds ------------------------------------


def test_trace_derived_sessions_and_extreme_start_times_match_the_offline_checker(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    run = Run(start_sidecar(), tmp_path)
    trace = 0xABC
    run.send(
        [
            # No session attribute: the trace stands in for the session.
            action_span(1, {"id": "p", "kind": "payment", "status": "started"}, trace=trace, start=2**64 - 1),
            # No start or end time (0, OTLP's unset): undated, an invalid-field, as offline.
            action_span(
                2, {"id": "p", "kind": "payment", "status": "error"}, trace=trace, start=0, error=True
            ),
            # A key first used 1 ns after the epoch, re-sent now: key-outlived-window, as offline.
            action_span(
                3,
                {
                    "session.id": "clock",
                    "id": "m",
                    "kind": "email",
                    "status": "started",
                    "idempotency_key": "mail-m",
                },
                start=1,
            ),
            action_span(
                4,
                {
                    "session.id": "clock",
                    "id": "m",
                    "kind": "email",
                    "status": "ok",
                    "idempotency_key": "mail-m",
                },
            ),
        ]
    )
    found, verdicts, _ = run.sidecar_findings()
    trace_session = f"{trace:032x}"
    assert verdicts == {trace_session: "unrecoverable", "clock": "at_risk"}
    expected = by_session(run.offline())
    assert found == expected
    assert {rule for rule, *_ in found[trace_session]} == {"invalid-field"}
    assert {rule for rule, *_ in found["clock"]} == {"key-outlived-window"}
    actions = run.sidecar.session(trace_session)["actions"]
    assert sorted((a["status"], a.get("seq"), a["session_source"]) for a in actions) == [
        ("error", None, "trace"),
        ("started", str(2**64 - 1), "trace"),  # served as text: past 2**53
    ]


def test_actions_of_a_session_are_listed_in_start_time_order_also_past_2_63_ns(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The session API lists actions by start time. A start time of 2**63 ns or more does
    not fit the store's 64-bit ``seq`` column: it is held to the column's range (the record
    keeps it exact), so the far-future action is still listed last."""
    run = Run(start_sidecar(), tmp_path)
    run.send(
        [action_span(1, {"session.id": "t", "id": "late", "kind": "tool_call", "status": "ok"}, start=2**63)]
    )
    run.send(
        [action_span(2, {"session.id": "t", "id": "early", "kind": "tool_call", "status": "ok"}, start=0)]
    )
    actions = run.sidecar.session("t")["actions"]
    assert [a["action_id"] for a in actions] == ["early", "late"]


def test_max_actions_per_session_forgets_the_same_actions_live_and_rebuilt(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """With a tiny action memory the sidecar (evicting, so rebuilding) judges as an engine
    with the same bound: the forgotten first use of a key is no longer a conflict."""
    run = Run(start_sidecar(evaluation__max_sessions=1, evaluation__max_actions_per_session=2), tmp_path)
    for i, (session, action, key) in enumerate(
        [
            ("m", "a1", "k1"),
            ("n", "b", "kb"),
            ("m", "a2", "k2"),
            ("m", "a3", "k3"),
            ("n", "c", "kc"),
            ("m", "a4", "k1"),
            ("m", "a1", "k9"),
        ]
    ):
        run.send(
            [
                action_span(
                    i + 1,
                    {
                        "session.id": session,
                        "id": action,
                        "kind": "email",
                        "status": "ok",
                        "idempotency_key": key,
                    },
                )
            ]
        )
    found, _, _ = run.sidecar_findings()
    checker = Checker(select_rules(), max_actions_per_session=2)
    assert found == {"m": by_session(run.offline(checker)).get("m", set()), "n": set()}
    # Unbounded, a4 shares a1's key and a1 comes back with another key; bounded, a1 is forgotten.
    assert found["m"] == set()
    assert {rule for findings in by_session(run.offline()).values() for rule, *_ in findings} == {
        "duplicate-action-id",
        "shared-key",
        "unstable-key",
    }


def test_every_missing_field_of_a_span_is_stored_and_alerted(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """RULES.md: "A record missing any [required field] gets one violation per missing
    field". A span with neither ``agent.action.id`` nor ``agent.action.kind`` breaks
    ``missing-field`` twice at one place: each violation keeps its own key
    (``Violation.occurrence``), so the store keeps, and the alerts name, both."""
    run = Run(start_sidecar(), tmp_path)
    run.send([action_span(1, {"session.id": "m", "idempotency_key": "k-1"})])
    offline = run.offline()
    assert sorted(v.message.split(" — ")[0] for v in offline) == [
        "required field 'action_id' missing",
        "required field 'kind' missing",
    ]
    (summary,) = run.wait_all_ended(1)
    detail = run.sidecar.session("m")
    assert summary["verdict"] == "unrecoverable"
    assert sorted(v["message"].split(" — ")[0] for v in detail["violations"]) == [
        "required field 'action_id' missing",
        "required field 'kind' missing",
    ]
    assert detail["errors"] == 2
    assert len(run.alerted_keys()) == 2


def test_an_earlier_span_delivered_again_is_dropped_live_and_offline(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """OTLP delivers at least once, and a retried Export can bring a span back after a later
    record of the same action. The sidecar's store is unique on trace, span and status, and
    the offline checker remembers the spans it read lately: both drop the repeat, and the
    session stays ok."""
    run = Run(start_sidecar(), tmp_path)
    started = action_span(1, {"session.id": "r", "id": "mail", "kind": "email", "status": "started"})
    failed = action_span(2, {"session.id": "r", "id": "mail", "kind": "email", "status": "error"}, error=True)
    run.send([started])
    run.send([failed])
    run.send([started])  # the first Export, retried
    found, verdicts, _ = run.sidecar_findings()
    assert verdicts == {"r": "ok"} and found == {"r": set()}
    assert len(run.sidecar.session("r")["actions"]) == 2
    assert by_session(run.offline()) == {}


def test_spans_are_judged_in_arrival_order_as_the_offline_checker_judges_a_file(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The sidecar judges a session's spans in the order they arrive, as the offline checker
    judges an OTLP/JSON file in its order (collector/README.md, "Order"): a judge that
    streams cannot take back an alert it has sent, so a span arriving after a later-starting
    one is judged where it arrived. Here a completion arrives before its ``started`` record:
    in arrival order the ``started`` record is a second action under the same id."""
    run = Run(start_sidecar(), tmp_path)
    base = {"session.id": "o", "id": "mail", "kind": "email", "idempotency_key": "mail-o"}
    completed = action_span(2, {**base, "status": "ok"}, start=NOW_NS + 2_000_000_000)
    started = action_span(1, {**base, "status": "started"}, start=NOW_NS + 1_000_000_000)
    run.send([completed])
    run.send([started])  # earlier start time, later arrival
    found, verdicts, _ = run.sidecar_findings()
    assert verdicts == {"o": "unrecoverable"}
    assert found == by_session(run.offline())
    assert ("duplicate-action-id", "mail", "0000000000000001", "error") in {f[:4] for f in found["o"]}
    # The same spans in start-time order are clean: the order is what decides.
    in_order = tmp_path / "in-order.otlp.jsonl"
    in_order.write_text(
        otlp_json_line(request([started])) + "\n" + otlp_json_line(request([completed])) + "\n"
    )
    assert list(OfflineCheck([str(in_order)], select_rules(), fmt="otlp-json")) == []


def test_rebuilt_state_equals_live_state_with_out_of_order_start_times(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Arrival order is what the evaluator re-feeds after an eviction: a rebuilt session
    finds what the live one found (here, start times descending while spans arrive)."""
    live = Run(start_sidecar(tmp_path / "live.db"), tmp_path)
    rebuilt = Run(start_sidecar(tmp_path / "rebuilt.db", evaluation__max_sessions=1), tmp_path)
    spans = []
    for i in range(8):
        attrs = {
            "session.id": "ooo",
            "id": f"t{i % 3}",
            "kind": "tool_call",
            "name": "book",
            "status": "error",
            "retryable": True,
            "max_attempts": 2,
            "attempts": 1 + i % 2,
        }
        spans.append(action_span(i + 1, attrs, start=NOW_NS - i * 10**9, error=True, incarnation=f"r{i % 2}"))
    noise = action_span(99, {"session.id": "noise", "id": "n", "kind": "tool_call", "status": "ok"})
    for item in spans:
        live.send([item])
        rebuilt.send([item])
        rebuilt.send([{**noise, "span": noise["span"] + item["span"]}])  # evicts "ooo" every time
    live_found, live_verdicts, _ = live.sidecar_findings()
    rebuilt_found, rebuilt_verdicts, _ = rebuilt.sidecar_findings()
    assert rebuilt.sidecar.metric("durable_sessions_sessions_rebuilt_total") >= 8
    assert rebuilt_found["ooo"] == live_found["ooo"] == by_session(live.offline())["ooo"]
    assert rebuilt_verdicts["ooo"] == live_verdicts["ooo"] == "unrecoverable"


def test_a_rule_turned_on_judges_new_spans_and_not_the_records_stored_before(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Turning evaluation.strict on raises no alert for an action stored while it was off
    (the session is rebuilt from the store), and judges the spans that arrive from then on."""
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, evaluation__idle_s=3600)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("j2", "b1", "tool_call", error=True)  # a dead end, but only strict says so
    agent.shutdown()
    assert sidecar.session("j2")["verdict"] == "ok"
    sidecar.stop()
    sidecar = start_sidecar(store, evaluation__idle_s=3600, evaluation__strict=True)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-2")
    agent.action("j2", "b2", "tool_call")  # rebuilds j2 from the store
    agent.action("j2", "b3", "tool_call", error=True)  # a dead end judged under strict
    agent.shutdown()
    detail = sidecar.session("j2")
    assert [(v["rule"], v["action_id"]) for v in detail["violations"]] == [("dead-end", "b3")]
    assert [(a["rule"], a["action_id"]) for a in sidecar.alerts_once(1)] == [("dead-end", "b3")]
