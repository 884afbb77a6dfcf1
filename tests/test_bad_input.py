"""Bad input never crashes the installed checkers: a clear message, the right exit code.

Every test runs the real ``durable-sessions check`` and ``replay-check`` commands as
subprocesses on files written to ``tmp_path``. The contract under test:

- never a Python traceback on stderr;
- a line that holds no record is a violation ``file:line`` with rule ``unreadable-line``
  (exit 1), and the valid lines around it are still checked;
- a source that cannot be opened or read at all exits 2 with a message naming it;
- an input with no actions exits 0 with a warning on stderr.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from durable_sessions import readers

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
REPLAY_CHECK = Path(sys.executable).with_name("replay-check")

TEXT_LINE = re.compile(
    r"^(?P<file>.+?):(?P<line>\d+): (?P<severity>error|warning)\[(?P<rule>[a-z-]+)\] "
    r"(?P<session>\S+)/(?P<action>\S+): (?P<message>.*)$"
)
SEED_LINE = re.compile(r"^line (?P<line>\d+) \[(?P<action>[^\]]*)\]: (?P<message>.*)$")


@dataclass
class Found:
    """One violation as printed by either CLI."""

    line: int
    rule: str | None  # replay-check does not print rule ids
    action: str
    message: str
    file: str | None


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    found: list[Found]

    def at(self, line: int) -> list[Found]:
        return [f for f in self.found if f.line == line]

    def rules_at(self, line: int) -> set[str | None]:
        return {f.rule for f in self.at(line)}


def _run(argv: list[str], stdin: bytes | None = None) -> Run:
    completed = subprocess.run(argv, input=stdin, capture_output=True, timeout=300, check=False)
    stdout = completed.stdout.decode("utf-8", "replace")
    stderr = completed.stderr.decode("utf-8", "replace")
    assert "Traceback" not in stderr, f"{argv[0]} crashed:\n{stderr}"
    found = []
    for text in stdout.splitlines():
        if m := TEXT_LINE.match(text):
            found.append(
                Found(int(m["line"]), m["rule"], m["action"], m["message"], m["file"]),
            )
        elif m := SEED_LINE.match(text):
            found.append(Found(int(m["line"]), None, m["action"], m["message"], None))
    return Run(completed.returncode, stdout, stderr, found)


def check(*args: str | Path, stdin: bytes | None = None) -> Run:
    """``durable-sessions check ARGS`` (text output)."""
    return _run([str(DURABLE_SESSIONS), "check", *map(str, args)], stdin)


def replay_check(path: str | Path, *args: str, stdin: bytes | None = None) -> Run:
    """``replay-check --actions PATH ARGS``."""
    return _run([str(REPLAY_CHECK), "--actions", str(path), *args], stdin)


def record(action_id: str, kind: str = "payment", status: str = "ok", **fields: object) -> bytes:
    """One JSONL record line (without its newline)."""
    obj = {"session_id": "s-1", "action_id": action_id, "kind": kind, "status": status, **fields}
    return json.dumps(obj).encode()


# Two lines that each break a rule on their own: an unkeyed payment.
BEFORE = record("a1")
AFTER = record("a3")
UNKEYED = "side-effecting kind 'payment' has no idempotency_key"


def sandwich(tmp_path: Path, middle: bytes, name: str = "log.jsonl") -> Path:
    """A log whose line 2 is ``middle``, between two violating records."""
    path = tmp_path / name
    path.write_bytes(BEFORE + b"\n" + middle + b"\n" + AFTER + b"\n")
    return path


def assert_sandwich_checked(run: Run, path: Path, *, line2_rule: str | None, line2_message: str) -> None:
    """Lines 1 and 3 still reported, line 2 reported as expected, exit 1."""
    assert run.returncode == 1, run.stdout + run.stderr
    for line in (1, 3):
        hits = run.at(line)
        assert hits, f"line {line} was not checked:\n{run.stdout}"
        assert any(UNKEYED in h.message for h in hits), run.stdout
    line2 = run.at(2)
    assert line2, f"line 2 was not reported:\n{run.stdout}"
    assert any(line2_message in h.message for h in line2), run.stdout
    if line2_rule is not None:
        assert line2_rule in run.rules_at(2), run.stdout
    for hit in run.found:
        if hit.file is not None:
            assert hit.file == str(path)


# -- one bad line between two good ones: both CLIs --------------------------------------

random_junk = random.Random(20260705).randbytes(4096).replace(b"\n", b"\x00")
assert b"\x00" in random_junk

BAD_LINES = {
    "invalid-utf8": (
        b'{"session_id":"s-1","action_id":"a2\xff\xfe","kind":"payment","status":"ok"}',
        "line is not valid UTF-8 (byte 0xff at column 36)",
    ),
    "binary-junk-with-nul": (b"\x00" + random_junk, "not valid"),
    "truncated-object": (b'{"session_id":"s-1","action_id":"a2",', "line is not valid JSON"),
    "nan-literal": (record("a2", x=0).replace(b"0}", b"NaN}"), "line is not valid JSON"),
    "infinity-literal": (record("a2", x=0).replace(b"0}", b"Infinity}"), "line is not valid JSON"),
    "minus-infinity-literal": (record("a2", x=0).replace(b"0}", b"-Infinity}"), "line is not valid JSON"),
    "deep-array": (b"[" * 100_000, "line is JSON nested too deeply to read"),
    "deep-object": (b'{"a":' * 100_000, "line is JSON nested too deeply to read"),
    "json-array": (b'[{"session_id":"s-1"}]', "line is a JSON array, not a JSON object"),
    "json-string": (b'"hello"', "line is a JSON string, not a JSON object"),
    "json-null": (b"null", "line is JSON null, not a JSON object"),
    "json-number": (b"42", "line is a JSON number, not a JSON object"),
    "json-boolean": (b"true", "line is a JSON boolean, not a JSON object"),
}


BAD_LINE_CASES = [pytest.param(case, id=case) for case in BAD_LINES]


@pytest.mark.parametrize("case", BAD_LINE_CASES)
def test_bad_line_is_reported_and_neighbours_still_checked(tmp_path: Path, case: str) -> None:
    middle, message = BAD_LINES[case]
    path = sandwich(tmp_path, middle)
    run = check(path)
    assert_sandwich_checked(run, path, line2_rule="unreadable-line", line2_message=message)
    assert f"{path}:2: error[unreadable-line] ?/?: " in run.stdout
    assert "durable-sessions FAIL: 3 error(s)" in run.stdout


@pytest.mark.parametrize("case", BAD_LINE_CASES)
def test_bad_line_under_replay_check(tmp_path: Path, case: str) -> None:
    middle, message = BAD_LINES[case]
    path = sandwich(tmp_path, middle)
    run = replay_check(path)
    assert_sandwich_checked(run, path, line2_rule=None, line2_message=message)
    assert run.at(2)[0].action == "?"
    assert "replay-check FAIL: 3 violation(s) in 3 action(s)" in run.stdout


def test_invalid_utf8_names_the_byte_and_column(tmp_path: Path) -> None:
    middle = BAD_LINES["invalid-utf8"][0]
    column = middle.index(b"\xff") + 1
    run = check(sandwich(tmp_path, middle))
    assert f"byte 0xff at column {column})" in run.at(2)[0].message


def test_file_of_binary_junk(tmp_path: Path) -> None:
    """Random bytes with NULs and newlines: every non-blank line unreadable, in order."""
    data = random.Random(7).randbytes(64 * 1024)
    assert b"\x00" in data and b"\n" in data
    path = tmp_path / "junk.bin"
    path.write_bytes(data)
    expected = [
        number
        for number, line in enumerate(data.split(b"\n"), start=1)
        if line.strip() and not line.strip().startswith(b"#")
    ]
    run = check(path)
    assert run.returncode == 1
    assert [f.line for f in run.found] == expected
    assert {f.rule for f in run.found} == {"unreadable-line"}
    seed = replay_check(path)
    assert seed.returncode == 1
    assert [f.line for f in seed.found] == expected
    assert f"replay-check FAIL: {len(expected)} violation(s) in {len(expected)} action(s)" in seed.stdout


# -- size limits ----------------------------------------------------------------------


def test_fifty_megabyte_line_is_checked_normally(tmp_path: Path) -> None:
    big = record("a2", result="x" * 50_000_000)
    assert len(big) > 50_000_000
    path = sandwich(tmp_path, big)
    run = check(path)
    assert_sandwich_checked(run, path, line2_rule="unkeyed-side-effect", line2_message=UNKEYED)
    assert run.at(2)[0].action == "a2"
    assert "unreadable-line" not in run.stdout


def test_line_over_max_line_bytes_is_unreadable_and_next_line_read(tmp_path: Path) -> None:
    long = record("a2", pad="x" * 500)
    path = sandwich(tmp_path, long)
    run = check("--max-line-bytes", "200", path)
    assert_sandwich_checked(
        run, path, line2_rule="unreadable-line", line2_message="line is longer than 200 bytes"
    )
    # Without the limit the same line is an ordinary record.
    assert check(path).rules_at(2) == {"unkeyed-side-effect"}


def test_max_line_bytes_boundary(tmp_path: Path) -> None:
    """A line of exactly N bytes (before its newline) is read; N + 1 is not.

    Regression: a valid record of exactly N bytes was once reported longer than N.
    """
    exact = record("a1", pad="")
    limit = len(exact)
    over = record("a2", pad="x")
    assert len(over) == limit + 1
    path = tmp_path / "edge.jsonl"
    path.write_bytes(exact + b"\n" + over + b"\n" + record("a3") + b"\n")
    run = check("--max-line-bytes", str(limit), path)
    assert run.rules_at(1) == {"unkeyed-side-effect"}
    assert run.rules_at(2) == {"unreadable-line"}
    assert run.rules_at(3) == {"unkeyed-side-effect"}


def test_line_over_the_limit_is_rejected_at_every_length(tmp_path: Path) -> None:
    """Lines one byte, and far, over the limit are unreadable whether or not they are JSON."""
    exact = record("a1", pad="")
    limit = len(exact) - 1
    path = tmp_path / "over.jsonl"
    path.write_bytes(exact + b"\n" + b"{" * (limit + 1) + b"\n" + record("a3", pad="x" * 5000) + b"\n")
    run = check("--max-line-bytes", str(limit), path)
    assert [(f.line, f.rule) for f in run.found] == [(n, "unreadable-line") for n in (1, 2, 3)]


def test_over_long_line_is_consumed_whole(tmp_path: Path) -> None:
    """The rest of an over-long line is never read as a line of its own.

    Regression: when the first N + 1 bytes of the line parsed as JSON, the rest was read
    as the next line (a phantom record) and every later line number was off by one.
    """
    limit = 80
    ghost = record("ghost")
    assert len(ghost) < limit
    line1 = b'{"k":1}' + b" " * (limit + 1 - 7) + ghost
    path = tmp_path / "over.jsonl"
    path.write_bytes(line1 + b"\n" + record("a2") + b"\n")
    assert len(record("a2")) <= limit
    run = check("--max-line-bytes", str(limit), path)
    assert [(f.line, f.rule, f.action) for f in run.found] == [
        (1, "unreadable-line", "?"),
        (2, "unkeyed-side-effect", "a2"),
    ]
    assert "ghost" not in {f.action for f in run.found}
    # The same with a record exactly one byte over the limit: line 2 keeps its number.
    exact = record("a1", pad="")
    path.write_bytes(exact + b"\n" + b"{" + b"\n")
    run = check("--max-line-bytes", str(len(exact) - 1), path)
    assert [(f.line, f.rule) for f in run.found] == [(1, "unreadable-line"), (2, "unreadable-line")]


def test_over_long_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "tail.jsonl"
    path.write_bytes(BEFORE + b"\n" + record("a2", pad="x" * 300))
    run = check("--max-line-bytes", "100", path)
    assert run.rules_at(1) == {"unkeyed-side-effect"}
    assert run.rules_at(2) == {"unreadable-line"}
    assert run.returncode == 1


# -- numbers JSON allows but floats do not ---------------------------------------------


def test_huge_exponents_are_not_caps(tmp_path: Path) -> None:
    path = tmp_path / "exp.jsonl"
    path.write_bytes(
        b'{"session_id":"s-1","action_id":"a1","kind":"tool_call","status":"error","retryable":true,'
        b'"max_attempts":1e999}\n'
        b'{"session_id":"s-1","action_id":"a2","kind":"tool_call","status":"error","retryable":true,'
        b'"max_attempts":-1e999}\n'
        b'{"session_id":"s-1","action_id":"a3","kind":"external_read","status":"ok","result":{},'
        b'"cacheable":true,"cache_key":"k","ttl_s":1e999}\n'
    )
    run = check(path)
    assert run.returncode == 1
    assert run.rules_at(1) == {"unbounded-retry"}
    assert "max_attempts is the non-finite number inf" in run.at(1)[0].message
    assert run.rules_at(2) == {"unbounded-retry"}
    assert "max_attempts is the non-finite number -inf" in run.at(2)[0].message
    assert run.rules_at(3) == {"cache-without-ttl"}
    seed = replay_check(path)
    assert seed.returncode == 1
    assert "without a finite max_attempts" in seed.at(1)[0].message


def test_forty_digit_integer_does_not_crash(tmp_path: Path) -> None:
    forty = "1" + "0" * 39
    path = tmp_path / "big.jsonl"
    path.write_bytes(
        b'{"session_id":"s-1","action_id":"a1","kind":"tool_call","status":"error","retryable":true,'
        b'"max_attempts":3,"attempts":' + forty.encode() + b"}\n" + AFTER + b"\n"
    )
    run = check(path)
    assert run.returncode == 1
    assert run.at(1), "the record with the big integer was not checked"
    assert run.rules_at(2) == {"unkeyed-side-effect"}
    assert replay_check(path).returncode == 1


def test_an_integer_beyond_python_s_digit_limit_is_reported_as_such_not_as_not_json(tmp_path: Path) -> None:
    """5,000 digits is JSON, but more than Python reads (4,300 by default): the line was
    "not valid JSON (number is infinity when parsed as double ...)", orjson's words, which
    sends the reader hunting for a syntax error that is not there."""
    path = tmp_path / "huge.jsonl"
    path.write_bytes(
        record("a1", kind="llm_call", result=0).replace(b"0}", b"1" * 5000 + b"}") + b"\n" + AFTER
    )
    run = check(path)
    assert [(f.line, f.rule) for f in run.found] == [(1, "unreadable-line"), (2, "unkeyed-side-effect")]
    assert run.at(1)[0].message.startswith(
        "line holds an integer of more than 4300 digits, the most Python reads (PYTHONINTMAXSTRDIGITS raises that)"
    )
    unlimited = subprocess.run(
        [str(DURABLE_SESSIONS), "check", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONINTMAXSTRDIGITS": "0"},
        check=False,
    )
    assert ":1:" not in unlimited.stdout and ":2: error[unkeyed-side-effect]" in unlimited.stdout


def test_forty_digit_integer_is_reported_not_silently_accepted(tmp_path: Path) -> None:
    """Integers beyond 64 bits are read exactly (docs/readers.md), not as the fast JSON
    parser's floating-point numbers: a 40-digit ``attempts`` is an integer, over the cap."""
    forty = "1" + "0" * 39
    path = tmp_path / "big.jsonl"
    path.write_bytes(
        b'{"session_id":"s-1","action_id":"a1","kind":"tool_call","status":"error","retryable":true,'
        b'"max_attempts":3,"attempts":' + forty.encode() + b"}\n"
    )
    run = check(path)
    assert run.returncode == 1
    assert run.rules_at(1) == {"retry-overrun", "retry-not-escalated"}
    assert any(f"attempts {forty} exceeds max_attempts 3" in v.message for v in run.at(1))


