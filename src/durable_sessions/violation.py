"""``Violation``: one broken rule at one place, as every output channel reports it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    """``error`` makes a session unrecoverable; ``warning`` puts it at risk."""

    ERROR = "error"
    WARNING = "warning"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Violation:
    """A rule broken by one action (or by one unreadable line).

    ``key`` identifies the violation stably, so a store or an alert channel can fire it
    exactly once however often the same input is checked again.
    """

    rule: str
    severity: Severity
    message: str
    session_id: str | None
    action_id: str | None
    file: str | None = None
    line: int | None = None
    trace_id: str | None = None
    span_id: str | None = None
    kind: str | None = None
    occurrence: int = 0
    """Which of the rule's violations at this place this is, from 0: a span missing two
    required fields breaks ``missing-field`` twice, and each must keep its own key."""

    @property
    def key(self) -> str:
        where = self.span_id or (f"{self.file}:{self.line}" if self.line is not None else "")
        key = f"{self.session_id}|{self.rule}|{self.action_id}|{where}"
        # The first keeps the key it always had, so stores written before stay deduplicated.
        return f"{key}#{self.occurrence}" if self.occurrence else key

    def as_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "session_id": self.session_id,
            "action_id": self.action_id,
            "file": self.file,
            "line": self.line,
            "message": self.message,
        }
