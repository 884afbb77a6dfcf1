"""The metrics an operator alerts on, as a real sidecar serves them on ``/metrics``.

Alerting rules read series by their labels: a series that appears only at its first
value is no increase to ``increase()`` or ``rate()``, and a gauge series that vanishes
reads as "no data", not 0. So every series the README lists for alerting is served
from the start, at 0, for each label value it can take.
"""

from __future__ import annotations

import time

from conftest import Sidecar, wait_for
from sidecar_clients import Agent, grpc_exporter
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
        wait_for(lambda: outbox(sidecar)[("webhook", "delivered")] == 1)
        # No dead letter is left: the series says 0, it does not vanish ("no data").
        assert outbox(sidecar) == {
            ("log", "pending"): 0,
            ("log", "delivered"): 1,
            ("webhook", "pending"): 0,
            ("webhook", "delivered"): 1,
            ("webhook", "dead"): 0,
        }
        assert len(hook.accepted) == 1
