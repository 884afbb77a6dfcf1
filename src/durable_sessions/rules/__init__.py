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

    ``seed`` is the seed ``replay_check``'s set, as ``replay-check`` runs it: its rules, and
    ``invalid-field`` for the two fields that choose which of them apply (``kind``,
    ``status``), since a kind or status spelt otherwise would pass them all (see
    :data:`record_rules.INVALID_KIND_OR_STATUS`). ``all`` is every rule. Strict-only rules
    join when ``strict`` is true. Unknown ids in ``disable`` raise ``KeyError``.
    Another process rebuilds the selection from :func:`rule_references`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown rule preset {preset!r}; expected one of {', '.join(PRESETS)}")
    disabled = {CATALOGUE.get(rule_id).id for rule_id in disable}
    chosen = tuple(
        rule
        for rule in CATALOGUE
        if (preset == "all" or rule.seed) and (strict or not rule.strict_only) and rule.id not in disabled
    )
    if preset == "seed" and record_rules.INVALID_KIND_OR_STATUS.id not in disabled:
        chosen += (record_rules.INVALID_KIND_OR_STATUS,)
    return chosen


# Rules a selection holds that are a catalogue rule narrowed, under the catalogue rule's
# id (one rule, one id in the findings): another process rebuilds them by these names.
_NARROWED: dict[str, Rule] = {"invalid-field[kind,status]": record_rules.INVALID_KIND_OR_STATUS}


def rule_references(rules: Iterable[Rule]) -> list[str]:
    """Names that :func:`rules_from_references` rebuilds ``rules`` from, in another process
    (a checking worker, the processor's checker): a rule's id, or for a narrowed rule the
    name of its narrowing, which its id alone would rebuild as the whole rule."""
    narrowings = {id(rule): name for name, rule in _NARROWED.items()}
    return [narrowings.get(id(rule), rule.id) for rule in rules]


def rules_from_references(references: Iterable[str]) -> list[Rule]:
    """The rules :func:`rule_references` named, the same objects. Unknown names raise ``KeyError``."""
    return [_NARROWED[name] if name in _NARROWED else CATALOGUE.get(name) for name in references]


__all__ = [
    "CATALOGUE",
    "PRESETS",
    "Catalogue",
    "Explanation",
    "Preset",
    "Rule",
    "rule_references",
    "rules_from_references",
    "select_rules",
]
