"""Reports: what a check found, as text, JSON or SARIF 2.1.0.

:class:`Summary` folds the violation stream into the per-session verdicts every output
needs; the renderers only format it.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO
from urllib.parse import quote

import orjson

from durable_sessions import __version__
from durable_sessions.rules import CATALOGUE, Rule
from durable_sessions.violation import Severity, Violation

Verdict = Literal["ok", "at_risk", "unrecoverable"]
FailOn = Literal["error", "warning"]
OUTPUT_FORMATS: tuple[str, ...] = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning"}


def verdict_of(severities: Iterable[Severity]) -> Verdict:
    """``unrecoverable`` with any error, ``at_risk`` with only warnings, else ``ok``."""
    worst: Verdict = "ok"
    for severity in severities:
        if severity is Severity.ERROR:
            return "unrecoverable"
        worst = "at_risk"
    return worst


@dataclass
class Summary:
    """Running totals over a violation stream."""

    fail_on: FailOn = "error"
    errors: int = 0
    warnings: int = 0
    by_session: dict[str, list[Violation]] = field(default_factory=dict)

    def add(self, violation: Violation) -> None:
        if violation.severity is Severity.ERROR:
            self.errors += 1
        else:
            self.warnings += 1
        if violation.session_id:  # "" names no session (shown as '?'), nor is it counted as one
            self.by_session.setdefault(violation.session_id, []).append(violation)

    @property
    def total(self) -> int:
        return self.errors + self.warnings

    @property
    def failed(self) -> bool:
        return self.errors > 0 or (self.fail_on == "warning" and self.warnings > 0)

    def verdicts(self) -> dict[str, Verdict]:
        """The verdict of every session that has a violation."""
        return {
            session: verdict_of(v.severity for v in violations)
            for session, violations in self.by_session.items()
        }


def printable(text: str) -> str:
    """``text`` with every character a terminal would not show as itself escaped, as
    ``repr`` escapes it (``\\n``, ``\\x1b``, ``\\u2028``).

    Ids and messages come from the input: raw, a newline in a session id would forge an
    output line of its own and an escape sequence would drive the reader's terminal.
    Lone surrogates (a file name that is not UTF-8) are left to the stream's error handler.
    """
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() or "\ud800" <= char <= "\udfff" else repr(char)[1:-1] for char in text
    )


def table_lines(rows: Sequence[Sequence[str]]) -> Iterator[str]:
    """``rows`` (a header first) as lines of left-aligned columns, two spaces apart, in
    the columns a terminal shows (:func:`columns`)."""
    widths = [max(columns(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        yield "  ".join(
            cell + " " * (width - columns(cell)) for cell, width in zip(row, widths, strict=True)
        ).rstrip()


def columns(text: str) -> int:
    """How many columns a terminal shows ``text`` in: two for a wide character (CJK, most
    emoji), none for a combining one (an accent written after its letter), one for any
    other. Ids are the spans' text: padded by their count of characters, a column after a
    CJK id was shifted."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
        for char in text
    )


def text_line(violation: Violation) -> str:
    """``file:line: severity[rule] session/action: message``, on one line (see :func:`printable`)."""
    where = violation.file or "-"
    if violation.line is not None:
        where = f"{where}:{violation.line}"
    elif violation.span_id is not None:
        where = f"{where} span {violation.span_id}"
    who = f"{violation.session_id or '?'}/{violation.action_id or '?'}"
    return printable(f"{where}: {violation.severity}[{violation.rule}] {who}: {violation.message}")


def write_text_summary(out: TextIO, summary: Summary, actions: int, sessions: int) -> None:
    verdicts = summary.verdicts()
    unrecoverable = [s for s, v in verdicts.items() if v == "unrecoverable"]
    at_risk = [s for s, v in verdicts.items() if v == "at_risk"]
    counts = f"{summary.errors} error(s), {summary.warnings} warning(s)"
    scope = f"{actions} action(s) in {sessions} session(s)"
    if summary.total:
        out.write("\n")
    out.write(f"durable-sessions {'FAIL' if summary.failed else 'OK'}: {counts} in {scope}\n")
    for label, ids in (("unrecoverable", unrecoverable), ("at risk", at_risk)):
        for session_id in ids:
            rules = sorted({v.rule for v in summary.by_session[session_id]})
            out.write(f"  {label}: {printable(session_id)} ({', '.join(rules)})\n")


def json_document(
    violations: list[Violation], summary: Summary, actions: int, sessions: int
) -> dict[str, Any]:
    return {
        "ok": not summary.failed,
        "actions": actions,
        "sessions": sessions,
        "violations": [v.as_dict() for v in violations],
    }


def sarif_document(violations: list[Violation], rules: Iterable[Rule]) -> dict[str, Any]:
    """A SARIF 2.1.0 log with one run, so CI systems can annotate the checked files."""
    rule_list = list(rules)
    index = {rule.id: i for i, rule in enumerate(rule_list)}
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "durable-sessions",
                        "version": __version__,
                        "informationUri": "https://pypi.org/project/durable-sessions/",
                        "rules": [_sarif_rule(rule) for rule in rule_list],
                    }
                },
                "results": [_sarif_result(v, index) for v in violations],
            }
        ],
    }


def _sarif_rule(rule: Rule) -> dict[str, Any]:
    text = rule.explanation
    return {
        "id": rule.id,
        "name": "".join(part.capitalize() for part in rule.id.split("-")),
        "shortDescription": {"text": text.summary},
        "fullDescription": {"text": text.why},
        "help": {"text": f"{rule.fix}.", "markdown": explain_markdown(rule)},
        "defaultConfiguration": {"level": SARIF_LEVEL[rule.severity]},
    }