def test_big_integer_result_is_recorded(tmp_path: Path) -> None:
    """A 400-digit integer (beyond any float) as a recorded result is still a result."""
    path = tmp_path / "result.jsonl"
    path.write_bytes(
        b'{"session_id":"s-1","action_id":"a1","kind":"llm_call","status":"ok","result":'
        + b"9" * 400
        + b"}\n"
    )
    run = check(path)
    assert run.returncode == 0, run.stdout
    assert "durable-sessions OK: 0 error(s), 0 warning(s) in 1 action(s) in 1 session(s)" in run.stdout


def test_huge_integer_timestamp_does_not_crash(tmp_path: Path) -> None:
    """A 400-digit ts (beyond float range) once raised OverflowError. It is no epoch
    seconds either: an invalid-field, which no rule reads as a time."""
    keyed = b',"idempotency_key":"pay-s-1-a1","ts":' + b"9" * 400 + b"}"
    path = tmp_path / "ts.jsonl"
    path.write_bytes(
        BEFORE[:-1] + b',"ts":' + b"9" * 400 + b"}\n"
        + record("a2", status="started")[:-1] + keyed + b"\n"
        + record("a2")[:-1] + keyed + b"\n"
    )  # fmt: skip
    run = check(path)
    assert run.returncode == 1
    assert run.rules_at(1) == {"unkeyed-side-effect", "invalid-field"}
    assert run.rules_at(2) == run.rules_at(3) == {"invalid-field"}
    assert "ts is an integer of about 40" in run.at(2)[0].message  # 400 digits, "about 401"


