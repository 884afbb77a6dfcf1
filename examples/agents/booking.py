"""A recoverable booking agent: it crashes half-way and resumes without harm.

Run 1 asks the traveller's budget, plans with a model and searches flights (a bounded,
retryable tool call), recording every result, then the process dies. Run 2 is a new
process (a new incarnation): it replays the recorded answer and plan instead of asking
and calling again, and pays and confirms with idempotency keys derived from session and
action, which are the same in every incarnation. Verdict: ok.
"""

from __future__ import annotations

from _common import Checkpoint, phase, say, start_tracing, stop_tracing

from durable_sessions.instrument import action, idempotency_key, session

SESSION = "booking-ok"
AGENT = "booking"


def main() -> None:
    provider = start_tracing(AGENT)
    state = Checkpoint(SESSION)
    with session(SESSION):
        if phase() == 1:
            with action("a01", "user_prompt", prompt_digest="sha256:budget-question") as act:
                state.save("a01", act.record({"budget_gbp": 2400}))
            with action("a02", "llm_call", model="planner") as act:
                state.save("a02", act.record({"plan": ["LHR-LIS", "hotel"]}))
            with action("a03", "tool_call", retryable=True, max_attempts=3, attempts=1) as act:
                act.record({"flights": ["TP1351"]})
            say(AGENT, "asked the budget, planned, searched flights ... then the process crashed")
        else:
            # Recovery: serve recorded results instead of asking and calling again.
            with action("a01", "user_prompt", replayed=True) as act:
                act.record(state.results["a01"])
            with action("a02", "llm_call", model="planner", replayed=True) as act:
                act.record(state.results["a02"])
            with action("a04", "payment", idempotency_key=idempotency_key(SESSION, "a04")) as act:
                act.record({"charge": "ch_demo_1", "amount_gbp": 2150})
            with action("a05", "email", idempotency_key=idempotency_key(SESSION, "a05")) as act:
                act.record({"sent": True})
            say(AGENT, "restarted: replayed the answer and the plan, paid and confirmed with keys")
    stop_tracing(provider)


if __name__ == "__main__":
    main()
