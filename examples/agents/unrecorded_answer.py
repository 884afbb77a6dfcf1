"""Mistake: the traveller's answer is used but never recorded.

After a crash, recovery has nothing to replay for the question, so the resumed session
would ask the person again. Rule: unrecorded-answer.
"""

from __future__ import annotations

from _common import say, start_tracing, stop_tracing

from durable_sessions.instrument import action, session

SESSION = "forgot-answer"
AGENT = "unrecorded-answer"


def main() -> None:
    provider = start_tracing(AGENT)
    with session(SESSION):
        with action("a01", "user_prompt", prompt_digest="sha256:dates-question"):
            dates = {"from": "2025-06-01", "to": "2025-06-08"}  # used below, never act.record()-ed
        with action("a02", "llm_call", model="planner") as act:
            act.record({"itinerary_for": dates})
    say(AGENT, "asked the travel dates and used the answer without recording it")
    stop_tracing(provider)


if __name__ == "__main__":
    main()
