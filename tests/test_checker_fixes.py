"""The offline checker: a progress display over a pipe, OTLP/JSON doubles, a tracing log
split across files, keys of unreadable spans, control characters in ids, a file given
twice, the session count and ``--key-window-s``. Run as the installed commands."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from durable_sessions import otlp_json
from durable_sessions.check import OfflineCheck
from durable_sessions.digest import digest_value
from durable_sessions.json_text import may_hold_long_integer
from durable_sessions.processor import ConfigurationError, DurabilitySpanProcessor
from durable_sessions.rules import select_rules

DURABLE_SESSIONS = str(Path(sys.executable).with_name("durable-sessions"))
REPLAY_CHECK = str(Path(sys.executable).with_name("replay-check"))


def run(*argv: str, stdin: Any = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def check_json(*args: str | Path) -> tuple[int, dict[str, Any]]:
    result = run(DURABLE_SESSIONS, "check", "--format", "json", *map(str, args))
    return result.returncode, json.loads(result.stdout)


def write(path: Path, *records: dict[str, Any] | str) -> Path:
    lines = (record if isinstance(record, str) else json.dumps(record) for record in records)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def action(action_id: str, kind: str = "payment", session: str = "s-1", **fields: Any) -> dict[str, Any]:
    return {"session_id": session, "action_id": action_id, "kind": kind, "status": "ok", **fields}


# -- 1. progress on a terminal while reading a pipe or a FIFO -------------------------------


def _drain(fd: int, into: list[bytes]) -> None:
    """Read a pseudo-terminal until its last writer is gone (EIO), so the checker never
    blocks on a full terminal."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.append(chunk)


