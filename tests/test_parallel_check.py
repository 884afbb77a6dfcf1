"""The parallel offline check routes each line to exactly one worker, by session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions.check import cyclic_gc_paused, raw_shard_of, shard_of
from durable_sessions.record import Location

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")

session_ids = st.text(min_size=1, max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    session_id=session_ids,
    shards=st.integers(min_value=2, max_value=5),
    extra=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), max_size=3),
)
def test_the_bytes_route_a_line_where_its_parsed_session_id_would(
    session_id: str, shards: int, extra: dict
) -> None:
    record = {"session_id": session_id, **{k: v for k, v in extra.items() if k != "session_id"}}
    raw = orjson.dumps(record) + b"\n"
    owner = raw_shard_of(raw, shards)
    if owner is not None:
        assert owner == shard_of((orjson.loads(raw), Location("f", 1)), shards)


def _escaped(text: str, which: list[bool]) -> bytes:
    """``text`` as a JSON string whose characters are escaped (``\\u00XX``) where ``which`` says."""
    return (
        b'"'
        + b"".join(
            f"\\u{ord(c):04{'x' if i % 2 else 'X'}}".encode() if escape else c.encode()
            for i, (c, escape) in enumerate(zip(text, which, strict=False))
        )
        + text[len(which) :].encode()
        + b'"'
    )


@settings(max_examples=200, deadline=None)
@given(
    first=session_ids,
    last=session_ids,
    which=st.lists(st.booleans(), min_size=10, max_size=10),
    shards=st.integers(min_value=2, max_value=5),
)
def test_the_bytes_route_a_line_with_the_key_again_escaped_where_parsing_would(
    first: str, last: str, which: list[bool], shards: int
) -> None:
    """``"session\\u005fid"`` is ``session_id`` to the parser, which keeps its last value."""
    raw = b'{"session_id":' + orjson.dumps(first) + b"," + _escaped("session_id", which) + b":"
    raw += orjson.dumps(last) + b"}\n"
    owner = raw_shard_of(raw, shards)
    if owner is not None:
        assert owner == shard_of((orjson.loads(raw), Location("f", 1)), shards)


def test_the_bytes_do_not_decide_ambiguous_lines() -> None:
    assert raw_shard_of(b'{"session_id":"a","result":{"session_id":"b"}}\n', 2) is None
    assert raw_shard_of(b'{"session_id":"a\\u0062"}\n', 2) is None
    assert raw_shard_of(b'{"action_id":"x","session_id":"a"}\n', 2) is None
    assert raw_shard_of(b'{"session_id":""}\n', 2) is None
    # The same key again, with an escaped letter: the parser keeps the last value, "b".
    assert raw_shard_of(b'{"session_id":"a","session\\u005fid":"b"}\n', 2) is None
    assert raw_shard_of(b'{"session_id":"a","\\u0073ession_id":"b"}\n', 2) is None
    assert raw_shard_of(b'{"session_id":"a","x":"caf\\u00e9"}\n', 2) is not None


AMBIGUOUS_LINES = [
    b'{"session_id":"a","result":{"session_id":"b"}}',
    b'{"session_id":"session_id","x":1}',  # the value, quoted, is the key again
    b'{"session_id":"s","session_id":"t"}',  # a duplicate key: the parser keeps the last
    b'{"session_id":"s","x":"_session_id_"}',
    b'{"session_id":"s","x":"a"}',
    b'{"session_id":"s_id"}',
    b'{"session_id":"s1","session\\u005fid":"s4"}',  # the key again, escaped
    b'{"session_id":"s1","\\u0053","session\\u005Fid":"s4"}',
    b'{"session_id":"s1","x":"\\u00e9\\u00"}',
    b'{"session_id":"s1","x":"\\u0',
]


@pytest.mark.parametrize("line", AMBIGUOUS_LINES)
def test_block_routing_decides_exactly_the_lines_byte_routing_decides(line: bytes) -> None:
    native = require_native_module()
    for shard in range(2):
        lines, _, _ = native.route_lines(line + b"\n", 0, shard, 2, 1 << 20, True)
        owner = raw_shard_of(line, 2)
        expected = [] if owner is not None and owner != shard else [(1, line + b"\n", owner == shard)]
        assert lines == expected


def check(*args: str) -> list[dict]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", *args], capture_output=True, text=True
    )
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)["violations"]


def test_a_broken_line_claimed_by_its_bytes_is_reported_once(tmp_path: Path) -> None:
    """A line whose bytes name a session but which is not JSON belongs to that session's worker."""
    lines = [
        json.dumps({"session_id": f"s-{i}", "action_id": "a1", "kind": "payment", "status": "ok"})
        for i in range(8)
    ]
    lines.insert(3, '{"session_id":"s-2","action_id":"a2","kind":')  # cut off mid-write
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines) + "\n")
    single, parallel = check("--jobs", "1", str(log)), check("--jobs", "2", str(log))
    assert parallel == single
    assert [v["line"] for v in single if v["rule"] == "unreadable-line"] == [4]
    assert sum(v["rule"] == "unkeyed-side-effect" for v in parallel) == 8


