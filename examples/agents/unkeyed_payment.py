"""Mistake: a payment without an idempotency key.

If recovery replays the action, the card is charged twice. Rule: unkeyed-side-effect.
"""

from __future__ import annotations

from _common import say, start_tracing, stop_tracing

from durable_sessions.instrument import action, session

SESSION = "unkeyed-payment"
AGENT = "unkeyed-payment"


def main() -> None:
    provider = start_tracing(AGENT)
    with session(SESSION):
        with action("a01", "user_prompt") as act:
            act.record({"confirm": True})
        with action("a02", "payment") as act:  # no idempotency_key=, no replay="skip"
            act.record({"charge": "ch_demo_2", "amount_gbp": 310})
    say(AGENT, "charged the card without an idempotency key")
    stop_tracing(provider)


if __name__ == "__main__":
    main()
