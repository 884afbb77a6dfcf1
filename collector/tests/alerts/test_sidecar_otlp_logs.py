"""OTLP log alerts: a real sidecar exports log records to a real local LogsService.

Each violation becomes one OpenTelemetry log record (severity, body, attributes, the
violating span's trace and span ids), sent over OTLP/gRPC from the outbox: retried with
backoff while the receiver is down or UNAVAILABLE, kept across a restart, dead-lettered
after ``max_attempts``, and never sent twice once delivered.
"""

from __future__ import annotations

import io
import json
import time

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector.alerts.otlp import OtlpAlerts, grpc_target, log_record
from durable_sessions_collector.alerts.outbox import DeliveryPolicy
from durable_sessions_collector.cli import main
from durable_sessions_collector.config import ConfigError, load
from durable_sessions_collector.jsonlog import JsonLog
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.sdk.trace.export import SpanExportResult
from otlp_log_server import OtlpLogServer
from sidecar_clients import Agent, grpc_exporter, recorded_agent
from webhook_server import ALERT, ClosedPort

SECRET = "card 4242 4242 4242 4242"
TOKEN = "Bearer otlp-header-secret-0123456789"
FAST = {
    "alerts__otlp__backoff_s": 0.05,
    "alerts__otlp__max_backoff_s": 0.2,
    "alerts__otlp__timeout_s": 2,
}


def unkeyed_payment(sidecar) -> Agent:  # type: ignore[no-untyped-def]
    """unkeyed-side-effect (an error, found at ingest); the result text is a secret."""
    agent = recorded_agent(sidecar.grpc_endpoint)
    agent.action("pay-1", "charge", "payment", result=json.dumps({"note": SECRET}))
    return agent


