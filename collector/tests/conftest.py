"""Shared fixtures: a real sidecar on free loopback ports, and real SDK clients for it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from durable_sessions_collector.config import Config, load
from durable_sessions_collector.evaluator import Evaluator, arrival
from durable_sessions_collector.service import Service
from durable_sessions_collector.store import Store
from postgres_support import postgres_url, store_url  # noqa: F401  (fixtures: a fresh PostgreSQL schema; a store of each kind)
from prometheus_client.parser import text_string_to_metric_families

from durable_sessions.mapping import Mapped


class LineBuffer(io.TextIOBase):
    """A thread-safe text sink that keeps every line written (the sidecar's stderr)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: list[str] = []

    def write(self, text: str) -> int:
        with self._lock:
            self._text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[dict[str, Any]]:
        with self._lock:
            text = "".join(self._text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]


class Sidecar:
    """A running :class:`Service` plus helpers to talk to it."""

    def __init__(self, service: Service, log: LineBuffer) -> None:
        self.service = service
        self.log = log

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.service.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.service.http_port}"

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=10) as response:
                body = response.read()
                status = response.status
                content_type = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            body, status, content_type = error.read(), error.code, error.headers.get("Content-Type", "")
        return status, json.loads(body) if content_type.startswith("application/json") else body.decode()

    def session(self, session_id: str, **arguments: str) -> dict[str, Any]:
        """The first page of the session's detail, or the page ``arguments`` ask for."""
        query = "?" + urllib.parse.urlencode(arguments) if arguments else ""
        status, document = self.get("/api/sessions/" + urllib.request.quote(session_id, safe="") + query)
        assert status == 200, document
        return document

    def violations(self, session_id: str, page: int | None = None) -> list[dict[str, Any]]:
        """Every violation of the session, walking its detail's pages (of ``page`` each)."""
        size = {} if page is None else {"violations_limit": str(page)}
        document = self.session(session_id, **size)
        found = list(document["violations"])
        while token := document["next_violations_page_token"]:
            document = self.session(session_id, violations_page_token=token, **size)
            found += document["violations"]
        return found

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = self.get("/metrics")
        assert status == 200
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def alerts(self) -> list[dict[str, Any]]:
        return [line for line in self.log.lines() if line.get("event") == "violation"]

    def alerts_once(self, count: int) -> list[dict[str, Any]]:
        """The alert lines, once there are at least ``count``. The log channel writes them
        after the commit that raised them, which an Export's answer or the API's view of
        an ended session can come before."""
        wait_for(lambda: len(self.alerts()) >= count)
        return self.alerts()

    def stop(self) -> None:
        self.service.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy; fail with its last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last value {value!r})")
        time.sleep(interval)
        value = predicate()
    return value


def serve_refused(
    tmp_path: Path, *argv: str, timeout: float = 30, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``durable-sessions-collector serve`` with ``argv`` and a SQLite store in ``tmp_path``,
    in this process's environment without any DURABLE_SESSIONS_* variable, ``env`` over
    it: the run, which must have stopped start-up with exit code 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_SESSIONS_")} | dict(env or {})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "durable_sessions_collector",
            "serve",
            "--store",
            f"sqlite:///{tmp_path / 's.db'}",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    return result


def loopback_config(store: str, settings: Mapping[str, Any] | None = None) -> Config:
    """A sidecar's configuration on free loopback ports with ``store`` (a URL), read from
    no file or variable, with ``settings`` (by dotted key) over it."""
    overrides = {
        "receivers.grpc.endpoint": "127.0.0.1:0",
        "receivers.http.endpoint": "127.0.0.1:0",
        "store": store,
    }
    return load(None, env={}, overrides={**overrides, **(settings or {})})


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    """Start a sidecar on free loopback ports with a SQLite file in ``tmp_path``."""
    started: list[Sidecar] = []

    def start(store: Path | str | None = None, **settings: Any) -> Sidecar:
        """``store``: a SQLite file, or a store URL (``postgresql://…``)."""
        url = (
            store
            if isinstance(store, str) and "://" in store
            else f"sqlite:///{store or tmp_path / 'sessions.db'}"
        )
        overrides: dict[str, Any] = {"evaluation.idle_s": 0.3}
        overrides.update({key.replace("__", "."): value for key, value in settings.items()})
        config = loopback_config(url, overrides)
        log = LineBuffer()
        sidecar = Sidecar(Service(config, log_stream=log).start(), log)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()


@pytest.fixture
def sidecar(start_sidecar: Callable[..., Sidecar]) -> Sidecar:
    return start_sidecar()


def written(store: Store, evaluator: Evaluator, *spans: Mapped, now: float = 1.0) -> list[str]:
    """``spans`` written and judged by one sidecar (``store`` and ``evaluator``) as its
    pipeline writes a batch: their sessions locked (a shared store's), then each span
    ingested, then the sessions touched at ``now``; the new findings' rules."""
    sessions = sorted({str(mapped.record["session_id"]) for mapped in spans})
    with store.writer() as writer:
        stored = writer.lock_sessions(sessions)
        if stored is not None:
            evaluator.forget_stale(stored)
        found = []
        for mapped in spans:
            added, violations = evaluator.ingest(writer, arrival(mapped), now)
            assert added
            found += [v.rule for v in violations if writer.add_violation(v, at_end=False, now=now)]
        for session_id in sessions:
            writer.touch_session(session_id, now, sum(m.record["session_id"] == session_id for m in spans))
    return found


def kept_fed(store: Store, session_id: str) -> int | None:
    """How many records the state kept of ``session_id`` holds; None: none fits."""
    with store.writer() as writer:
        kept = writer.kept_state(session_id)
    return None if kept is None else kept.fed
