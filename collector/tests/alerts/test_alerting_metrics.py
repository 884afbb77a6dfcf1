"""The metrics an operator alerts on, as a real sidecar serves them on ``/metrics``.

Alerting rules read series by their labels: a series that appears only at its first
value is no increase to ``increase()`` or ``rate()``, and a gauge series that vanishes
reads as "no data", not 0. So every series the README lists for alerting is served
from the start, at 0, for each label value it can take.
"""

from __future__ import annotations

import http.client
import time

from conftest import Sidecar, wait_for
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_clients import Agent, grpc_exporter, request_of
from webhook_server import WebhookServer

SESSION = "pay-twice"


def violations(sidecar: Sidecar, rule: str, severity: str) -> float | None:
    key = ("durable_sessions_violations_total", (("rule", rule), ("severity", severity)))
    return sidecar.metrics().get(key)


def pay(sidecar: Sidecar, incarnation: str) -> None:
    """The payment, completed with its idempotency key, by the agent's ``incarnation``."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), incarnation)
    agent.action(SESSION, "charge", "payment", idempotency_key="pay-charge-1")
    agent.shutdown()


def test_a_rule_whose_findings_can_be_warnings_has_its_warning_series_at_zero_from_the_start(
    sidecar: Sidecar,
) -> None:
    # re-executed-side-effect is an error, but a warning when the effect is re-run with
    # the same idempotency key: its first such warning must be an increase from 0.
    assert violations(sidecar, "re-executed-side-effect", "warning") == 0.0
    pay(sidecar, "run-1")
    pay(sidecar, "run-2")  # run again after a restart, with the same key: a warning
    wait_for(lambda: violations(sidecar, "re-executed-side-effect", "warning") == 1.0)
    assert violations(sidecar, "re-executed-side-effect", "error") == 0.0
    assert sidecar.session(SESSION)["verdict"] == "at_risk"


def outbox(sidecar: Sidecar) -> dict[tuple[str, str], float]:
    """``durable_sessions_alert_outbox`` as served: (channel, state) -> value."""
    return {
        (labels["channel"], labels["state"]): value
        for (name, pairs), value in sidecar.metrics().items()
        if name == "durable_sessions_alert_outbox" and (labels := dict(pairs))
    }


def test_the_outbox_gauge_serves_each_state_of_each_enabled_channel_also_at_zero(
    start_sidecar, store_url
) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=1, fail_status=404) as hook:  # the first alert is dead-lettered
        sidecar = start_sidecar(store_url, alerts__webhook__url=hook.url)
        assert outbox(sidecar) == {
            ("log", "pending"): 0,
            ("log", "delivered"): 0,
            ("webhook", "pending"): 0,
            ("webhook", "delivered"): 0,
            ("webhook", "dead"): 0,
        }
        agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "run-1")
        agent.action("unkeyed", "charge", "payment")  # unkeyed-side-effect
        agent.shutdown()
        wait_for(lambda: outbox(sidecar)[("webhook", "dead")] == 1)
        with sidecar.service.store.writer() as writer:  # what `alerts redeliver` does
            assert writer.redeliver_dead("webhook", time.time()) == 1
        sidecar.service.webhook.notify()
        # No dead letter is left: the series says 0, it does not vanish ("no data").
        settled = {
            ("log", "pending"): 0,
            ("log", "delivered"): 1,
            ("webhook", "pending"): 0,
            ("webhook", "delivered"): 1,
            ("webhook", "dead"): 0,
        }
        # The log channel marks its row after the commit, and the webhook's thread may be
        # done first: both are waited for, then each state's count is compared.
        wait_for(lambda: outbox(sidecar)[("webhook", "delivered")] == 1)
        wait_for(lambda: outbox(sidecar)[("log", "delivered")] == 1)
        assert outbox(sidecar) == settled
        assert len(hook.accepted) == 1


def invalid_span_request() -> bytes:
    """An Export request of one action span whose trace id has 8 bytes: rejected as invalid."""
    attributes = {"session.id": "bad-ids", "agent.action.id": "a1", "agent.action.kind": "tool_call"}
    span = Span(
        trace_id=b"\x01" * 8,
        span_id=b"\x02" * 8,
        name="a1",
        start_time_unix_nano=1_700_000_000_000_000_000,
        attributes=[
            KeyValue(key=key, value=AnyValue(string_value=value)) for key, value in attributes.items()
        ],
    )
    return request_of(span).SerializeToString()


def test_span_counters_are_served_at_zero_for_each_transport_and_reason_from_the_start(
    sidecar: Sidecar,
) -> None:
    # Rejected spans are spans lost (invalid, unstorable) or refused for now (overload,
    # unavailable): the first rejection after a start must be an increase from 0.
    samples = sidecar.metrics()
    for transport in ("grpc", "http"):
        assert samples.get(("durable_sessions_spans_received_total", (("transport", transport),))) == 0
        for reason in ("invalid", "unstorable", "overload", "unavailable"):
            key = ("durable_sessions_spans_rejected_total", (("reason", reason), ("transport", transport)))
            assert samples.get(key) == 0, (transport, reason)
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.request(
            "POST", "/v1/traces", invalid_span_request(), {"Content-Type": "application/x-protobuf"}
        )
        response = connection.getresponse()
        response.read()
    finally:
        connection.close()
    assert response.status == 200  # partial success: the span is named as rejected
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="http", reason="invalid") == 1
    assert sidecar.metric("durable_sessions_spans_received_total", transport="http") == 1