def outbox(sidecar, state: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("durable_sessions_alert_outbox", channel="otlp", state=state)


def deliveries(sidecar, outcome: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("durable_sessions_alert_deliveries_total", channel="otlp", outcome=outcome)


def attributes(record: logs_pb2.LogRecord) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in record.attributes}


def records(server: OtlpLogServer) -> list[logs_pb2.LogRecord]:
    found = []
    for export in server.accepted:
        [resource_logs] = export.request.resource_logs
        [scope_logs] = resource_logs.scope_logs
        found.extend(scope_logs.log_records)
    return found


def test_each_violation_arrives_once_as_a_log_record_linked_to_its_span(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with OtlpLogServer() as logs:
        sidecar = start_sidecar(
            alerts__otlp__endpoint=f"http://{logs.endpoint}",
            alerts__otlp__headers={"Authorization": TOKEN, "x-scope-orgid": "t1"},
            **FAST,
        )
        first = unkeyed_payment(sidecar)
        first.action("pay-2", "p1", "payment", idempotency_key="pay-2/p1")
        second = recorded_agent(
            sidecar.grpc_endpoint, "inc-2"
        )  # a new incarnation sends the keyed payment again
        second.action("pay-2", "p1", "payment", idempotency_key="pay-2/p1")  # a warning

        def by_rule() -> dict[str, logs_pb2.LogRecord]:
            return {attributes(r)["durable_sessions.rule"]: r for r in records(logs)}

        wait_for(lambda: {"unkeyed-side-effect", "re-executed-side-effect"} <= set(by_rule()))
        time.sleep(0.5)  # several delivery rounds, and the sessions end (idle_s 0.3)
        wait_for(lambda: outbox(sidecar, "pending") == 0)
        found = records(logs)
        keys = [attributes(r)["durable_sessions.violation.key"] for r in found]
        assert len(keys) == len(set(keys)) == len(logs.requests)  # each once, one record per Export

        export = logs.accepted[0]
        assert export.metadata["authorization"] == TOKEN and export.metadata["x-scope-orgid"] == "t1"
        [resource_logs] = export.request.resource_logs
        resource = {kv.key: kv.value.string_value for kv in resource_logs.resource.attributes}
        assert resource["service.name"] == "durable-sessions-collector"
        assert resource_logs.scope_logs[0].scope.name == "durable_sessions_collector"

        error = by_rule()["unkeyed-side-effect"]
        [stored] = [v for v in sidecar.session("pay-1")["violations"] if v["rule"] == "unkeyed-side-effect"]
        assert (error.severity_number, error.severity_text) == (logs_pb2.SEVERITY_NUMBER_ERROR, "ERROR")
        assert error.body.string_value == stored["message"]
        assert (error.trace_id, error.span_id) == first.recorder.ids("charge")
        assert error.time_unix_nano > 0
        attrs = attributes(error)
        assert attrs["session.id"] == "pay-1"
        assert attrs["durable_sessions.severity"] == "error"
        assert attrs["agent.action.id"] == "charge"
        assert attrs["durable_sessions.verdict"] == "unrecoverable"
        assert attrs["durable_sessions.alert.idempotency_key"].startswith("ds-alert-")

        warning = by_rule()["re-executed-side-effect"]
        assert (warning.severity_number, warning.severity_text) == (logs_pb2.SEVERITY_NUMBER_WARN, "WARN")
        assert attributes(warning)["durable_sessions.severity"] == "warning"
        assert attributes(warning)["durable_sessions.verdict"] == "at_risk"
        assert (warning.trace_id, warning.span_id) == second.recorder.ids("p1")

        raw = b"".join(e.request.SerializeToString() for e in logs.requests)
        # never result text, nor a part of it ("4242" alone can be in a hex id or key)
        assert SECRET.encode() not in raw and b"4242 4242" not in raw
        delivered = len(found)
        assert outbox(sidecar, "delivered") == delivered
        # Counted, then its latency observed, after the mark the outbox gauge reads.
        latency = ("durable_sessions_alert_latency_seconds_count", (("channel", "otlp"),))
        wait_for(lambda: sidecar.metrics().get(latency, 0) >= delivered)
        assert deliveries(sidecar, "delivered") == delivered and deliveries(sidecar, "retry") == 0
        assert sidecar.metrics()[latency] == delivered
        assert "otlp-header-secret" not in json.dumps(sidecar.log.lines())
        first.shutdown()
        second.shutdown()


def test_a_receiver_that_is_down_gets_the_record_once_after_retries_and_a_restart(
    start_sidecar, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    down = ClosedPort()  # the receiver is down
    port = down.port
    store = tmp_path / "sessions.db"
    # A bare loopback host:port: plaintext, like http://.
    settings = {"alerts__otlp__endpoint": f"127.0.0.1:{port}", "alerts__otlp__max_attempts": 1000, **FAST}

    first = start_sidecar(store, **settings)
    agent = unkeyed_payment(first)
    wait_for(lambda: deliveries(first, "retry") >= 2)  # connection refused: UNAVAILABLE, retried
    assert outbox(first, "pending") == 1
    retry = next(line for line in first.log.lines() if line["event"] == "alert-delivery-retry")
    assert retry["channel"] == "otlp" and retry["error"].startswith("UNAVAILABLE")
    first.stop()  # still pending: it must survive the restart
    agent.shutdown()
    spans = agent.recorder.spans

    second = start_sidecar(store, **settings)
    assert outbox(second, "pending") == 1
    with OtlpLogServer(down.release()) as logs:  # the receiver comes up
        wait_for(lambda: outbox(second, "delivered") == 1)
        assert len(logs.requests) == 1
        [record] = records(logs)
        assert attributes(record)["session.id"] == "pay-1"
        assert (record.trace_id, record.span_id) == agent.recorder.ids("charge")
        second.stop()

        # Once more: a new process, and the same span delivered again (OTLP is at least once).
        third = start_sidecar(store, **settings)
        assert grpc_exporter(third.grpc_endpoint).export(spans) == SpanExportResult.SUCCESS
        assert third.metric("durable_sessions_spans_duplicate_total") == 1
        time.sleep(0.4)  # several delivery rounds
        assert len(logs.requests) == 1
        assert outbox(third, "pending") == 0 and outbox(third, "delivered") == 1


def test_a_receiver_that_is_always_unavailable_gets_max_attempts_then_dead_letter(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with OtlpLogServer(fail_first=None, fail_code=grpc.StatusCode.UNAVAILABLE) as logs:
        sidecar = start_sidecar(
            alerts__otlp__endpoint=f"http://{logs.endpoint}", alerts__otlp__max_attempts=3, **FAST
        )
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        assert len(logs.requests) == 3
        assert deliveries(sidecar, "retry") == 2 and deliveries(sidecar, "dead_letter") == 1
        assert outbox(sidecar, "pending") == 0
        [dead] = [line for line in sidecar.log.lines() if line["event"] == "alert-dead-letter"]
        assert dead["channel"] == "otlp" and dead["attempts"] == 3
        assert dead["error"] == "UNAVAILABLE: try later" and dead["reason"] == "attempts exhausted"
        time.sleep(0.5)
        assert len(logs.requests) == 3  # a dead letter is never sent again
        assert sidecar.get("/healthz")[0] == 200
        agent.shutdown()


def test_a_receiver_that_refuses_the_record_dead_letters_it_at_once(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with OtlpLogServer(fail_first=None, fail_code=grpc.StatusCode.INVALID_ARGUMENT) as logs:
        sidecar = start_sidecar(alerts__otlp__endpoint=f"http://{logs.endpoint}", **FAST)
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        assert len(logs.requests) == 1
        assert deliveries(sidecar, "retry") == 0 and deliveries(sidecar, "dead_letter") == 1
        agent.shutdown()


def test_a_secret_the_receiver_echoes_is_stored_and_listed_as_the_log_shows_it(start_sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # Some gateways quote the credential they refuse. The log line had it as ***, but the
    # outbox kept the error verbatim, and `alerts dead` printed the token.
    echoed = f"invalid credentials: {TOKEN}"
    with OtlpLogServer(
        fail_first=None, fail_code=grpc.StatusCode.UNAUTHENTICATED, fail_details=echoed
    ) as logs:
        sidecar = start_sidecar(
            alerts__otlp__endpoint=f"http://{logs.endpoint}",
            alerts__otlp__headers={"Authorization": TOKEN},
            **FAST,
        )
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        agent.shutdown()
    [dead] = sidecar.service.store.dead_alerts()
    assert dead.last_error == "UNAUTHENTICATED: invalid credentials: ***"
    [line] = [line for line in sidecar.log.lines() if line["event"] == "alert-dead-letter"]
    assert line["error"] == dead.last_error
    assert main(["alerts", "dead", "--store", f"sqlite:///{sidecar.service.store.path}"]) == 0
    assert "invalid credentials: ***" in capsys.readouterr().out


# --- configuration and the record itself, without a sidecar --------------------------------


def test_otlp_settings_from_environment_and_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = load(
        None,
        env={
            "DURABLE_SESSIONS_ALERTS_OTLP_ENDPOINT": "https://otel.example:4317",
            "DURABLE_SESSIONS_ALERTS_OTLP_HEADERS": "Authorization=Bearer%20abcdefgh12345678,x-tenant=t1",
            "DURABLE_SESSIONS_ALERTS_OTLP_MAX_ATTEMPTS": "4",
        },
    )
    assert config.alerts_otlp_endpoint == "https://otel.example:4317"
    assert config.alerts_otlp_headers == (("authorization", "Bearer abcdefgh12345678"), ("x-tenant", "t1"))
    assert config.alerts_otlp_max_attempts == 4 and config.alerts_otlp_insecure is None
    assert config.display()["alerts.otlp.headers"] == {"authorization": "***", "x-tenant": "***"}
    assert "abcdefgh12345678" in config.secrets()
    assert "abcdefgh12345678" not in repr(config)

    path = tmp_path / "collector.yaml"
    path.write_text("alerts:\n  otlp: {endpoint: 'collector:4317', insecure: true, headers: {x-a: b}}\n")
    config = load(path, env={})
    assert (config.alerts_otlp_endpoint, config.alerts_otlp_insecure) == ("collector:4317", True)
    assert config.alerts_otlp_headers == (("x-a", "b"),)
    assert load(None, env={}).alerts_otlp_endpoint is None  # off by default


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"alerts.otlp.endpoint": "ftp://x:1"}, "alerts.otlp.endpoint: expected host:port or http(s)://"),
        ({"alerts.otlp.endpoint": "http://collector"}, "alerts.otlp.endpoint: expected host:port"),
        ({"alerts.otlp.endpoint": "http://u:pw@c:4317"}, "no credentials"),
        # accepted, then written in the clear in every delivery line's endpoint
        ({"alerts.otlp.endpoint": "u:pw@c:4317"}, "no credentials"),
        ({"alerts.otlp.endpoint": "collector"}, "alerts.otlp.endpoint: expected host:port"),
        ({"alerts.otlp.headers": "novalue"}, "alerts.otlp.headers: expected key=value pairs"),
        ({"alerts.otlp.headers": "bad key=1"}, "not a valid gRPC metadata key"),
        ({"alerts.otlp.insecure": "maybe"}, "alerts.otlp.insecure: expected true or false"),
        ({"alerts.otlp.backoff_s": "5", "alerts.otlp.max_backoff_s": "1"}, "alerts.otlp.max_backoff_s: must"),
    ],
)
def test_invalid_otlp_settings_name_the_key(settings, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as caught:
        load(None, env={}, overrides=settings)
    assert message in str(caught.value)
    assert "pw" not in str(caught.value)


@pytest.mark.parametrize(
    ("endpoint", "insecure", "expected"),
    [
        ("http://127.0.0.1:4317", None, ("127.0.0.1:4317", False)),
        ("http://collector:4317", None, ("collector:4317", False)),  # as the SDK: http:// is plaintext
        ("http://collector:4317", False, ("collector:4317", True)),
        ("https://collector:4317", True, ("collector:4317", True)),  # as the SDK: https:// is always TLS
        ("localhost:4317", None, ("localhost:4317", False)),
        ("collector:4317", None, ("collector:4317", True)),
        ("collector:4317", True, ("collector:4317", False)),
    ],
)
def test_tls_follows_the_sdk_rules(endpoint, insecure, expected) -> None:  # type: ignore[no-untyped-def]
    assert grpc_target(endpoint, insecure) == expected


@pytest.mark.parametrize("host", ["LOCALHOST", "[::ffff:127.0.0.1]"])
def test_a_loopback_host_however_written_is_plaintext_and_delivered(host: str) -> None:
    """Host names are case-insensitive, and an IPv4-mapped loopback address is loopback:
    each was taken for another host, so the channel spoke TLS to the local plaintext
    Collector and every alert failed its handshake until it was dead-lettered."""
    with OtlpLogServer() as logs:
        endpoint = f"{host}:{logs.port}"
        channel = OtlpAlerts(None, JsonLog(io.StringIO()), None, endpoint, policy=DeliveryPolicy(timeout_s=5))  # type: ignore[arg-type]
        try:
            attempt = channel.send(ALERT)
        finally:
            channel.close()
        assert attempt.outcome == "delivered", attempt
        assert len(logs.accepted) == 1
        assert grpc_target(endpoint, None) == (endpoint, False)


def test_a_record_without_a_span_has_no_ids_and_an_unknown_severity_is_info() -> None:
    record = log_record({"rule": "r", "severity": "notice", "session_id": "s", "message": "m",
                         "trace_id": None, "span_id": "zz", "detected_at": 1.5})  # fmt: skip
    assert (record.trace_id, record.span_id) == (b"", b"")
    assert record.severity_number == logs_pb2.SEVERITY_NUMBER_INFO
    assert record.time_unix_nano == 1_500_000_000
    assert "agent.action.id" not in attributes(record)
    assert record.body == common_pb2.AnyValue(string_value="m")
