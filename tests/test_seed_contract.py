"""The seed checker's contract (RULES.md), against the installed ``replay-check`` command.

The seed's self-test makes 13 assertions over its two fixtures: good → exit 0; bad → exit
1; the bad output contains each of nine phrases; ``--strict`` adds exactly one violation
(the dead end); a missing file exits 2. They are reproduced here for two fixture sets: the
seed's own (``../shared/seed/durable-sessions/examples`` beside this repository) and the
project's (``examples/logs/actions.{good,bad}.jsonl``), plus the exact output format.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED_EXAMPLES = ROOT.parent / "shared" / "seed" / "durable-sessions" / "examples"
PROJECT_EXAMPLES = ROOT / "examples" / "logs"
REPLAY_CHECK = Path(sys.executable).with_name("replay-check")
DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")

SEED_PHRASES = (
    "already answered",
    "'llm_call' has no recorded result",
    "repeat a real-world effect",
    "without a finite max_attempts",
    "attempts 7 exceeds max_attempts 3",
    "not shareable across sessions",
    "without a positive ttl_s",
    "duplicate action_id",
    "required field 'action_id' missing",
)

VIOLATION_LINE = re.compile(r"^line (?P<line>\d+)(?: \[(?P<action>[^\]]*)\])?: (?P<message>\S.*)$")
FAIL_SUMMARY = re.compile(
    r"^replay-check FAIL: (?P<violations>\d+) violation\(s\) in (?P<actions>\d+) action\(s\)$"
)
OK_SUMMARY = re.compile(r"^replay-check OK: (?P<actions>\d+) action\(s\) replay-safe$")


@dataclass(frozen=True)
class FixtureSet:
    name: str
    good: Path
    bad: Path


@pytest.fixture(params=["seed", "project"])
def fixtures(request: pytest.FixtureRequest) -> FixtureSet:
    if request.param == "seed":
        if not SEED_EXAMPLES.is_dir():
            pytest.skip(
                f"the seed's fixtures are expected in {SEED_EXAMPLES} "
                "(../shared/seed/durable-sessions/examples, next to this repository)"
            )
        directory = SEED_EXAMPLES
    else:
        directory = PROJECT_EXAMPLES
    return FixtureSet(request.param, directory / "actions.good.jsonl", directory / "actions.bad.jsonl")


@cache
def replay_check(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ``replay-check`` (cached: the fixtures do not change during a run)."""
    assert REPLAY_CHECK.exists(), f"the replay-check console script is not installed next to {sys.executable}"
    return subprocess.run(
        [str(REPLAY_CHECK), *args], capture_output=True, text=True, encoding="utf-8", timeout=60
    )


def action_lines(path: Path) -> dict[int, dict]:
    """The records of a fixture by line number (blank and ``#`` lines are not actions)."""
    records = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.strip()
        if text and not text.startswith("#"):
            records[number] = json.loads(text)
    return records


def violation_lines(stdout: str) -> list[re.Match[str]]:
    """The violation lines of a FAIL output, checking the blank line and the summary after them."""
    lines = stdout.split("\n")
    assert lines[-1] == "", "the output must end with a newline"
    *body, blank, summary, _ = lines
    assert blank == "", f"a blank line must separate violations from the summary:\n{stdout}"
    assert FAIL_SUMMARY.match(summary), f"unexpected summary line {summary!r}"
    matches = [VIOLATION_LINE.match(line) for line in body]
    bad = [line for line, match in zip(body, matches, strict=True) if match is None]
    assert not bad, f"lines not in the 'line N [action_id]: message' format: {bad}"
    return matches  # type: ignore[return-value]


def dead_ends(records: dict[int, dict]) -> list[int]:
    """Lines of records that fail, are not retryable and give no on_failure."""
    return [
        number
        for number, record in records.items()
        if record.get("status") == "error"
        and record.get("retryable") is not True
        and not record.get("on_failure")
    ]


# -- the seed self-test's 13 assertions ------------------------------------------------


def test_good_fixture_exits_0(fixtures: FixtureSet) -> None:
    result = replay_check("--actions", str(fixtures.good))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"replay-check OK: {len(action_lines(fixtures.good))} action(s) replay-safe\n"
    assert result.stderr == ""


def test_bad_fixture_exits_1(fixtures: FixtureSet) -> None:
    result = replay_check("--actions", str(fixtures.bad))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "replay-check FAIL" in result.stdout


@pytest.mark.parametrize("phrase", SEED_PHRASES)
def test_bad_fixture_output_names_the_problem(fixtures: FixtureSet, phrase: str) -> None:
    result = replay_check("--actions", str(fixtures.bad))
    assert phrase in result.stdout, f"{phrase!r} not in the output for {fixtures.bad}:\n{result.stdout}"