def _check_with_terminal_stderr(argv: list[str], stdin: Any) -> tuple[int, str, bytes]:
    """Run ``argv`` with standard error on a pseudo-terminal (so the progress display is
    on) and TERM=xterm: (exit code, standard output, what the terminal showed)."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=secondary,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(secondary)
    shown: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(primary, shown))
    reader.start()
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        reader.join(timeout=10)
        os.close(primary)
    return process.returncode, out.decode(), b"".join(shown)


SEED_LOG = [
    action("a1"),  # unkeyed-side-effect
    action("a2", kind="llm_call"),  # unrecorded-result
    action("a3", kind="llm_call", result={"plan": "A"}),
]
TRACING_LOG = [
    {"trace_id": "t", "span": "x", "step": 1, "kind": "step_complete", "agent": "a", "status": "ok"},
]


@pytest.mark.parametrize("fmt", ["actions", "tracing"])
def test_progress_on_a_terminal_reading_a_pipe_does_not_crash(tmp_path: Path, fmt: str) -> None:
    """``producer | durable-sessions check -`` with stderr on a terminal: the progress
    display asked the pipe for its position, "Illegal seek", a traceback and exit 1."""
    log = write(tmp_path / "log.jsonl", *(SEED_LOG if fmt == "actions" else TRACING_LOG))
    producer = subprocess.Popen(["cat", str(log)], stdout=subprocess.PIPE)
    try:
        code, out, shown = _check_with_terminal_stderr([DURABLE_SESSIONS, "check", "-"], producer.stdout)
    finally:
        producer.stdout.close()  # type: ignore[union-attr]
        producer.wait(timeout=10)
    assert b"Traceback" not in shown and b"Illegal seek" not in shown, shown
    assert code == 1
    rules = ["unkeyed-side-effect", "unrecorded-result"] if fmt == "actions" else ["unrecorded-result"]
    assert [line.split("[")[1].split("]")[0] for line in out.splitlines() if "error[" in line] == rules
    assert "durable-sessions FAIL" in out


def test_progress_on_a_terminal_reading_a_fifo_does_not_crash(tmp_path: Path) -> None:
    """``durable-sessions check <(zcat log.gz)`` names a pipe; so does a FIFO."""
    log = write(tmp_path / "log.jsonl", *SEED_LOG)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", 'cat "$1" > "$2"', "sh", str(log), str(fifo)])
    try:
        code, out, shown = _check_with_terminal_stderr(
            [DURABLE_SESSIONS, "check", "--format", "json", str(fifo)], subprocess.DEVNULL
        )
    finally:
        writer.wait(timeout=10)
    assert b"Traceback" not in shown, shown
    assert code == 1
    assert [v["rule"] for v in json.loads(out)["violations"]] == ["unkeyed-side-effect", "unrecorded-result"]


# -- 2. OTLP/JSON doubleValue ------------------------------------------------------------


def _otlp_line(max_attempts: str) -> bytes:
    """One request of one span: a retryable tool call whose max_attempts is the JSON
    text ``max_attempts`` as a ``doubleValue``."""
    attributes = [
        {"key": "session.id", "value": {"stringValue": "s"}},
        {"key": "agent.action.id", "value": {"stringValue": "a1"}},
        {"key": "agent.action.kind", "value": {"stringValue": "tool_call"}},
        {"key": "agent.action.retryable", "value": {"boolValue": True}},
        {"key": "agent.action.max_attempts", "value": {"doubleValue": "@"}},
        {"key": "agent.action.attempts", "value": {"intValue": "1"}},
    ]
    span = {
        "traceId": "0af7651916cd43dd8448eb211c80319c",
        "spanId": "00f067aa0ba902b7",
        "name": "t",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": "2",
        "attributes": attributes,
    }
    request = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {}, "spans": [span]}]}]}
    return orjson.dumps(request).replace(b'"@"', max_attempts.encode())


DOUBLES_AS_WRITTEN = ("3", "3.0", "2.5", "-1", '"3"', '"NaN"', '"Infinity"', '"-Infinity"')


def test_a_double_reads_as_the_sidecar_reads_it() -> None:
    """Go's protojson (the Collector's file exporter) writes the double 3.0 as ``3``; the
    offline reader took it for the integer 3 where the sidecar's decoder reads 3.0. The
    strings are protobuf's JSON mapping of doubles (not finite ones, and numbers quoted)."""
    decode = pytest.importorskip("durable_sessions_collector.otlp.decode")
    read: dict[str, tuple[str, str]] = {}
    expected: dict[str, tuple[str, str]] = {}
    for written in DOUBLES_AS_WRITTEN:
        line = _otlp_line(written)
        [parts] = decode.json_span_parts(line, [])
        sidecar = parts[1]["agent.action.max_attempts"]
        [span] = otlp_json.spans_of(orjson.loads(line))
        offline = span.attributes["agent.action.max_attempts"]  # type: ignore[union-attr]
        read[written] = (type(offline).__name__, repr(offline))  # 3 == 3.0: compare types too
        expected[written] = (type(sidecar).__name__, repr(sidecar))
    assert read == expected


def test_a_double_written_as_an_integer_is_no_integer_cap(tmp_path: Path) -> None:
    log = tmp_path / "spans.jsonl"
    log.write_bytes(_otlp_line("3") + b"\n")
    code, doc = check_json(log)
    assert code == 1
    [violation] = doc["violations"]
    assert violation["rule"] == "unbounded-retry"
    assert "max_attempts is the number 3.0" in violation["message"]


# -- 3. a tracing log split across files ---------------------------------------------------

