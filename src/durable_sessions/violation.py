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

    @property
    def key(self) -> str:
        where = self.span_id or (f"{self.file}:{self.line}" if self.line is not None else "")
        return f"{self.session_id}|{self.rule}|{self.action_id}|{where}"

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