def test_strict_adds_exactly_the_dead_end(fixtures: FixtureSet) -> None:
    plain = replay_check("--actions", str(fixtures.bad))
    strict = replay_check("--actions", str(fixtures.bad), "--strict")
    assert strict.returncode == 1
    plain_count = int(FAIL_SUMMARY.match(plain.stdout.splitlines()[-1])["violations"])
    strict_count = int(FAIL_SUMMARY.match(strict.stdout.splitlines()[-1])["violations"])
    assert strict_count == plain_count + 1
    added = sorted(set(strict.stdout.splitlines()) - set(plain.stdout.splitlines()))
    added = [line for line in added if VIOLATION_LINE.match(line)]
    assert len(added) == 1, added
    [dead_end_line] = dead_ends(action_lines(fixtures.bad))
    assert VIOLATION_LINE.match(added[0])["line"] == str(dead_end_line)
    assert "on_failure" in added[0]


def test_missing_file_exits_2(fixtures: FixtureSet, tmp_path: Path) -> None:
    missing = tmp_path / fixtures.bad.name
    result = replay_check("--actions", str(missing))
    assert result.returncode == 2
    assert "replay-check OK" not in result.stdout
    assert str(missing) in result.stderr


# -- the output format -------------------------------------------------------------------


def test_bad_output_is_one_line_per_violation_then_blank_line_then_summary(fixtures: FixtureSet) -> None:
    result = replay_check("--actions", str(fixtures.bad))
    records = action_lines(fixtures.bad)
    matches = violation_lines(result.stdout)
    summary = FAIL_SUMMARY.match(result.stdout.splitlines()[-1])
    assert int(summary["violations"]) == len(matches)
    assert int(summary["actions"]) == len(records)
    for match in matches:
        record = records[int(match["line"])]
        if isinstance(record.get("action_id"), str):
            assert match["action"] == record["action_id"], match.group()


def test_every_failing_line_of_the_bad_fixture_is_reported(fixtures: FixtureSet) -> None:
    """With --strict each line marked ``_fails_because`` has a violation, and nothing else has."""
    result = replay_check("--actions", str(fixtures.bad), "--strict")
    reported = {int(match["line"]) for match in violation_lines(result.stdout)}
    marked = {number for number, record in action_lines(fixtures.bad).items() if "_fails_because" in record}
    assert reported == marked


def test_violations_are_reported_in_line_order(fixtures: FixtureSet) -> None:
    result = replay_check("--actions", str(fixtures.bad), "--strict")
    numbers = [int(match["line"]) for match in violation_lines(result.stdout)]
    assert numbers == sorted(numbers)


def test_quiet_prints_the_summary_only(fixtures: FixtureSet) -> None:
    full = replay_check("--actions", str(fixtures.bad))
    quiet = replay_check("--actions", str(fixtures.bad), "--quiet")
    assert quiet.returncode == 1
    assert quiet.stdout == full.stdout.splitlines()[-1] + "\n"
    assert FAIL_SUMMARY.match(quiet.stdout.rstrip("\n"))
    good = replay_check("--actions", str(fixtures.good), "--quiet")
    assert good.returncode == 0
    assert OK_SUMMARY.match(good.stdout.rstrip("\n")) and good.stdout.count("\n") == 1


def test_quiet_strict_counts_the_dead_end(fixtures: FixtureSet) -> None:
    plain = replay_check("--actions", str(fixtures.bad), "--quiet")
    strict = replay_check("--actions", str(fixtures.bad), "--quiet", "--strict")
    count = int(FAIL_SUMMARY.match(plain.stdout.rstrip("\n"))["violations"])
    assert int(FAIL_SUMMARY.match(strict.stdout.rstrip("\n"))["violations"]) == count + 1


def test_good_fixture_is_clean_under_strict(fixtures: FixtureSet) -> None:
    result = replay_check("--actions", str(fixtures.good), "--strict")
    assert result.returncode == 0, result.stdout
    assert OK_SUMMARY.match(result.stdout.rstrip("\n"))


def test_project_fixtures_differ_from_the_seeds() -> None:
    """The project's pair is its own: no line is copied from the seed's fixtures."""
    if not SEED_EXAMPLES.is_dir():
        pytest.skip(f"the seed's fixtures are expected in {SEED_EXAMPLES}")
    for name in ("actions.good.jsonl", "actions.bad.jsonl"):
        seed_lines = set((SEED_EXAMPLES / name).read_text(encoding="utf-8").splitlines())
        ours = (PROJECT_EXAMPLES / name).read_text(encoding="utf-8").splitlines()
        assert not seed_lines.intersection(line for line in ours if line.strip()), name


def test_missing_actions_option_is_a_usage_error() -> None:
    result = replay_check()
    assert result.returncode == 2
    assert "--actions" in result.stderr


def test_a_directory_is_unreadable_input(tmp_path: Path) -> None:
    result = replay_check("--actions", str(tmp_path))
    assert result.returncode == 2
    assert "replay-check OK" not in result.stdout