TOOL_CALL = {"trace_id": "t", "span": "x", "step": 1, "kind": "tool_call", "agent": "a", "tool": "pay"}
TOOL_RESULT = {**TOOL_CALL, "step": 2, "kind": "tool_result"}


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_tracing_log_split_across_files_is_one_stream(tmp_path: Path, jobs: str) -> None:
    """A tool call completed in one file and its result in the next is one action, as in
    one file: the second file was read with no memory of the first, a false
    duplicate-action-id."""
    call, result = {**TOOL_CALL, "status": "ok"}, {**TOOL_RESULT, "status": "ok"}
    whole = write(tmp_path / "whole.jsonl", call, result)
    first, second = write(tmp_path / "run-1.jsonl", call), write(tmp_path / "run-2.jsonl", result)
    assert check_json("--jobs", jobs, whole) == (
        0,
        {"ok": True, "actions": 1, "sessions": 1, "violations": []},
    )
    assert check_json("--jobs", jobs, first, second) == check_json("--jobs", jobs, whole)


# -- 4. two unreadable spans on one OTLP/JSON line ------------------------------------------


def test_two_unreadable_spans_on_one_line_have_their_own_fingerprints(tmp_path: Path) -> None:
    good = orjson.loads(_otlp_line("3"))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    spans = [
        {"traceId": "zz", "spanId": "1"},
        good,
        {**good, "spanId": "00f067aa0ba902b8", "startTimeUnixNano": "abc"},
    ]
    request = {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}
    log = tmp_path / "spans.jsonl"
    log.write_bytes(orjson.dumps(request) + b"\n")
    result = run(DURABLE_SESSIONS, "check", "--format", "sarif", str(log))
    results = json.loads(result.stdout)["runs"][0]["results"]
    unreadable = [r for r in results if r["ruleId"] == "unreadable-line"]
    assert len(unreadable) == 2
    fingerprints = [r["partialFingerprints"]["durableSessionsViolation/v1"] for r in unreadable]
    assert len(set(fingerprints)) == 2, fingerprints
    assert fingerprints[0] == f"None|unreadable-line|None|{log}:1"  # the first keeps its key


# -- 5. control characters in ids ----------------------------------------------------------

FORGED = action("a\x1b[31mRED", session="s\nother.jsonl:9: error[fake] x/y: forged")


def test_control_characters_in_ids_are_escaped_in_the_text_output(tmp_path: Path) -> None:
    """A newline in a session id forged an output line of its own; an escape sequence in
    an action id reached the reader's terminal."""
    log = write(tmp_path / "log.jsonl", FORGED)
    result = run(DURABLE_SESSIONS, "check", str(log))
    assert result.returncode == 1
    assert "\x1b" not in result.stdout
    lines = result.stdout.splitlines()
    assert len(lines) == 4  # the finding, a blank line, the verdict, the session
    assert lines[0].startswith(f"{log}:1: error[unkeyed-side-effect] s\\nother.jsonl:9: ")
    assert "/a\\x1b[31mRED: " in lines[0]
    assert lines[3] == "  unrecoverable: s\\nother.jsonl:9: error[fake] x/y: forged (unkeyed-side-effect)"
    _, doc = check_json(log)  # JSON escapes them itself: the ids stay as they are
    [violation] = doc["violations"]
    assert (violation["session_id"], violation["action_id"]) == (FORGED["session_id"], FORGED["action_id"])


def test_control_characters_in_ids_are_escaped_by_replay_check(tmp_path: Path) -> None:
    log = write(tmp_path / "log.jsonl", FORGED)
    result = run(REPLAY_CHECK, "--actions", str(log))
    assert result.returncode == 1
    assert "\x1b" not in result.stdout
    assert result.stdout.splitlines()[0].startswith("line 1 [a\\x1b[31mRED]: ")


# -- 6. a file given twice, in worker processes ----------------------------------------------


def test_a_file_given_twice_gives_the_same_order_in_worker_processes(tmp_path: Path) -> None:
    """The findings of the second reading were sorted in with those of the first."""
    log = write(
        tmp_path / "log.jsonl",
        *(action(f"a{i}", kind=("payment", "llm_call")[i % 2], session=f"s-{i % 5}") for i in range(20)),
        action("p1", session="s-3", status="started", idempotency_key="k"),
    )
    rules = select_rules()

    def findings(jobs: int) -> list[str]:
        return [repr(v) for v in OfflineCheck([str(log), str(log)], rules, jobs=jobs)]

    single = findings(1)
    assert len(single) > 20
    assert findings(2) == single
    assert findings(3) == single