def test_progress_is_reported_while_workers_check(tmp_path: Path) -> None:
    """The terminal progress line keeps working when the check runs in worker processes."""
    from durable_sessions.check import PROGRESS_EVERY, OfflineCheck
    from durable_sessions.rules import select_rules

    log = tmp_path / "big.jsonl"
    lines = PROGRESS_EVERY + 100
    log.write_text(
        "".join(
            json.dumps(
                {"session_id": f"s-{i % 50}", "action_id": f"a{i}", "kind": "tool_call", "status": "ok"}
            )
            + "\n"
            for i in range(lines)
        )
    )
    seen: list[tuple[str, int, int | None]] = []
    run = OfflineCheck([str(log)], select_rules(), jobs=2, progress=lambda *report: seen.append(report))
    assert list(run) == []
    assert run.actions == lines
    assert seen, "no progress was reported"
    size = log.stat().st_size
    assert all(path == str(log) and 0 < done <= size and total == size for path, done, total in seen)


def test_the_cyclic_collector_is_paused_for_a_check_and_restored_after() -> None:
    import gc

    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), cyclic_gc_paused():
        raise RuntimeError("the check failed")
    assert gc.isenabled()


_LINE_PIECES = st.one_of(
    st.builds(lambda s: b'{"session_id":"' + s.encode() + b'","action_id":"a"}', st.text(max_size=6)),
    st.builds(lambda s: b'{"session_id":"' + s + b'"}', st.binary(max_size=6)),
    st.just(b'{"session_id":"s","x":{"session_id":"t"}}'),
    st.just(b'{"action_id":"a","session_id":"s"}'),
    # Runs of key fragments: the key again (overlapping or not), in values, cut short.
    st.lists(
        st.sampled_from(
            [
                b'"session_id"',
                b"session_id",
                b"_id",
                b"_",
                b'"',
                b"s",
                b"\\",
                b'","x":',
                b"\\u00",
                b"5f",
                b"e9",
            ]
        ),
        max_size=8,
    ).map(lambda parts: b'{"session_id":"' + b"".join(parts)),
    st.just(b""),
    st.just(b"\r"),
    st.binary(max_size=40),
)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
@given(
    lines=st.lists(_LINE_PIECES, max_size=12),
    trailing_newline=st.booleans(),
    max_line_bytes=st.integers(min_value=1, max_value=60),
    block=st.integers(min_value=1, max_value=64),
    shards=st.integers(min_value=1, max_value=3),
)
def test_block_routing_gives_each_worker_the_lines_line_routing_gives_it(
    lines: list[bytes], trailing_newline: bool, max_line_bytes: int, block: int, shards: int
) -> None:
    import io

    from durable_sessions import check

    native = require_native_module()
    text = b"\n".join(line.replace(b"\n", b" ") for line in lines) + (
        b"\n" if trailing_newline and lines else b""
    )
    for shard in range(shards):
        by_line = list(check._own_lines_by_line(io.BytesIO(text), "f", shard, shards, max_line_bytes, None))
        saved, check.ROUTE_BLOCK = check.ROUTE_BLOCK, block
        try:
            blocks = check._own_lines_by_block(
                io.BytesIO(text), "f", shard, shards, max_line_bytes, None, native.route_lines
            )
            by_block = [line for lines in blocks for line in lines]
        finally:
            check.ROUTE_BLOCK = saved
        assert by_block == by_line


def require_native_module() -> Any:
    from durable_sessions.native import native_module
    from tests.support.senders import require_native

    require_native()
    module = native_module()
    assert module is not None
    return module


