"""What every example agent shares: an OpenTelemetry SDK set up the usual way.

The exporter is the SDK's real OTLP/gRPC exporter, configured by the standard
environment variables (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_INSECURE``), which ``examples/demo.py`` points at the
sidecar. :func:`durable_sessions.instrument.resource` gives each process start its own
``service.instance.id``: the incarnation that tells a restarted agent from the one that died.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from durable_sessions.instrument import resource


def start_tracing(agent: str) -> TracerProvider:
    provider = TracerProvider(resource=resource({"service.name": f"demo-{agent}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def stop_tracing(provider: TracerProvider) -> None:
    """Flush every span to the sidecar (a real agent does this at exit, too)."""
    provider.shutdown()


def say(agent: str, text: str) -> None:
    print(f"  [{agent}] {text}", flush=True)


class Checkpoint:
    """The agent's own record of recorded results (what a real agent keeps in its
    database), so that a restarted process can replay instead of redo."""

    def __init__(self, name: str) -> None:
        directory = Path(os.environ.get("DEMO_STATE_DIR") or ".durable_sessions/demo")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}.json"
        self.results: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self, action_id: str, result: Any) -> Any:
        self.results[action_id] = result
        self.path.write_text(json.dumps(self.results))
        return result


def phase() -> int:
    """Which run of the agent this is (``--phase 2`` after a simulated crash)."""
    return int(sys.argv[sys.argv.index("--phase") + 1]) if "--phase" in sys.argv else 1