# -- 7. the session count and the sessions listed ---------------------------------------------


def test_the_session_count_includes_sessions_seen_only_in_incomplete_records(tmp_path: Path) -> None:
    log = write(
        tmp_path / "log.jsonl",
        {"session_id": "s-1", "kind": "payment", "status": "ok"},  # missing action_id
        {"session_id": "", "action_id": "b", "kind": "tool_call", "status": "ok"},  # names no session
        action("a", kind="tool_call", session="s-2"),
    )
    code, doc = check_json(log)
    assert code == 1 and doc["sessions"] == 2
    text = run(DURABLE_SESSIONS, "check", str(log)).stdout
    assert "in 3 action(s) in 2 session(s)" in text
    listed = [line for line in text.splitlines() if line.startswith("  ")]
    assert listed == ["  unrecoverable: s-1 (missing-field)"]
    rules = select_rules()
    counts = []
    for jobs in (1, 2):
        check = OfflineCheck([str(log)], rules, jobs=jobs)
        list(check)
        counts.append((check.actions, check.sessions))
    assert counts == [(3, 2), (3, 2)]


# -- 8. --key-window-s --------------------------------------------------------------------


def test_a_key_window_that_is_no_number_is_a_clear_usage_error(tmp_path: Path) -> None:
    log = write(tmp_path / "log.jsonl", action("a1", kind="tool_call"))
    result = run(DURABLE_SESSIONS, "check", "--key-window-s", "abc", str(log))
    assert result.returncode == 2
    assert "--key-window-s: 'abc' is not a number" in result.stderr
    assert "_positive_seconds" not in result.stderr


@pytest.mark.parametrize("text", ["inf", "1e400", "-inf", "nan", "0", "-1", "abc"])
def test_the_cli_refuses_a_key_window_as_the_span_processor_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """``check --key-window-s inf`` (or ``1e400``) was accepted while the span processor
    refuses ``key_window_s=inf``: both now use one validator, and say the same reason
    after the name and value as each shows them."""
    log = write(tmp_path / "log.jsonl", action("a1", kind="tool_call"))
    result = run(DURABLE_SESSIONS, "check", f"--key-window-s={text}", str(log))  # = for -inf
    monkeypatch.setenv("DURABLE_SESSIONS_KEY_WINDOW_S", text)
    with pytest.raises(ConfigurationError) as refused:
        DurabilitySpanProcessor(mode="silent")
    reason = str(refused.value).removeprefix(f"DURABLE_SESSIONS_KEY_WINDOW_S={text!r} ")
    assert reason in ("is not a number", "must be a positive number of seconds"), refused.value
    assert result.returncode == 2, result.stdout
    assert f"--key-window-s: {text!r} {reason}" in result.stderr


@pytest.mark.parametrize(
    ("window", "age", "said"),
    [
        ("10", 30, "re-sent 30.0 s after its first use, beyond the 10 s key window"),
        ("600", 1000, "re-sent 16.7 min after its first use, beyond the 10 min key window"),
    ],
)
def test_a_key_window_is_stated_in_a_readable_unit(tmp_path: Path, window: str, age: int, said: str) -> None:
    """A 10 s window was "re-sent 0.0 h after its first use, beyond the 0.00277778 h key window"."""
    start = 1_700_000_000
    log = write(
        tmp_path / "log.jsonl",
        action("w", status="started", idempotency_key="k", ts=start),
        action("w", idempotency_key="k", ts=start + age, result={}),
    )
    _, doc = check_json("--key-window-s", window, log)
    [violation] = doc["violations"]
    assert violation["rule"] == "key-outlived-window"
    assert said in violation["message"]


