"""The action kind taxonomy of the seed's recovery design.

A *non-deterministic* action gives a different answer when it is run again, so its
outcome must be recorded and replayed. A *side-effecting* action changes the world, so
running it again repeats the effect unless it is keyed or skipped. Every other kind
(``tool_call`` included) is neutral unless the record says ``side_effects: true``.
"""

from __future__ import annotations

USER_PROMPT = "user_prompt"
LLM_CALL = "llm_call"
EXTERNAL_READ = "external_read"
RANDOM = "random"
CLOCK = "clock"
TOOL_CALL = "tool_call"
WRITE = "write"
PAYMENT = "payment"
EMAIL = "email"
NOTIFY = "notify"
DEPLOY = "deploy"

NON_DETERMINISTIC: frozenset[str] = frozenset({USER_PROMPT, LLM_CALL, EXTERNAL_READ, RANDOM, CLOCK})
"""Kinds whose outcome must be recorded: running them again gives another answer."""

SIDE_EFFECTING: frozenset[str] = frozenset({WRITE, PAYMENT, EMAIL, NOTIFY, DEPLOY})
"""Kinds that touch the world: running them again repeats the effect."""

KNOWN: frozenset[str] = NON_DETERMINISTIC | SIDE_EFFECTING | {TOOL_CALL}
