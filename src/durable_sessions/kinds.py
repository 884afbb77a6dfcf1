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


def known_spelling(kind: str) -> str | None:
    """The known kind ``kind`` is another spelling of, or None (a known kind as written,
    or no known kind at all).

    Another spelling is another case, whitespace around it, or a hyphen or a space for
    the underscore: ``'Payment'``, ``' payment'``, ``'user-prompt'``. The rules read a
    kind literally, so such a kind is neutral to them, and a payment written so would pass
    every rule unkeyed: ``invalid-field`` reports it instead.
    """
    if type(kind) is not str or kind in KNOWN:
        return None
    spelt = "_".join(kind.strip().lower().replace("-", " ").split())
    return spelt if spelt in KNOWN else None


def expected_kind(kind: str) -> str | None:
    """What ``kind`` should have been, for a message, or None when it is well formed: the
    known kind it spells otherwise (:func:`known_spelling`), or, for a kind of whitespace
    only, which says no more than an empty one, any kind at all."""
    if type(kind) is not str:
        return None
    if (known := known_spelling(kind)) is not None:
        return repr(known)
    return None if kind.strip() else "a kind"