# -- wrong field types -------------------------------------------------------------------


def test_session_id_as_number_is_a_missing_field(tmp_path: Path) -> None:
    path = sandwich(tmp_path, b'{"session_id":5,"action_id":"a2","kind":"payment","status":"ok"}')
    run = check(path)
    assert_sandwich_checked(
        run,
        path,
        line2_rule="missing-field",
        line2_message="required field 'session_id' is the integer 5, expected a non-empty string",
    )
    assert run.at(2)[0].action == "a2"
    seed = replay_check(path)
    assert "required field 'session_id' is the integer 5" in seed.at(2)[0].message


def test_retryable_yes_is_an_invalid_field(tmp_path: Path) -> None:
    path = sandwich(tmp_path, record("a2", kind="tool_call", status="error", retryable="yes"))
    run = check(path)
    assert_sandwich_checked(
        run,
        path,
        line2_rule="invalid-field",
        line2_message="retryable is the string 'yes', expected true or false",
    )


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("on_failure", "on_failure is a list, expected ask_user, abort or compensate"),
        ("prompt_digest", "prompt_digest is a list, expected a string"),
    ],
    ids=["on_failure-list", "prompt_digest-list"],
)
def test_unhashable_field_values_are_invalid_fields(tmp_path: Path, field: str, message: str) -> None:
    """A list where a string belongs once raised TypeError (unhashable) in the rules."""
    middle = record("a2", kind="user_prompt", status="ok", result={"answer": 1}, **{field: ["x"]})
    path = sandwich(tmp_path, middle + b"\n" + middle.replace(b'"a2"', b'"a2b"'))
    run = check(path)
    assert run.returncode == 1
    assert run.rules_at(1) == {"unkeyed-side-effect"}
    assert run.rules_at(2) == {"invalid-field"}
    assert message in run.at(2)[0].message
    assert run.rules_at(4) == {"unkeyed-side-effect"}


