"""Mistake: after a restart, the agent asks the person a question already answered.

Run 1 asks and records the answer, then the process dies. Run 2 (a new process, a new
incarnation) asks the same question again instead of replaying the recorded answer.
Rule: re-asked.
"""

from __future__ import annotations

from _common import phase, say, start_tracing, stop_tracing

from durable_sessions.instrument import action, session

SESSION = "reasked-after-restart"
AGENT = "re-asked"


def main() -> None:
    provider = start_tracing(AGENT)
    with session(SESSION):
        with action("a01", "user_prompt", prompt_digest="sha256:seat-question") as act:
            act.record({"seat": "aisle" if phase() == 1 else "window"})
        if phase() == 1:
            say(AGENT, "asked the seat preference and recorded it ... then the process crashed")
        else:
            say(AGENT, "restarted and asked the seat preference again (the answer changed)")
    stop_tracing(provider)


if __name__ == "__main__":
    main()