def test_a_trace_file_gets_a_hint_on_standard_error_and_the_seeds_output(tmp_path: Path) -> None:
    """Each line of a trace file is an action with every required field missing: the seed's
    output stays as it was, and standard error says what reads such a file."""
    tracing = Path(__file__).parent / "data" / "tracing-demo-run-001.jsonl"
    otlp = tmp_path / "spans.jsonl"
    otlp.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": []}]}]}) + "\n")
    for path, what in ((tracing, "a tracing log"), (otlp, "an OTLP/JSON trace file")):
        completed = subprocess.run(
            [str(REPLAY_CHECK), "--actions", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.stderr.startswith(f"replay-check: {str(path)!r} looks like {what}"), completed.stderr
        assert "`durable-sessions check" in completed.stderr
    actions = Path(__file__).parents[1] / "examples" / "logs" / "actions.good.jsonl"
    clean = subprocess.run(
        [str(REPLAY_CHECK), "--actions", str(actions)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (clean.returncode, clean.stderr) == (0, "")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_an_action_log_read_from_a_fifo_is_checked_whole(fixtures: FixtureSet, tmp_path: Path) -> None:
    """``--actions <(zcat bad.jsonl.gz)`` and named pipes can be read once. The look for a
    trace file took the first block of the pipe and threw it away, so the check read
    nothing and passed the bad log: ``replay-check OK: 0 action(s) replay-safe``, exit 0."""
    expected = replay_check("--actions", str(fixtures.bad))
    fifo = tmp_path / "actions.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(fixtures.bad.read_bytes()), daemon=True)
    writer.start()
    try:
        result = replay_check("--actions", str(fifo))
    finally:
        writer.join(timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (1, expected.stdout, "")


KIND_OR_STATUS_SPELT_OTHERWISE = [
    {"session_id": "s-1", "action_id": "a1", "kind": "Payment", "status": "ok", "result": {}},
    {"session_id": "s-1", "action_id": "a2", "kind": "user-prompt", "status": "ok"},
    {"session_id": "s-1", "action_id": "a3", "kind": "payment", "status": "OK"},
    {"session_id": "s-1", "action_id": "a4", "kind": "tool_call", "status": "ok", "ts": "yesterday"},
]


def spelt_otherwise_log(tmp_path: Path) -> Path:
    """An action log of :data:`KIND_OR_STATUS_SPELT_OTHERWISE`."""
    log = tmp_path / "spelt.jsonl"
    log.write_text(
        "".join(json.dumps(record) + "\n" for record in KIND_OR_STATUS_SPELT_OTHERWISE), encoding="utf-8"
    )
    return log


def test_a_known_kind_or_status_spelt_otherwise_fails_replay_check(tmp_path: Path) -> None:
    """Every seed rule dispatches on ``kind`` and ``status``, read literally: an unkeyed
    ``Payment``, an unanswered ``user-prompt`` and a ``status: "OK"`` payment passed as
    replay-safe (exit 0) where ``durable-sessions check`` reports them as invalid-field.
    "Exit 0 when every action is replay-safe": they are reported, as check words them.
    Fields the seed never defined (``ts``) stay the full check's to judge."""
    result = replay_check("--actions", str(spelt_otherwise_log(tmp_path)))
    assert result.returncode == 1, result.stdout
    assert [
        (match["line"], match["action"], match["message"]) for match in violation_lines(result.stdout)
    ] == [
        ("1", "a1", "kind is the string 'Payment', expected 'payment' — the rules cannot rely on it"),
        ("2", "a2", "kind is the string 'user-prompt', expected 'user_prompt' — the rules cannot rely on it"),
        (
            "3",
            "a3",
            "status is the string 'OK', expected one of ok, error, started — the rules cannot rely on it",
        ),
    ]
    assert result.stdout.endswith("replay-check FAIL: 3 violation(s) in 4 action(s)\n")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_check_with_the_seed_rules_finds_what_replay_check_finds(tmp_path: Path, jobs: str) -> None:
    """``durable-sessions check --rules seed`` is the seed's rule set, as ``replay-check``
    runs it: it passed a ``Payment``, a ``user-prompt`` and a status ``OK`` that
    replay-check reports, and a parallel worker, rebuilding its rules from their ids, would
    have judged every field ``invalid-field`` judges (the ``ts``) had it been given them."""
    log = spelt_otherwise_log(tmp_path)
    expected = [
        (int(match["line"]), match["message"])
        for match in violation_lines(replay_check("--actions", str(log)).stdout)
    ]
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--rules", "seed", "--format", "json", "--jobs", jobs, str(log)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
    )
    found = [
        (violation["line"], violation["message"]) for violation in json.loads(result.stdout)["violations"]
    ]
    assert (result.returncode, found) == (1, expected), result.stderr