def test_lone_surrogate_escape_does_not_crash(tmp_path: Path) -> None:
    """A \\ud800 escape is JSON but not Unicode; printing it once raised UnicodeEncodeError."""
    path = sandwich(tmp_path, b'{"session_id":"s-\\ud800","action_id":"a2","kind":"payment","status":"ok"}')
    run = check(path)
    assert_sandwich_checked(run, path, line2_rule="unreadable-line", line2_message="surrogate")
    assert json.loads(check("--format", "json", path).stdout)["actions"] == 3
    seed = replay_check(path)
    assert seed.returncode == 1
    assert [f.line for f in seed.found] == [1, 2, 3]


DEEP = b"[" * 1000 + b"]" * 1000
"""Nested past Python's recursion limit, within the readers' 1,024 levels."""


@pytest.mark.parametrize("native", ["true", "false"])
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_result_nested_a_thousand_deep_is_digested_and_the_next_line_checked(
    tmp_path: Path, native: str, jobs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Digesting it once raised RecursionError: a traceback, exit 1, later lines unchecked."""
    monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", native)
    deep = record("a2", kind="llm_call").replace(b'"status": "ok"', b'"status": "ok", "result": ' + DEEP)
    replayed = deep.replace(b'"result"', b'"replayed": true, "incarnation": "r2", "result"')
    changed = replayed.replace(b"]" * 1000, b"1" + b"]" * 1000)
    path = sandwich(tmp_path, deep + b"\n" + replayed + b"\n" + changed)
    run = check("--jobs", jobs, path)
    assert run.returncode == 1, run.stderr
    assert run.rules_at(1) == {"unkeyed-side-effect"} and run.rules_at(5) == {"unkeyed-side-effect"}
    assert run.rules_at(3) == set()  # the same deep value replayed: the same digest
    assert run.rules_at(4) == {"replay-mismatch"}  # one more level's content: another digest
    seed = replay_check(path)
    assert seed.returncode == 1 and [f.line for f in seed.found] == [1, 5]  # the seed's rules


@pytest.mark.parametrize("field", ["incarnation", "idempotency_key"])
def test_a_field_nested_a_thousand_deep_is_described_in_messages(tmp_path: Path, field: str) -> None:
    """A message once showed such a value with ``repr``, which raised RecursionError."""
    first = record("a2", idempotency_key="k1", incarnation="r1")
    again = record("a2", idempotency_key="k1", incarnation="r2")
    again = again.replace(
        json.dumps({field: "k1" if field == "idempotency_key" else "r2"})[1:-1].encode(),
        f'"{field}": '.encode() + DEEP,
    )
    run = check(sandwich(tmp_path, first + b"\n" + again))
    assert run.returncode == 1, run.stderr
    assert "invalid-field" in run.rules_at(3)
    assert any("a list" in f.message for f in run.at(3) if f.rule != "invalid-field")


# -- empty and comment-only inputs --------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"", b"\n\n   \n", b"# only a comment\n  # indented comment\n\n#\n"],
    ids=["empty", "blank-lines", "comments-only"],
)
def test_input_without_actions(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "nothing.jsonl"
    path.write_bytes(content)
    run = check(path)
    assert run.returncode == 0
    assert "durable-sessions OK: 0 error(s), 0 warning(s) in 0 action(s) in 0 session(s)" in run.stdout
    assert "no actions" in run.stderr
    seed = replay_check(path)
    assert seed.returncode == 0
    assert seed.stdout == "replay-check OK: 0 action(s) replay-safe\n"


def test_comment_lines_keep_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "commented.jsonl"
    path.write_bytes(b"# header\n\n" + BEFORE + b"\n   # note\n" + AFTER + b"\n")
    run = check(path)
    assert [f.line for f in run.found] == [3, 5]


# -- sources that cannot be read ----------------------------------------------------------


def assert_unreadable(path: Path, reason: str) -> None:
    """``check`` and ``replay-check`` both exit 2 naming ``path`` (``check`` with ``reason``)."""
    run = check(path)
    assert run.returncode == 2
    assert str(path) in run.stderr
    assert reason in run.stderr
    seed = replay_check(path)
    assert seed.returncode == 2
    assert str(path) in seed.stderr


def test_directory_exits_2_naming_it(tmp_path: Path) -> None:
    assert_unreadable(tmp_path, "Is a directory")


def test_missing_file_exits_2(tmp_path: Path) -> None:
    assert_unreadable(tmp_path / "nope.jsonl", "No such file or directory")


def test_missing_second_file_exits_2_even_after_violations(tmp_path: Path) -> None:
    first = sandwich(tmp_path, record("a2"))
    missing = tmp_path / "nope.jsonl"
    run = check(first, missing)
    assert run.returncode == 2
    assert str(missing) in run.stderr


WRITE_ONLY_FOR_ROOT = Path("/proc/sys/vm/compact_memory")  # mode 0200: even root may not read it


def test_unreadable_file_by_permissions(tmp_path: Path) -> None:
    """Permission denied: chmod 000 for an ordinary user; as root (CI), a sysctl file whose
    mode denies reading to everyone, root included."""
    if os.geteuid() == 0:
        path = WRITE_ONLY_FOR_ROOT
    else:
        path = sandwich(tmp_path, record("a2"))
        path.chmod(0)
    try:
        run = check(path)
        assert run.returncode == 2
        assert str(path) in run.stderr
        assert "Permission denied" in run.stderr
        assert replay_check(path).returncode == 2
    finally:
        if path != WRITE_ONLY_FOR_ROOT:
            path.chmod(0o600)


# /proc/self/mem opens fine but reading its offset 0 fails with EIO: a real read error
# that works as root too.
PROC_MEM = Path("/proc/self/mem")
needs_proc_mem = pytest.mark.skipif(not PROC_MEM.exists(), reason="needs Linux /proc/self/mem")


@needs_proc_mem
def test_read_error_exits_2_replay_check() -> None:
    run = replay_check(PROC_MEM)
    assert run.returncode == 2
    assert "cannot read '/proc/self/mem'" in run.stderr
    assert "Input/output error" in run.stderr


@needs_proc_mem
def test_read_error_exits_2_with_explicit_input_format() -> None:
    run = check("--input-format", "actions", PROC_MEM)
    assert run.returncode == 2
    assert "cannot read '/proc/self/mem'" in run.stderr


@needs_proc_mem
def test_read_error_exits_2_with_auto_detection() -> None:
    """Regression: a read error while detecting the format was once a traceback."""
    run = check(PROC_MEM)
    assert run.returncode == 2
    assert "cannot read '/proc/self/mem'" in run.stderr


# -- stdin and line endings ---------------------------------------------------------------


def test_stdin_dash() -> None:
    data = BEFORE + b"\n{not json\n" + AFTER + b"\n"
    run = check("-", stdin=data)
    assert run.returncode == 1
    assert [(f.file, f.line, f.rule) for f in run.found] == [
        ("<stdin>", 1, "unkeyed-side-effect"),
        ("<stdin>", 2, "unreadable-line"),
        ("<stdin>", 3, "unkeyed-side-effect"),
    ]
    seed = replay_check("-", stdin=data)
    assert seed.returncode == 1
    assert [f.line for f in seed.found] == [1, 2, 3]


def otlp_line(*spans: tuple[str, str, str]) -> bytes:
    """An OTLP/JSON request of spans ``(action_id, kind, name)`` in session s-1."""
    encoded = [
        {
            "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
            "spanId": f"{index:016x}",
            "name": name,
            "startTimeUnixNano": str(1_767_225_600_000_000_000 + index),
            "endTimeUnixNano": str(1_767_225_600_000_000_001 + index),
            "attributes": [
                {"key": "session.id", "value": {"stringValue": "s-1"}},
                {"key": "agent.action.id", "value": {"stringValue": action_id}},
                {"key": "agent.action.kind", "value": {"stringValue": kind}},
                {"key": "agent.action.idempotency_key", "value": {"stringValue": f"k-{action_id}"}},
            ],
        }
        for index, (action_id, kind, name) in enumerate(spans, 1)
    ]
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": encoded}]}]}).encode()


def test_a_first_line_longer_than_a_pipe_s_buffer_is_detected_on_stdin() -> None:
    """A Collector's request of a few dozen spans is tens of KiB on one line. Detection on
    a pipe saw only the first 8 KiB buffer, so ``cat traces.jsonl | durable-sessions check -``
    read the file as an action log: four missing-field errors a line, no span checked."""
    padding = [(f"t{n}", "tool_call", "x" * 1000) for n in range(100)]
    data = otlp_line(*padding, ("a1", "llm_call", "model")) + b"\n"
    assert len(data) > 100_000
    run = check("-", stdin=data)
    assert (run.returncode, [(f.line, f.rule, f.action) for f in run.found]) == (
        1,
        [(1, "unrecorded-result", "a1")],
    ), run.stdout


def test_a_long_first_tracing_event_after_comments_is_detected_on_stdin() -> None:
    event = {"trace_id": "t-1", "span": "s1", "step": 1, "kind": "step_complete", "status": "ok"}
    long_event = {**event, "meta": {"note": "x" * 50_000}}
    data = (
        b"# run 1\n\n"
        + json.dumps(long_event).encode()
        + b"\n"
        + json.dumps({**event, "span": "s2"}).encode()
    )
    run = check("-", stdin=data)
    assert [(f.line, f.rule, f.action) for f in run.found] == [
        (3, "unrecorded-result", "s1"),
        (4, "unrecorded-result", "s2"),
    ], run.stdout


def test_a_first_line_over_the_limit_on_stdin_is_reported_and_the_next_read() -> None:
    data = b'{"session_id":"s-1","pad":"' + b"x" * 5000 + b'"}\n' + AFTER + b"\n"
    run = check("--max-line-bytes", "1000", "-", stdin=data)
    assert [(f.line, f.rule) for f in run.found] == [(1, "unreadable-line"), (2, "unkeyed-side-effect")]


def test_stdin_empty() -> None:
    run = check("-", stdin=b"")
    assert run.returncode == 0
    assert "no actions" in run.stderr


def test_last_line_without_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "tail.jsonl"
    path.write_bytes(BEFORE + b"\n" + AFTER)
    run = check(path)
    assert [(f.line, f.action) for f in run.found] == [(1, "a1"), (2, "a3")]
    assert [f.line for f in replay_check(path).found] == [1, 2]


def test_crlf_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(BEFORE + b"\r\n# comment\r\n\r\n" + AFTER + b"\r\n")
    run = check(path)
    assert [(f.line, f.rule) for f in run.found] == [
        (1, "unkeyed-side-effect"),
        (4, "unkeyed-side-effect"),
    ]
    assert [f.line for f in replay_check(path).found] == [1, 4]


@pytest.mark.parametrize("cli", ["durable-sessions", "replay-check"])
def test_utf8_bom_does_not_make_line_1_unreadable(tmp_path: Path, cli: str) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + BEFORE + b"\r\n" + AFTER + b"\r\n")
    run = check(path) if cli == "durable-sessions" else replay_check(path)
    assert [f.line for f in run.found] == [1, 2]
    assert all(UNKEYED in f.message for f in run.found)
    assert run.at(1)[0].action == "a1"


def test_utf8_bom_only_on_line_1(tmp_path: Path) -> None:
    """A BOM is a file marker: the same bytes on line 2 are not a record."""
    path = tmp_path / "bom2.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n\xef\xbb\xbf" + BEFORE + b"\n")
    run = check(path)
    assert [(f.line, f.rule) for f in run.found] == [(2, "unreadable-line")]


# -- tracing input with hostile values ------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "line2"),
    [
        (
            {"trace_id": "t", "span": ["x"], "step": 1, "kind": "tool_result", "status": "ok"},
            {"missing-field"},
        ),
        ({"trace_id": "t", "span": "x", "step": 1, "kind": ["tool_call"], "status": "ok"}, set()),
        ({"trace_id": "t", "span": "x", "step": 1, "kind": "tool_call", "status": {}}, set()),
    ],
    ids=["span-list", "kind-list", "status-object"],
)
def test_tracing_event_with_unhashable_values(tmp_path: Path, event: dict, line2: set[str]) -> None:
    """Lists and objects where the tracing reader expects strings once raised TypeError."""
    good = {"trace_id": "t", "span": "s1", "step": 0, "kind": "step_complete", "status": "ok", "agent": "a"}
    path = tmp_path / "trace.jsonl"
    path.write_text(
        json.dumps(good) + "\n" + json.dumps(event) + "\n" + json.dumps({**good, "span": "s3"}) + "\n"
    )
    run = check("--input-format", "tracing", path)
    assert run.returncode == 1
    assert run.rules_at(1) == {"unrecorded-result"}
    assert run.rules_at(2) == line2
    assert run.rules_at(3) == {"unrecorded-result"}


# -- the parallel checker (--jobs) sees the same bad input ----------------------------------


def _mixed_logs(tmp_path: Path) -> list[Path]:
    """Two files: every bad line of BAD_LINES between records of three sessions."""
    first, second = [], []
    for index, (middle, _) in enumerate(BAD_LINES.values()):
        session = f"s-{index % 3}"
        target = first if index % 2 else second
        target.append(
            json.dumps({"session_id": session, "action_id": f"p{index}", "kind": "payment", "status": "ok"})
        )
        target.append(middle.decode("utf-8", "surrogateescape"))
        target.append(
            json.dumps({"session_id": session, "action_id": "dup", "kind": "llm_call", "status": "ok"})
        )
    paths = []
    for name, lines in (("one.jsonl", first), ("two.jsonl", second)):
        path = tmp_path / name
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
        paths.append(path)
    return paths


@pytest.mark.parametrize("jobs", ["2", "3"])
def test_parallel_check_reports_bad_input_like_a_single_process(tmp_path: Path, jobs: str) -> None:
    paths = _mixed_logs(tmp_path)
    single = check("--jobs", "1", *paths)
    assert single.returncode == 1
    assert {f.rule for f in single.found} >= {"unreadable-line", "unkeyed-side-effect", "duplicate-action-id"}
    parallel = check("--jobs", jobs, *paths)
    assert parallel.returncode == single.returncode
    assert parallel.stdout == single.stdout


def test_parallel_check_with_a_missing_file(tmp_path: Path) -> None:
    paths = _mixed_logs(tmp_path)
    missing = tmp_path / "nope.jsonl"
    run = check("--jobs", "2", *paths, missing)
    assert run.returncode == 2
    assert str(missing) in run.stderr


def test_parallel_check_of_a_directory(tmp_path: Path) -> None:
    run = check("--jobs", "2", tmp_path)
    assert run.returncode == 2
    assert str(tmp_path) in run.stderr


def test_parallel_check_of_stdin() -> None:
    data = BEFORE + b"\n{not json\n" + AFTER + b"\n"
    single = check("-", stdin=data)
    assert single.returncode == 1
    run = check("--jobs", "2", "-", stdin=data)
    assert run.returncode == 1
    assert run.stdout == single.stdout


def test_a_peek_at_a_pipe_splits_lines_as_the_readers_do() -> None:
    """A carriage return is JSON whitespace, also inside an object: a pipe peeked at found
    no object on a first line holding one (``splitlines`` cut it there), and named an
    OTLP/JSON stream an action log, where a file of the same bytes was detected."""
    data = b'{"resourceSpans":\r[]}\n'
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    with open(read, "rb") as pipe:
        assert not pipe.seekable()
        assert readers.sniff_format(pipe, "<pipe>", readers.DEFAULT_MAX_LINE_BYTES) == "otlp-json"
