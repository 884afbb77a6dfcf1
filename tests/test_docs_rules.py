"""``docs/rules.md`` is generated from the catalogue, and the ``rules``/``explain`` commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from durable_sessions.report import RULES_MARKDOWN_COMMAND, explain_markdown, rules_markdown
from durable_sessions.rules import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
RULES_DOC = ROOT / "docs" / "rules.md"
DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
RULE_IDS = [rule.id for rule in CATALOGUE]


def durable_sessions(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DURABLE_SESSIONS), *args], capture_output=True, text=True, encoding="utf-8", timeout=60
    )


@pytest.fixture(scope="module")
def markdown() -> str:
    result = durable_sessions("rules", "--format", "markdown")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_docs_rules_md_is_generated_from_the_catalogue(markdown: str) -> None:
    assert RULES_DOC.is_file(), f"docs/rules.md is missing; generate it with `{RULES_MARKDOWN_COMMAND}`"
    assert RULES_DOC.read_text(encoding="utf-8") == markdown, (
        f"docs/rules.md is out of date with the rule catalogue; regenerate it with `{RULES_MARKDOWN_COMMAND}`"
    )


def test_markdown_is_rules_markdown(markdown: str) -> None:
    assert markdown == rules_markdown()
    assert RULES_MARKDOWN_COMMAND in markdown


def test_markdown_has_a_table_row_for_every_rule(markdown: str) -> None:
    assert "| Rule | Severity | Scope | Seed | Summary |" in markdown
    rows = re.findall(
        r"^\| \[`([a-z-]+)`\]\(#\1\) \| ([^|]+) \| (\w+) \| (yes|no) \| (.+) \|$", markdown, re.M
    )
    assert [row[0] for row in rows] == RULE_IDS
    for (rule_id, severity, scope, seed, summary), rule in zip(rows, CATALOGUE, strict=True):
        assert rule_id == rule.id
        assert severity.split(",")[0] == rule.severity.value
        assert ("`--strict` only" in severity) == rule.strict_only
        assert ("at session end" in severity) == rule.at_session_end
        assert scope == rule.scope
        assert seed == ("yes" if rule.seed else "no")
        assert summary == rule.summary


def test_markdown_holds_every_rule_explanation_in_catalogue_order(markdown: str) -> None:
    positions = []
    for rule in CATALOGUE:
        section = f'<a id="{rule.id}"></a>\n\n{explain_markdown(rule, heading="##")}'
        assert section in markdown, rule.id
        positions.append(markdown.index(section))
    assert positions == sorted(positions)


def test_rules_text_lists_every_rule() -> None:
    result = durable_sessions("rules")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == RULE_IDS
    for line, rule in zip(lines, CATALOGUE, strict=True):
        assert line.split()[1] == rule.severity.value
        assert rule.summary in line
        assert ("[strict]" in line) == rule.strict_only
        assert ("[seed]" in line) == rule.seed
        assert ("[end]" in line) == rule.at_session_end


def test_rules_json_describes_every_rule() -> None:
    result = durable_sessions("rules", "--format", "json")
    assert result.returncode == 0
    rows = json.loads(result.stdout)
    assert [row["id"] for row in rows] == RULE_IDS
    for row, rule in zip(rows, CATALOGUE, strict=True):
        assert row == {
            "id": rule.id,
            "severity": rule.severity.value,
            "scope": rule.scope,
            "summary": rule.summary,
            "fix": rule.fix,
            "seed": rule.seed,
            "strict_only": rule.strict_only,
            "at_session_end": rule.at_session_end,
        }


def test_rules_rejects_an_unknown_format() -> None:
    result = durable_sessions("rules", "--format", "html")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_explain_prints_the_rule_documentation(rule_id: str) -> None:
    rule = CATALOGUE.get(rule_id)
    result = durable_sessions("explain", rule_id)
    assert result.returncode == 0, result.stderr
    assert result.stdout == explain_markdown(rule)
    assert result.stdout.startswith(f"# {rule_id} ({rule.severity.value}")
    for heading in ("## Why is this bad?", "## Example", "## Use instead"):
        assert f"\n{heading}\n" in result.stdout, heading
    assert rule.explanation.why in result.stdout
    assert rule.explanation.example in result.stdout
    assert f"Fix: {rule.fix}." in result.stdout


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_explain_prose_is_wrapped_at_the_margin(rule_id: str) -> None:
    """The 'Why is this bad?' paragraphs are wrapped as the docstrings around them, at 88
    columns at most: re-executed-side-effect's and diverged-result's each had a clause put
    in without rewrapping, a line of 112 and 124 characters in explain and docs/rules.md."""
    too_long = [line for line in CATALOGUE.get(rule_id).explanation.why.splitlines() if len(line) > 88]
    assert too_long == []


def test_explain_an_unknown_rule_exits_2_with_a_clear_message() -> None:
    result = durable_sessions("explain", "no-such-rule")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "unknown rule 'no-such-rule'" in result.stderr
    assert "durable-sessions rules" in result.stderr


# -- the examples `explain` prints are true -------------------------------------------------

# Its example and fix are span attributes, not log lines (examples/rules/ holds a log of it).
SPAN_ONLY_EXAMPLES = {"truncated-result"}


def _example_log(text: str) -> str:
    """The log lines of an explanation section: its code blocks, as one log."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert blocks, "the section holds no code block"
    return "".join(body for _, body in blocks)


def _rules_found(tmp_path: Path, log: str) -> set[str]:
    from durable_sessions.check import check_paths
    from durable_sessions.engine import Checker
    from durable_sessions.rules import select_rules

    path = tmp_path / "example.jsonl"
    path.write_text(log, encoding="utf-8")
    return {
        v.rule for v in check_paths([str(path)], Checker(select_rules("all", strict=True)), fmt="actions")
    }


@pytest.mark.parametrize("rule_id", [r for r in RULE_IDS if r not in SPAN_ONLY_EXAMPLES])
def test_explain_example_breaks_its_rule_and_use_instead_breaks_none(rule_id: str, tmp_path: Path) -> None:
    """What ``durable-sessions explain`` shows under "Example" is reported as the rule (with
    --strict, which dead-end needs), and what it shows under "Use instead" is clean."""
    rule = CATALOGUE.get(rule_id)
    assert rule_id in _rules_found(tmp_path, _example_log(rule.explanation.example))
    assert _rules_found(tmp_path, _example_log(rule.explanation.use_instead)) == set()