# -- 9. reviewed defects, checked in the four ways a log is checked ---------------------------

WAYS = [
    pytest.param(native, jobs, id=f"{'c' if native else 'python'}-jobs{jobs}")
    for native in (True, False)
    for jobs in ("1", "2")
]


def check_way(native: bool, jobs: str, log: Path, *args: str) -> list[dict[str, Any]]:
    """The violations ``durable-sessions check`` reports for ``log``, with the C
    extensions on or off, in one process or two workers."""
    env = {**os.environ, "DURABLE_SESSIONS_NATIVE": "true" if native else "false"}
    result = subprocess.run(
        [DURABLE_SESSIONS, "check", "--format", "json", "--jobs", jobs, *args, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return json.loads(result.stdout)["violations"]


def found(violations: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(v["line"], v["rule"]) for v in violations]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_null_incarnation_is_an_absent_one(tmp_path: Path, native: bool, jobs: str) -> None:
    """A replayed record with ``"incarnation": null`` made the action's incarnation
    unknown, so its re-execution in a later run was taken for a duplicate action id."""
    log = write(
        tmp_path / "log.jsonl",
        action("p", idempotency_key="pay-s-1-p", incarnation="r1"),
        action("p", idempotency_key="pay-s-1-p", incarnation=None, replayed=True),
        action("p", incarnation="r2"),
    )
    violations = check_way(native, jobs, log)
    assert (3, "duplicate-action-id") not in found(violations)
    [again] = [v for v in violations if v["rule"] == "re-executed-side-effect"]
    assert "completed in incarnation 'r1' was executed again in 'r2'" in again["message"]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_shared_key_is_cited_where_it_was_first_used(tmp_path: Path, native: bool, jobs: str) -> None:
    """The key first appears on line 2, in a retry of an action whose first attempt (line
    1) had none: the message said "at line 1", the action's first appearance."""
    retry = {"retryable": True, "max_attempts": 3}
    log = write(
        tmp_path / "log.jsonl",
        action("a1", kind="tool_call", status="error", attempts=1, **retry),
        action("a1", kind="tool_call", attempts=2, idempotency_key="k-shared", **retry),
        action("a2", kind="write", idempotency_key="k-shared"),
    )
    [shared] = [v for v in check_way(native, jobs, log) if v["rule"] == "shared-key"]
    assert shared["line"] == 3
    assert "already used by action 'a1' at line 2 " in shared["message"]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_an_unstable_key_is_cited_where_the_action_first_carried_it(
    tmp_path: Path, native: bool, jobs: str
) -> None:
    """As for shared-key: the first key appears on line 2, in a retry whose first attempt
    had none, and the message said "at line 1"."""
    retry = {"retryable": True, "max_attempts": 3}
    log = write(
        tmp_path / "log.jsonl",
        action("a1", kind="tool_call", status="error", attempts=1, **retry),
        action("a1", kind="tool_call", status="error", attempts=2, idempotency_key="k-one", **retry),
        action("a1", kind="tool_call", attempts=3, idempotency_key="k-two", **retry),
    )
    [unstable] = [v for v in check_way(native, jobs, log) if v["rule"] == "unstable-key"]
    assert unstable["line"] == 3
    assert "but 'k-one' at line 2 " in unstable["message"]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_key_window_counts_re_sends_from_the_first_known_time(
    tmp_path: Path, native: bool, jobs: str
) -> None:
    """A replayed record re-sends nothing, so it does not outlive the window (line 2
    was flagged); a key whose first use has no ts is dated by the next record that has
    one (line 5 was missed: the first use stayed undated for ever)."""
    log = write(
        tmp_path / "log.jsonl",
        action("p", idempotency_key="pay-s-1-p", ts="2026-11-01T09:00:00Z", incarnation="r1"),
        action("p", idempotency_key="pay-s-1-p", ts="2026-11-05T09:00:00Z", incarnation="r2", replayed=True),
        action("q", status="started", idempotency_key="pay-s-1-q", incarnation="r1"),
        action(
            "q", status="started", idempotency_key="pay-s-1-q", ts="2026-11-01T09:00:00Z", incarnation="r2"
        ),
        action("q", idempotency_key="pay-s-1-q", ts="2026-11-05T09:00:00Z", incarnation="r3"),
    )
    windows = [v for v in check_way(native, jobs, log) if v["rule"] == "key-outlived-window"]
    assert [v["line"] for v in windows] == [5]
    assert "re-sent 96.0 h after its first use" in windows[0]["message"]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_ts_in_milliseconds_is_an_invalid_field_not_a_key_window_overrun(
    tmp_path: Path, native: bool, jobs: str
) -> None:
    """``ts`` is epoch seconds (docs/readers.md); a logger's milliseconds, read as seconds,
    made a payment completed two minutes after its start "re-sent 33.3 h after its first
    use", a warning that sends the reader after a bug that is not there. Such a number
    is now reported as what it is, and no rule reads it as a time."""
    log = write(
        tmp_path / "log.jsonl",
        action("p", status="started", idempotency_key="pay-s-1-p", ts=1_767_225_600_000),
        action("p", idempotency_key="pay-s-1-p", ts=1_767_225_720_000.0),
        action("q", status="started", idempotency_key="pay-s-1-q", ts=1_767_225_600),
        action("q", idempotency_key="pay-s-1-q", ts=1_767_225_720.5),
    )
    found = check_way(native, jobs, log)
    assert [(v["line"], v["rule"]) for v in found] == [(1, "invalid-field"), (2, "invalid-field")]
    assert (
        "ts is the integer 1767225600000, expected an ISO-8601 date-time or epoch seconds (not milliseconds)"
        in (found[0]["message"])
    )


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_session_id_given_again_with_an_escaped_key_is_routed_as_parsed(
    tmp_path: Path, native: bool, jobs: str
) -> None:
    """``"session\\u005fid":"s4"`` after a literal ``"session_id":"s1"``: the parser keeps
    s4, but two workers routed the line by its first bytes, to s1's worker, and the
    line's violations were lost."""
    log = write(
        tmp_path / "log.jsonl",
        action("a1", kind="llm_call", session="s4", result=1),
        '{"session_id":"s1","action_id":"a1","kind":"payment","status":"ok","idempotency_key":"k-a1",'
        '"session\\u005fid":"s4"}',
        action("a2", session="s4", idempotency_key="k-a1"),
    )
    assert found(check_way(native, jobs, log)) == [(2, "duplicate-action-id"), (3, "shared-key")]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_integers_beyond_64_bits_are_read_exactly(tmp_path: Path, native: bool, jobs: str) -> None:
    """orjson reads 100000000000000000001 as the double 1e+20: a replay serving …002
    where …001 was recorded passed, and an exact replay of a recorded digest was a
    false replay-mismatch."""
    recorded = {"order": 100000000000000000001}
    digest = "sha256:" + hashlib.sha256(json.dumps(recorded, separators=(",", ":")).encode()).hexdigest()
    records = [
        action("l", kind="llm_call", result=recorded, incarnation="r1"),
        action(
            "l", kind="llm_call", result={"order": 100000000000000000002}, incarnation="r2", replayed=True
        ),
        action("m", kind="llm_call", result_digest=digest, incarnation="r1"),
        action("m", kind="llm_call", result=recorded, incarnation="r2", replayed=True),
    ]
    # Compact, as writers write: the line's bytes then decide its worker and C reads it.
    log = write(tmp_path / "log.jsonl", *(json.dumps(r, separators=(",", ":")) for r in records))
    assert found(check_way(native, jobs, log)) == [(2, "replay-mismatch")]


@pytest.mark.parametrize(
    ("line", "long"),
    [
        (b'{"n":100000000000000000001}', True),
        (b'{"n": -9223372036854775809}', True),
        (b'{"n":[1,100000000000000000001]}', True),
        (b'{"startTimeUnixNano":"1700000000000000000"}', False),  # OTLP/JSON: a quoted number
        (b'{"n":18446744073709551}', False),
        (b'{"n":0.1000000000000000000001}', False),
        (b"100000000000000000001", True),  # a span's result text may be a bare number
        (b'"100000000000000000001"', False),
    ],
)
def test_only_a_bare_long_integer_sends_a_line_to_the_exact_reader(line: bytes, long: bool) -> None:
    assert may_hold_long_integer(line) is long


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_a_replay_leaves_the_action_to_the_run_that_executed_it(
    tmp_path: Path, native: bool, jobs: str
) -> None:
    """r1 answered and recorded, r2 only replayed, r3 ran them again: the messages said
    "answered in incarnation 'r2'", the run that executed nothing."""
    log = write(
        tmp_path / "log.jsonl",
        action("q1", kind="user_prompt", result={"a": 1}, incarnation="r1"),
        action("q1", kind="user_prompt", result={"a": 1}, incarnation="r2", replayed=True),
        action("q1", kind="user_prompt", result={"a": 2}, incarnation="r3"),
        action("l1", kind="llm_call", result={"a": 1}, incarnation="r1"),
        action("l1", kind="llm_call", result={"a": 1}, incarnation="r2", replayed=True),
        action("l1", kind="llm_call", result={"a": 3}, incarnation="r3"),
    )
    violations = check_way(native, jobs, log)
    assert found(violations) == [(3, "re-asked"), (6, "diverged-result")]
    assert "'q1' answered in incarnation 'r1' was asked again in 'r3'" in violations[0]["message"]
    assert "'l1' recorded in incarnation 'r1' was executed again in 'r3'" in violations[1]["message"]


@pytest.mark.parametrize(("native", "jobs"), WAYS)
def test_hex_digits_of_a_digest_are_read_in_either_case(tmp_path: Path, native: bool, jobs: str) -> None:
    """Java's and .NET's hex encoders write ``sha256:ABCD…``. Such a digest was no SHA-256
    to the checker: compared only as text, never with a recorded result, so a replay
    serving another result passed, and the same digest in two cases was a false
    replay-mismatch."""
    digest_a, digest_b = digest_value({"plan": "A"}), digest_value({"plan": "B"})
    upper_a, upper_b = "sha256:" + digest_a[7:].upper(), "sha256:" + digest_b[7:].upper()
    mixed_a = "sha256:" + "".join(c.upper() if i % 2 else c for i, c in enumerate(digest_a[7:]))
    question = digest_value("Which budget?")
    upper_question = "sha256:" + question[7:].upper()
    log = write(
        tmp_path / "log.jsonl",
        action("m", kind="llm_call", result_digest=upper_a, incarnation="r1"),
        action("m", kind="llm_call", result={"plan": "B"}, incarnation="r2", replayed=True),
        action("n", kind="llm_call", result={"plan": "A"}, incarnation="r1"),
        action("n", kind="llm_call", result_digest=upper_b, incarnation="r2", replayed=True),
        action("o", kind="llm_call", result_digest=mixed_a, incarnation="r1"),
        action("o", kind="llm_call", result_digest=upper_a, incarnation="r2", replayed=True),
        action("q1", kind="user_prompt", prompt_digest=question, result=1, incarnation="r1"),
        action("q2", kind="user_prompt", prompt_digest=upper_question, result=2, incarnation="r2"),
    )
    violations = check_way(native, jobs, log)
    assert found(violations) == [(2, "replay-mismatch"), (4, "replay-mismatch"), (8, "re-asked")]
    assert f"{digest_a[:23]}… was recorded" in violations[0]["message"]
    assert f"serves {upper_b}" in violations[1]["message"]
