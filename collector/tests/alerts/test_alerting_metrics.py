"""The metrics an operator alerts on, as a real sidecar serves them on ``/metrics``.

Alerting rules read series by their labels: a series that appears only at its first
value is no increase to ``increase()`` or ``rate()``, and a gauge series that vanishes
reads as "no data", not 0. So every series the README lists for alerting is served
from the start, at 0, for each label value it can take.
"""

from __future__ import annotations

from conftest import Sidecar, wait_for
from sidecar_clients import Agent, grpc_exporter

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
