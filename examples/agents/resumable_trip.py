"""A trip-booking agent that survives being killed: it keeps a journal and replays it.

Prove it with the kill-and-resume harness, which kills it at every action boundary and
runs it again::

    durable-sessions prove -- python examples/agents/resumable_trip.py

Its "world" (the person it asks, the payment provider, the mail server) is a file,
``world.jsonl`` in the trial's directory, so that what really happened can be read
afterwards: the payment provider collapses a repeated charge with the same idempotency
key, as real ones do. The mistakes the harness catches can be switched on:

- ``--no-journal``: no journal, so a resumed run asks the person again (``re-asked``);
- ``--unkeyed``: the payment has no idempotency key, so after a crash between charging
  and journaling the resumed run stops with ``ActionInDoubt`` instead of charging twice.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from durable_sessions.instrument import action, idempotency_key, resource, session
from durable_sessions.journal import SqliteJournal
from durable_sessions.mapping import prompt_digest
from durable_sessions.otlp_json import FileSpanExporter

SESSION = "trip-42"
STATE = Path(os.environ.get("DURABLE_SESSIONS_DIR", ".durable_sessions/trip"))
UNKEYED = "--unkeyed" in sys.argv


def happened(event: str, **details: Any) -> None:
    """Append what the world saw, at once and on disk (the process may die next)."""
    with open(STATE / "world.jsonl", "a") as world:
        world.write(json.dumps({"event": event, **details}) + "\n")


def charges_seen() -> set[str]:
    path = STATE / "world.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {event["key"] for event in map(json.loads, lines) if event["event"] == "charge" and event["key"]}


QUESTION = "What is your budget for the trip?"


@action("a01", "user_prompt", prompt_digest=prompt_digest(QUESTION))
def ask_budget() -> int:
    answer = random.choice([1800, 2400, 3100])  # the person; asked twice, they may answer otherwise
    happened("asked", question="budget", answer=answer)
    return answer


@action("a02", "llm_call", name="planner")
def plan_trip(budget: int) -> dict[str, Any]:
    return {"city": random.choice(["Lisbon", "Kyoto", "Quito"]), "nights": budget // 600}


@action("a03", "external_read", name="fares")
def look_up_fare(plan: dict[str, Any]) -> int:
    return 100 * plan["nights"] + random.randint(0, 99)


PAYMENT_KEY = None if UNKEYED else idempotency_key(SESSION, "a04")


@action("a04", "payment", **({} if PAYMENT_KEY is None else {"idempotency_key": PAYMENT_KEY}))
def charge(amount: int) -> dict[str, Any]:
    if PAYMENT_KEY is None or PAYMENT_KEY not in charges_seen():  # the provider collapses a repeat
        happened("charge", key=PAYMENT_KEY, amount=amount)
    return {"charged": amount, "key": PAYMENT_KEY}


@action("a05", "email", idempotency_key=idempotency_key(SESSION, "a05"))
def confirm(plan: dict[str, Any], amount: int) -> str:
    happened("email", text=f"{plan['city']}, {plan['nights']} nights, {amount}")
    return "sent"


def main() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    provider = TracerProvider(resource=resource({"service.name": "resumable-trip"}))
    traces = os.environ.get("DURABLE_SESSIONS_TRACES", str(STATE / "traces.jsonl"))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(traces)))
    journal = None
    if "--no-journal" not in sys.argv:
        journal = SqliteJournal(os.environ.get("DURABLE_SESSIONS_JOURNAL", str(STATE / "journal.db")))
    trace.set_tracer_provider(provider)
    with session(SESSION, journal=journal):
        budget = ask_budget()
        plan = plan_trip(budget)
        fare = look_up_fare(plan)
        charge(fare)
        confirm(plan, fare)
    provider.shutdown()
    print(f"booked {plan['city']} for {fare} (budget {budget})")


if __name__ == "__main__":
    main()
