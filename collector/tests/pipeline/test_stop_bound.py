"""A stop writes what is still queued for a bounded time, and refuses the rest."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from durable_sessions_collector import pipeline as pipeline_module
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.evaluator import Evaluator, arrival
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.pipeline import Job, Pipeline
from durable_sessions_collector.store import open_store

from durable_sessions.mapping import Mapped
from durable_sessions.record import Location

REQUESTS, SPANS = 6, 20


def queued_at_stop(tmp_path: Path) -> tuple[Pipeline, list[Job]]:
    """A pipeline whose stop was asked for with ``REQUESTS`` requests still queued."""
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    pipeline = Pipeline(store, Evaluator(), Metrics(store), JsonLog(io.StringIO()), queue_size=REQUESTS)
    jobs = []
    for request in range(REQUESTS):
        items = [
            arrival(
                Mapped(
                    {
                        "session_id": f"s{request}",
                        "action_id": f"a{span}",
                        "kind": "tool_call",
                        "status": "ok",
                    },
                    Location(None, None, f"{request:032x}", f"{span + 1:016x}"),
                )
            )
            for span in range(SPANS)
        ]
        jobs.append(Job(items, "grpc"))
        pipeline.queue.put_nowait(jobs[-1])  # as submit() would while the writer runs
    pipeline._stopping.set()
    return pipeline, jobs


def test_a_stop_writes_the_requests_still_queued(tmp_path: Path) -> None:
    pipeline, jobs = queued_at_stop(tmp_path)
    pipeline.start()
    pipeline.stop()
    assert [(job.done.is_set(), job.error, job.stored) for job in jobs] == [(True, None, SPANS)] * REQUESTS
    assert pipeline.store.count_actions() == REQUESTS * SPANS
    pipeline.store.close()


def test_requests_still_queued_when_the_stop_s_time_is_spent_are_refused_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipeline_module, "WRITE_AT_STOP_S", 0.0)
    pipeline, jobs = queued_at_stop(tmp_path)
    pipeline.start()
    pipeline.stop()
    assert all(job.done.is_set() for job in jobs)
    assert {str(job.error) for job in jobs} == {"the sidecar stopped before the records were stored"}
    assert pipeline.store.count_actions() == 0
    pipeline.store.close()
