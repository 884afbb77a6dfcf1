"""What a rule is, and the catalogue that holds them.

A rule is a small unit with a stable slug id, a severity, a fix title and an
explanation, written the way ruff documents its rules: the checking function's docstring
has a one-line summary, then ``## Why is this bad?``, ``## Example`` and
``## Use instead`` sections. ``durable-sessions explain <id>`` prints exactly that, and
``docs/rules.md`` is generated from it.

There are three scopes:

- ``line`` rules are raised by readers (a line that is not JSON, a missing field);
- ``record`` rules judge one action at a time: ``check(record) -> message | None``;
- ``session`` rules judge an action against what its session did before:
  ``check(session, record, where, prior) -> message | (message, severity) | None``,
  and, for rules that can only decide once the session is over, ``at_end(session)``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from durable_sessions.violation import Severity, Violation

if TYPE_CHECKING:
    from durable_sessions.record import ActionRecord, Location

Scope = Literal["line", "record", "session"]
REPLAYED = "replayed"
"""The field that marks a record whose outcome was served from the record, not executed."""
Finding = str | tuple[str, Severity] | None


class Facts(NamedTuple):
    """The cheap facts about a record that decide which rules can apply to it.

    ``fields`` holds the rule-relevant field names the record has (see
    :data:`Rule.fields`); ``has_prior`` says the session saw the action id before;
    ``watching`` says a run of failures is being watched in the session. The engine
    asks each rule once per distinct ``Facts`` and remembers the answer, so a rule that
    cannot fire on a record costs nothing for it.
    """

    kind: str
    status: str
    fields: frozenset[str]
    has_prior: bool
    watching: bool


Condition = Callable[[Facts], bool]


def _always(facts: Facts) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Explanation:
    """The ruff-style sections of a rule's documentation."""

    summary: str
    why: str
    example: str
    use_instead: str

    @classmethod
    def from_docstring(cls, doc: str | None, rule_id: str) -> Explanation:
        text = inspect.cleandoc(doc or "")
        summary, _, rest = text.partition("\n")
        sections = dict.fromkeys(("why is this bad?", "example", "use instead"), "")
        for header, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", rest, re.M | re.S):
            sections[header.strip().lower()] = body.strip()
        missing = [name for name, body in sections.items() if not body]
        if not summary or missing:
            raise ValueError(f"rule {rule_id}: docstring lacks {missing or 'a summary'}")
        return cls(
            summary.strip(),
            sections["why is this bad?"],
            sections["example"],
            sections["use instead"],
        )


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of the catalogue.

    ``seed`` marks the rules of the seed's ``replay_check`` (the ``seed`` preset);
    ``strict_only`` rules run only when strict checking is asked for. ``when`` says on
    which records the check can fire at all, from their :class:`Facts`; ``fields`` names
    the record fields ``when`` looks at. ``specialize``, when given, returns the check
    to run on records with the given facts (a record rule that does per-field work can
    prepare it once per record shape). ``judges_replays`` false: the check is not run on
    a replayed record (``replayed: true``) of an action its session has seen before, whose
    execution the check judged already (see :func:`record_rule`).
    """

    id: str
    severity: Severity
    scope: Scope
    fix: str
    explanation: Explanation
    other_severities: tuple[Severity, ...] = ()
    """The severities a finding of this rule can have besides ``severity`` (a check that
    returns ``(message, severity)``, see :data:`Finding`), for whoever counts findings by
    severity: see :attr:`severities`."""
    seed: bool = False
    strict_only: bool = False
    at_session_end: bool = False
    judges_replays: bool = True
    fields: frozenset[str] = frozenset()
    when: Condition = field(default=_always, repr=False)
    check: Callable[..., Finding] | None = field(default=None, repr=False)
    specialize: Callable[[Facts], Callable[..., Finding]] | None = field(default=None, repr=False)
    at_end: Callable[..., Iterable[tuple[Any, str]]] | None = field(default=None, repr=False)

    @property
    def summary(self) -> str:
        return self.explanation.summary

    @property
    def severities(self) -> tuple[Severity, ...]:
        """Every severity a finding of this rule can have, ``severity`` first."""
        return (self.severity, *self.other_severities)

    def check_for(self, facts: Facts) -> Callable[..., Finding]:
        """The check to run on records with ``facts``."""
        check = self.specialize(facts) if self.specialize is not None else self.check
        if not self.judges_replays and facts.has_prior and REPLAYED in facts.fields:
            return partial(_unless_replayed, check)
        return check  # type: ignore[return-value]

    def violation(
        self,
        message: str,
        *,
        session_id: str | None,
        action_id: str | None,
        location: Location | None,
        severity: Severity | None = None,
        kind: str | None = None,
        occurrence: int = 0,
    ) -> Violation:
        """A violation of this rule at ``location`` by an action of ``kind`` (the
        ``occurrence``-th of this rule there: see :attr:`Violation.occurrence`)."""
        loc = location
        return Violation(
            rule=self.id,
            severity=severity or self.severity,
            message=message,
            session_id=session_id,
            action_id=action_id,
            file=loc.file if loc else None,
            line=loc.line if loc else None,
            trace_id=loc.trace_id if loc else None,
            span_id=loc.span_id if loc else None,
            kind=kind,
            occurrence=occurrence,
        )

    def on(self, record: ActionRecord, where: Location, finding: Finding) -> Violation:
        """The violation ``finding`` (a check's result) describes for ``record``."""
        message, severity = (finding, None) if isinstance(finding, str) else finding  # type: ignore[misc]
        return self.violation(
            message,
            session_id=record.get("session_id"),
            action_id=record.get("action_id"),
            location=where,
            severity=severity,
            kind=record.get("kind"),
        )


def _unless_replayed(check: Callable[..., Finding], record: ActionRecord) -> Finding:
    """``check(record)``, unless the record is a replay: it served the outcome the session
    recorded before instead of executing, and that execution was judged when it was read."""
    return None if record.get(REPLAYED) is True else check(record)


class Catalogue:
    """Every rule, in the order its checks run and its documentation is printed."""

    def __init__(self) -> None:
        self._rules: dict[str, Rule] = {}

    def add(self, rule: Rule) -> Rule:
        if rule.id in self._rules:
            raise ValueError(f"rule id {rule.id!r} registered twice")
        self._rules[rule.id] = rule
        return rule

    def get(self, rule_id: str) -> Rule:
        try:
            return self._rules[rule_id]
        except KeyError:
            known = ", ".join(self._rules)
            raise KeyError(f"unknown rule {rule_id!r}; known rules: {known}") from None

    def __iter__(self) -> Iterator[Rule]:
        return iter(self._rules.values())

    def __len__(self) -> int:
        return len(self._rules)

    def __contains__(self, rule_id: object) -> bool:
        return rule_id in self._rules


CATALOGUE = Catalogue()


def _register(scope: Scope, rule_id: str, severity: Severity, fix: str, **options: Any):
    def decorate(func: Callable[..., Finding]) -> Rule:
        rule = Rule(
            id=rule_id,
            severity=severity,
            scope=scope,
            fix=fix,
            explanation=Explanation.from_docstring(func.__doc__, rule_id),
            check=func,
            **options,
        )
        return CATALOGUE.add(rule)

    return decorate


def applies_when(
    *,
    kinds: Iterable[str] | None = None,
    statuses: Iterable[str] | None = None,
    any_field: Iterable[str] | None = None,
    needs_prior: bool = False,
) -> dict[str, Any]:
    """Rule options for the common condition: all of the given constraints hold."""
    kind_set = frozenset(kinds) if kinds is not None else None
    status_set = frozenset(statuses) if statuses is not None else None
    field_set = frozenset(any_field) if any_field is not None else None

    def when(facts: Facts) -> bool:
        return (
            (kind_set is None or facts.kind in kind_set)
            and (status_set is None or facts.status in status_set)
            and (field_set is None or not field_set.isdisjoint(facts.fields))
            and (facts.has_prior or not needs_prior)
        )

    return {"when": when, "fields": field_set or frozenset()}


def line_rule(rule_id: str, severity: Severity, *, fix: str, seed: bool = False):
    """Register a rule that readers raise; the decorated function only carries its docs."""
    return _register("line", rule_id, severity, fix, seed=seed)


def record_rule(rule_id: str, severity: Severity, *, fix: str, judges_replays: bool = False, **options: Any):
    """Register ``check(record) -> finding`` as a record rule.

    ``options``: ``seed``, ``strict_only``, and ``when``/``fields`` (see :func:`applies_when`).

    A record rule judges how an action executed, so by default it does not judge a
    replayed record (``replayed: true``) of an action its session has seen before: the
    replay executed nothing, and the record it replays was judged already (the same
    finding twice would report one defect as two). A replayed record of an action the
    session has not seen is judged: it is all the session holds of the action.
    ``judges_replays=True`` is for a rule about the record itself, whatever executed.
    """
    if not judges_replays:
        options["fields"] = frozenset(options.get("fields", frozenset())) | {REPLAYED}
    return _register("record", rule_id, severity, fix, judges_replays=judges_replays, **options)


def session_rule(
    rule_id: str,
    severity: Severity,
    *,
    fix: str,
    at_end: Callable[..., Iterable[tuple[Any, str]]] | None = None,
    **options: Any,
):
    """Register ``check(session, record, where, prior) -> finding`` as a session rule."""
    return _register(
        "session",
        rule_id,
        severity,
        fix,
        at_session_end=at_end is not None,
        at_end=at_end,
        **options,
    )
