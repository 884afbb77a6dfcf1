"""What a rule's example may break besides the rule itself.

A rule's bad example (``examples/rules/<id>.bad.jsonl``, the "Example" of its
``durable-sessions explain`` text) shows that rule alone, so that a reader who runs it
sees one finding and learns one thing. The exceptions are rules whose every error case
is, by definition, also another rule's: a completed side effect executed again without
an idempotency key is also ``unkeyed-side-effect``, and one executed again with a
different key is also ``unstable-key``.
"""

from __future__ import annotations

INHERENT_COMPANIONS: dict[str, frozenset[str]] = {
    "re-executed-side-effect": frozenset({"unkeyed-side-effect", "unstable-key"}),
}


def unexpected_rules(rule_id: str, found: set[str]) -> set[str]:
    """The rules in ``found`` that a bad example of ``rule_id`` should not break."""
    return found - {rule_id} - INHERENT_COMPANIONS.get(rule_id, frozenset())