@pytest.mark.parametrize("routing", ["native", "python"])
def test_messy_files_give_the_same_findings_in_parallel(tmp_path: Path, routing: str) -> None:
    """Two files, key orders that the bytes do and do not decide, over-long lines, a missing
    final newline: with either routing, one process and the workers find what one process
    reading line by line in Python finds."""
    import random

    rng = random.Random(5)
    kinds = ["payment", "tool_call", "user_prompt", "llm_call", "email"]
    paths = []
    for f in range(2):
        lines = []
        for _ in range(1500):
            record = {"session_id": f"s-{rng.randrange(40)}", "action_id": f"a{rng.randrange(300)}"}
            record.update(kind=rng.choice(kinds), status=rng.choice(["ok", "ok", "started", "error"]))
            if rng.random() < 0.3:
                record = dict(reversed(list(record.items())))  # session_id not first: parse to route
            if rng.random() < 0.02:
                record["result"] = "x" * 400  # over --max-line-bytes: reported, never parsed
            lines.append(json.dumps(record, separators=(",", ":") if rng.random() < 0.5 else (", ", ": ")))
        path = tmp_path / f"log{f}.jsonl"
        path.write_text("\n".join(lines) + ("\n" if f == 0 else ""))
        paths.append(str(path))
    python = {**os.environ, "DURABLE_SESSIONS_NATIVE": "false"}
    env = {**os.environ, "DURABLE_SESSIONS_NATIVE": "true"} if routing == "native" else python
    if routing == "native":
        require_native_module()

    def run(jobs: str, env: dict[str, str] = env) -> list[dict]:
        argv = [str(DURABLE_SESSIONS), "check", "--format", "json", "--max-line-bytes", "300", "--jobs", jobs]
        result = subprocess.run([*argv, *paths], capture_output=True, text=True, env=env)
        assert "Traceback" not in result.stderr
        return json.loads(result.stdout)["violations"]

    reference = run("1", python)  # one process reading line by line, all in Python
    assert any(v["rule"] == "unreadable-line" for v in reference)
    assert len(reference) > 100
    assert run("1") == reference  # with the extension: a block at a time, as the workers read
    assert run("2") == reference
    assert run("3") == reference


def test_the_cli_forks_its_workers_only_where_no_other_thread_runs() -> None:
    """Forking beside another thread could copy a lock that thread holds; the CLI, which
    runs none, forks (no re-import in every worker), anything else spawns."""
    import threading

    from durable_sessions.check import cli_start_method

    probe = "from durable_sessions.check import cli_start_method; print(cli_start_method())"
    alone = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert alone.stdout.strip() == "fork"
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert cli_start_method() == "spawn"
    finally:
        release.set()
        other.join()


def test_one_process_reads_a_regular_action_log_in_blocks_and_a_stream_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from durable_sessions.check import _reads_in_blocks, check_paths
    from durable_sessions.engine import Checker
    from durable_sessions.readers import sniff_format

    require_native_module()
    log = tmp_path / "run.jsonl"
    log.write_text('{"session_id":"s","action_id":"a","kind":"payment","status":"ok"}\n')
    tracing = tmp_path / "events.jsonl"
    tracing.write_text(
        '{"trace_id":"run-1","ts":"2026-07-05T10:00:00Z","kind":"trace_start","span":"root","step":0,'
        '"agent":"orchestrator","status":"started","parent":null}\n'
    )
    with log.open("rb") as source:
        assert sniff_format(source, "run.jsonl", 1 << 20) == "actions"
        assert source.tell() == 0  # sniffing rewound it
        assert _reads_in_blocks(str(log), source)
    with tracing.open("rb") as source:
        assert sniff_format(source, "events.jsonl", 1 << 20) == "tracing"

    def findings(native: str) -> list[str]:
        monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", native)
        return [repr(v) for v in check_paths([str(log), str(tracing)], Checker())]

    in_blocks = findings("true")
    assert any("unkeyed-side-effect" in found for found in in_blocks)
    assert in_blocks == findings("false")  # the tracing log too, by its own reader either way
    with log.open("rb") as source:
        assert not _reads_in_blocks("-", source)
    reader, writer = os.pipe()
    os.write(writer, log.read_bytes())
    os.close(writer)
    with os.fdopen(reader, "rb") as stream:
        assert not _reads_in_blocks("/dev/fd/3", stream)
