"""``durable-sessions-collector alerts dead|redeliver``: dead letters, seen and sent again.

A real sidecar dead-letters a webhook alert the receiver refuses; the command lists it
from the store and queues it again, and the running sidecar delivers it, with the same
Idempotency-Key, once the receiver takes it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import wait_for
from durable_sessions_collector.cli import main
from durable_sessions_collector.store import open_store
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer

SCHEMA_V1 = (Path(__file__).parents[1] / "store" / "sqlite_schema_v1.sql").read_text()

FAST = {
    "alerts__webhook__backoff_s": 0.05,
    "alerts__webhook__max_backoff_s": 0.2,
    "alerts__webhook__timeout_s": 2,
}


def outbox(sidecar, state: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("durable_sessions_alert_outbox", channel="webhook", state=state)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["alerts", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def dead_letter_then_redeliver(start_sidecar, store: str, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=None, fail_status=400) as hook:
        sidecar = start_sidecar(store, alerts__webhook__url=hook.url, alerts__webhook__max_attempts=3, **FAST)
        agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
        agent.action("pay-1", "charge", "payment")  # unkeyed: an alert
        wait_for(lambda: outbox(sidecar, "dead") == 1, timeout=60)

        code, out, err = run(capsys, "dead", "--store", store, "--json")
        assert code == 0, err
        (dead,) = json.loads(out)["dead"]
        assert (dead["channel"], dead["attempts"], dead["last_error"]) == ("webhook", 1, "HTTP 400")
        assert (dead["alert"]["rule"], dead["alert"]["session_id"]) == ("unkeyed-side-effect", "pay-1")
        code, table, _ = run(capsys, "dead", "--store", store)
        assert "unkeyed-side-effect" in table and "pay-1" in table and "HTTP 400" in table

        hook.fail_first = 0  # the receiver is fixed: it takes everything from now on
        assert run(capsys, "redeliver", "--store", store, "--channel", "otlp")[1] == (
            "0 dead-lettered alert(s) queued for delivery again\n"
        )
        code, out, err = run(capsys, "redeliver", "--store", store)  # no webhook in this configuration
        assert (code, out) == (0, "1 dead-lettered alert(s) queued for delivery again\n")
        assert (
            "1 webhook alert(s) queued, but the configuration read here (--config, environment) has no webhook channel"
            in err
        )
        wait_for(lambda: len(hook.accepted) == 1, timeout=60)
        wait_for(lambda: outbox(sidecar, "delivered") == 1, timeout=60)
        first, again = hook.requests
        assert again.headers["idempotency-key"] == first.headers["idempotency-key"]
        assert run(capsys, "dead", "--store", store)[1] == "no dead-lettered alerts\n"
        assert run(capsys, "redeliver", "--store", store)[1].startswith("0 ")
        agent.shutdown()


def test_a_dead_letter_is_listed_and_redelivered_sqlite(start_sidecar, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    dead_letter_then_redeliver(start_sidecar, f"sqlite:///{tmp_path / 'sessions.db'}", capsys)


@pytest.mark.postgres
def test_a_dead_letter_is_listed_and_redelivered_postgres(start_sidecar, postgres_url, capsys) -> None:  # type: ignore[no-untyped-def]
    dead_letter_then_redeliver(start_sidecar, postgres_url, capsys)


def test_a_secret_in_a_stored_error_is_not_printed(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # Rows dead-lettered by an earlier version hold the error as the receiver or
    # http.client wrote it: a credential the receiver echoed, the webhook URL's path.
    store_url = f"sqlite:///{tmp_path / 'sessions.db'}"
    store = open_store(store_url)
    with store.writer() as writer:
        writer.enqueue_alert("otlp", "k1", {"rule": "unkeyed-side-effect"}, 1.0)
        writer.enqueue_alert("webhook", "k2", {"rule": "unkeyed-side-effect"}, 1.0)
    otlp, webhook = (store.pending_alerts(channel, 2.0)[0] for channel in ("otlp", "webhook"))
    with store.writer() as writer:
        writer.mark_failed(otlp, "UNAUTHENTICATED: invalid credentials: Bearer SUPERSECRETTOKEN42", None)
        writer.mark_failed(webhook, "InvalidURL: '/hooks/T0KEN-abcdef123?sig=SIGNATURE-99' (found ' ')", None)
    store.close()
    config = tmp_path / "collector.yaml"
    config.write_text(
        "alerts:\n"
        "  webhook: {url: 'https://hooks.example/hooks/T0KEN-abcdef123?sig=SIGNATURE-99'}\n"
        "  otlp: {endpoint: 'collector:4317', headers: {authorization: 'Bearer SUPERSECRETTOKEN42'}}\n"
    )
    for argv in ((), ("--json",)):
        code, out, err = run(capsys, "dead", "--store", store_url, "--config", str(config), *argv)
        assert code == 0, err
        assert "invalid credentials: ***" in out and "InvalidURL: '***?sig=***'" in out
        assert "SUPERSECRETTOKEN42" not in out and "T0KEN" not in out and "SIGNATURE" not in out


def test_bad_usage_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.db"
    assert run(capsys, "dead", "--store", f"sqlite:///{missing}")[:3] == (
        2,
        "",
        f"durable-sessions-collector: store: no SQLite store at {missing}\n",
    )
    code, _, err = run(capsys, "dead", "--store", "mysql://db/x")
    assert (code == 2 and "unsupported" in err) or "store" in err
    code, _, err = run(capsys, "dead", "--store", f"sqlite:///{missing}", "--limit", "0")
    assert code == 2 and "--limit must be from 1 to 1000" in err


def test_an_admin_command_neither_creates_nor_migrates_a_store(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Migrating is the sidecar's, at its start: a listing must not rebuild a store under an
    older sidecar, nor make a store of a file that is none."""
    old = tmp_path / "old.db"
    with sqlite3.connect(old) as db:
        db.executescript(SCHEMA_V1)
        db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    code, _, err = run(capsys, "dead", "--store", f"sqlite:///{old}")
    assert (
        code == 2 and "has schema version 1, this command reads 5; a sidecar of this version migrates" in err
    )
    with sqlite3.connect(old) as db:
        assert db.execute("SELECT value FROM meta").fetchone() == ("1",)  # left as it was
        db.execute("UPDATE meta SET value = '99'")
    db.close()
    code, _, err = run(capsys, "dead", "--store", f"sqlite:///{old}")  # a store of a newer sidecar
    assert code == 2 and "has schema version 99, this command reads 5; it was made by a newer sidecar" in err
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    code, _, err = run(capsys, "redeliver", "--store", f"sqlite:///{empty}")
    assert code == 2 and "is not a durable-sessions store" in err
    assert empty.read_bytes() == b""


