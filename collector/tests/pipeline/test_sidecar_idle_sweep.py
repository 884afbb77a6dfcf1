"""The idle sweep ends idle sessions a batch at a time, between write batches."""

from __future__ import annotations

import time

from durable_sessions_collector import pipeline
from sidecar_clients import Agent, grpc_exporter


def test_a_wave_of_idle_sessions_is_ended_one_batch_per_sweep(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pipeline, "IDLE_BATCH", 3)
    sidecar = start_sidecar(evaluation__idle_s=3600)  # the writer's own sweeps never find these idle
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(7):
        agent.action(f"s{n}", "e1", "email", status="started")  # unresolved at the end
    agent.shutdown()
    later = time.time() + 7200
    sweep = sidecar.service.pipeline.sweep
    assert [sweep(later), sweep(later), sweep(later), sweep(later)] == [3, 3, 1, 0]
    ended = [sidecar.session(f"s{n}") for n in range(7)]
    assert all(s["state"] == "ended" and s["verdict"] == "unrecoverable" for s in ended)
    assert sidecar.metric("durable_sessions_sessions_ended_total") == 7
