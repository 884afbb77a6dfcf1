"""The rule catalogue: every durability rule, registered once, with a stable id.

Importing this package registers every rule. The CLI, the span processor and the
sidecar select from :data:`CATALOGUE` and never re-implement a rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from durable_sessions.rules import line_rules, record_rules, session_rules  # noqa: F401  (registers)
from durable_sessions.rules.base import CATALOGUE, Catalogue, Explanation, Rule

Preset = Literal["seed", "all"]
PRESETS: tuple[str, ...] = ("seed", "all")


def select_rules(
    preset: Preset = "all",
    *,
    strict: bool = False,
    disable: Iterable[str] = (),
) -> tuple[Rule, ...]:
    """The rules to run.

    ``seed`` is the seed ``replay_check``'s set; ``all`` is every rule. Strict-only
    rules join when ``strict`` is true. Unknown ids in ``disable`` raise ``KeyError``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown rule preset {preset!r}; expected one of {', '.join(PRESETS)}")
    disabled = {CATALOGUE.get(rule_id).id for rule_id in disable}
    return tuple(
        rule
        for rule in CATALOGUE
        if (preset == "all" or rule.seed) and (strict or not rule.strict_only) and rule.id not in disabled
    )


def replay_check_rules(*, strict: bool = False) -> tuple[Rule, ...]:
    """The rules ``replay-check`` runs: the seed's set, and ``invalid-field`` for the two
    fields that choose which of them apply (``kind``, ``status``): a kind or status spelt
    otherwise would pass them all (see :data:`record_rules.INVALID_KIND_OR_STATUS`).

    Only for a checker in this process: a checking worker (``--jobs``) rebuilds its rules
    from their ids, and would take this ``invalid-field`` for the whole one.
    """
    return (*select_rules("seed", strict=strict), record_rules.INVALID_KIND_OR_STATUS)


__all__ = [
    "CATALOGUE",
    "PRESETS",
    "Catalogue",
    "Explanation",
    "Preset",
    "Rule",
    "replay_check_rules",
    "select_rules",
]