@pytest.mark.postgres
def test_an_admin_command_does_not_create_a_postgres_store(postgres_url: str, capsys) -> None:  # type: ignore[no-untyped-def]
    import psycopg
    from postgres_support import postgres_dsn

    typo = postgres_url.replace("schema=", "schema=typo_")
    code, _, err = run(capsys, "dead", "--store", typo)
    assert code == 2 and "no store in" in err
    schema = typo.split("schema=")[1]
    with psycopg.connect(postgres_dsn()) as db:
        assert db.execute("SELECT to_regnamespace(%s)", (schema,)).fetchone() == (None,)


def test_a_listing_cut_at_its_limit_says_so(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """As `sessions list` does: a table of exactly --limit rows is otherwise read as every
    dead letter there is, and the rest go unseen."""
    store_url = f"sqlite:///{tmp_path / 'sessions.db'}"
    store = open_store(store_url)
    with store.writer() as writer:
        for number in range(3):
            writer.enqueue_alert("webhook", f"k{number}", {"rule": "unkeyed-side-effect"}, 1.0)
    with store.writer() as writer:
        for alert in store.pending_alerts("webhook", 2.0):
            writer.mark_failed(alert, "HTTP 400", None)
    store.close()
    for argv in ((), ("--json",)):
        code, out, err = run(capsys, "dead", "--store", store_url, "--limit", "2", *argv)
        assert code == 0
        assert (
            err
            == "durable-sessions-collector: more dead-lettered alerts than the 2 shown; --limit lists up to 1000\n"
        )
        shown = len(json.loads(out)["dead"]) if argv else out.count("HTTP 400")
        assert shown == 2
        code, out, err = run(capsys, "dead", "--store", store_url, "--limit", "3", *argv)
        assert (code, err) == (0, "")
