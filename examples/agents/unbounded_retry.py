"""Mistake: a retryable tool call with no cap on its attempts.

A retry without max_attempts is an unbounded loop that never asks anyone. Rule:
unbounded-retry.
"""

from __future__ import annotations

from _common import say, start_tracing, stop_tracing

from durable_sessions.instrument import action, session

SESSION = "retry-forever"
AGENT = "unbounded-retry"


def main() -> None:
    provider = start_tracing(AGENT)
    with session(SESSION), action("a01", "tool_call", retryable=True, attempts=19) as act:  # no max_attempts=
        act.record({"seats": []})
    say(AGENT, "retried a seat search 19 times with no limit")
    stop_tracing(provider)


if __name__ == "__main__":
    main()