def _sarif_result(violation: Violation, index: dict[str, int]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "ruleId": violation.rule,
        "level": SARIF_LEVEL[violation.severity],
        "message": {"text": violation.message},
        "partialFingerprints": {"durableSessionsViolation/v1": violation.key},
    }
    if violation.rule in index:
        result["ruleIndex"] = index[violation.rule]
    if violation.file is not None:
        physical: dict[str, Any] = {"artifactLocation": {"uri": artifact_uri(violation.file)}}
        if violation.line is not None:
            physical["region"] = {"startLine": violation.line}
        result["locations"] = [{"physicalLocation": physical}]
    return result


def artifact_uri(path: str) -> str:
    """A SARIF artifact URI for a checked file: a percent-encoded relative reference, or
    a ``file://`` URI for an absolute path."""
    if path.startswith("/"):
        return Path(path).as_uri()
    return quote(path.replace(os.sep, "/"), errors="surrogateescape")  # a name that is not UTF-8: its bytes


def explain_markdown(rule: Rule, heading: str = "#") -> str:
    """A rule's documentation, ruff style: summary, why, example, use instead, fix."""
    text = rule.explanation
    flags = [rule.severity.value]
    if rule.strict_only:
        flags.append("strict only")
    if rule.at_session_end:
        flags.append("checked at session end")
    if rule.seed:
        flags.append("seed checker")
    return (
        f"{heading} {rule.id} ({', '.join(flags)})\n\n"
        f"{text.summary}\n\n"
        f"{heading}# Why is this bad?\n\n{text.why}\n\n"
        f"{heading}# Example\n\n{text.example}\n\n"
        f"{heading}# Use instead\n\n{text.use_instead}\n\n"
        f"Fix: {rule.fix}.\n"
    )


RULES_MARKDOWN_COMMAND = "durable-sessions rules --format markdown > docs/rules.md"


def rules_markdown(rules: Iterable[Rule] = CATALOGUE) -> str:
    """The rule reference, ``docs/rules.md``: a short intro, a table of every rule, then each
    rule's documentation exactly as ``durable-sessions explain`` prints it."""
    rule_list = list(rules)
    rows = "".join(
        f"| [`{rule.id}`](#{rule.id}) | {_severity_cell(rule)} | {rule.scope} | "
        f"{'yes' if rule.seed else 'no'} | {_table_cell(rule.summary)} |\n"
        for rule in rule_list
    )
    sections = "\n".join(
        f'<a id="{rule.id}"></a>\n\n{explain_markdown(rule, heading="##")}' for rule in rule_list
    )
    return (
        "# Rules\n\n"
        f"<!-- Generated from the rule catalogue by `{RULES_MARKDOWN_COMMAND}`. Do not edit by hand. -->\n\n"
        "Every rule durable-sessions checks, with its stable id: the id appears in checker output, "
        "metrics labels and SARIF `ruleId`, and `durable-sessions explain <id>` prints its section below.\n\n"
        "- **Severity**: an `error` makes the session unrecoverable and the check exit 1; a `warning` "
        "puts it at risk and fails only with `--fail-on warning`. Strict-only rules run with "
        "`--strict`; rules checked at session end report once the session is over.\n"
        "- **Scope**: `line` rules are raised while reading a log line, `record` rules judge one "
        "action on its own, `session` rules judge an action against what its session did before.\n"
        "- **Seed**: the rule is part of the seed `replay_check`'s set (`replay-check`, "
        "`durable-sessions check --rules seed`). Both also run `invalid-field` on `kind` and "
        "`status`, which choose the seed rules that apply.\n"
        "- **Replayed records**: a record with `replayed: true` served its outcome from the record "
        "instead of executing. When its session holds the action already, the record rules judge "
        "only its fields (`invalid-field`): what the others judge (a missing result or key, a "
        "retry cap, a cache setting, a dead end, a time-derived key, a cut result) is how the "
        "action executed, reported once, on the record it replays. A replay of an action its "
        "session has not seen is judged by every rule: it is all the session holds of the action, "
        "and the outcome it serves is the recorded one, which a later run executing the action "
        "again, or a replay serving another result, is judged against. "
        "Of the session rules, `replay-mismatch` compares what a replay served with what was "
        "recorded and `unstable-key` its key; the rules about executing again, sharing a key, "
        "failing in a row or escalating do not count it as an execution.\n\n"
        "| Rule | Severity | Scope | Seed | Summary |\n"
        "|---|---|---|---|---|\n"
        f"{rows}\n"
        f"{sections}"
    )


def _severity_cell(rule: Rule) -> str:
    qualifiers = [rule.severity.value]
    if rule.strict_only:
        qualifiers.append("`--strict` only")
    if rule.at_session_end:
        qualifiers.append("at session end")
    return ", ".join(qualifiers)


def _table_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def dump_json(document: dict[str, Any], out: TextIO) -> None:
    """``document`` as ``json.dumps(indent=2, ensure_ascii=False)`` writes it, in a few
    big writes.

    orjson writes the same text (the documents hold strings, integers, booleans and None)
    far faster; ``json.dump`` made one write per token, which a big check felt. What
    orjson refuses (a lone surrogate, an integer beyond 64 bits) goes through ``json``.
    """
    try:
        text = orjson.dumps(document, option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONEncodeError:
        text = json.dumps(document, indent=2, ensure_ascii=False)
    # In pieces: one write of many MB that the kernel cuts short because the reader went
    # away (``| head``) is taken by CPython as done, the rest dropped without an error;
    # the write of the next piece raises BrokenPipeError, as the text output does.
    for start in range(0, len(text), _WRITE_PIECE):
        out.write(text[start : start + _WRITE_PIECE])
    out.write("\n")


_WRITE_PIECE = 1 << 20
