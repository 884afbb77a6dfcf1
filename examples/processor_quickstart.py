"""An existing OpenTelemetry setup, plus the durability processor: one good action, one bad.

Run::

    python examples/processor_quickstart.py

What you see: the console exporter prints both spans as before (nothing about your
telemetry changes), and the ``durable_sessions`` logger prints one line for the bad
action, the payment sent without an idempotency key::

    durability violation [unkeyed-side-effect] error session 'trip-42' action 'a07' span …:
    side-effecting kind 'payment' has no idempotency_key and is not replay: skip — recovery
    would repeat a real-world effect
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from durable_sessions.instrument import action, idempotency_key, resource, session
from durable_sessions.processor import DurabilitySpanProcessor

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

# -- the setup you already have --------------------------------------------------------
provider = TracerProvider(resource=resource({"service.name": "travel-agent"}))
provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(provider)

# -- the one line you add ----------------------------------------------------------------
provider.add_span_processor(DurabilitySpanProcessor())


def book_trip() -> None:
    with session("trip-42"):
        # Good: the model's answer is recorded, so recovery replays it instead of asking again.
        with action("a02", "llm_call", name="planner") as act:
            act.record({"plan": "08:10 Nozomi to Kyoto"})

        # Good: the charge carries a key derived from session and action identity.
        with action("a06", "payment", idempotency_key=idempotency_key("trip-42", "a06")) as act:
            act.record({"charge": "ch_1"})

        # Bad: a payment without an idempotency key — after a crash, recovery charges twice.
        with action("a07", "payment") as act:
            act.record({"charge": "ch_2"})


if __name__ == "__main__":
    book_trip()
    provider.shutdown()
