"""``checking="process"``: the span processor hands spans to a real checker process."""

from __future__ import annotations

import contextlib
import enum
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from durable_sessions import semconv as sc
from durable_sessions.instrument import session
from durable_sessions.mapping import map_attributes
from durable_sessions.offload import SPAN, CheckerProcess, violation_fields, violation_from
from durable_sessions.processor import ConfigurationError, DurabilitySpanProcessor
from durable_sessions.rules import select_rules
from durable_sessions.span_check import may_be_action
from durable_sessions.violation import Severity, Violation
from tests.support.forks import exit_code_in_fork
from tests.support.senders import use_sender
from tests.support.waiting import wait_until


@pytest.fixture(params=["native", "python"])
def sender(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test that starts checker processes runs with each of the two senders."""
    use_sender(monkeypatch, request.param)
    return request.param


def provider_with(processor: DurabilitySpanProcessor) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(processor)
    return provider, exporter


def start_unfinished_email(provider: TracerProvider, session_id: str) -> None:
    """An email whose intent is recorded and never completed: an end-of-session finding."""
    attributes = {
        sc.SESSION_ID: session_id,
        sc.ACTION_ID: "e1",
        sc.ACTION_KIND: "email",
        sc.attribute("status"): "started",
    }
    with provider.get_tracer("t").start_as_current_span("email", attributes=attributes):
        pass


def run_scenario(tracer: Any, seed: int) -> None:
    """A mix of clean and broken actions over a few sessions, some third-party spans."""
    rng = random.Random(seed)
    kinds = ["llm_call", "payment", "email", "tool_call", "user_prompt", "external_read", "clock"]
    for n in range(300):
        attributes: dict[str, Any] = {
            sc.SESSION_ID: f"s-{rng.randrange(7)}",
            sc.ACTION_ID: f"a{rng.randrange(120)}",
            sc.ACTION_KIND: rng.choice(kinds),
        }
        if rng.random() < 0.5:
            attributes[sc.attribute("result")] = '{"ok": true}'
        if rng.random() < 0.3:
            attributes[sc.attribute("idempotency_key")] = f"key-{rng.randrange(50)}"
        if rng.random() < 0.2:
            attributes[sc.attribute("status")] = rng.choice(["started", "error", "ok"])
        if rng.random() < 0.1:
            attributes[sc.attribute("max_attempts")] = rng.choice([3, "3", True, -1, float("nan")])
        if n % 17 == 0:
            attributes = {
                sc.GEN_AI_OPERATION_NAME: "chat",
                sc.GEN_AI_REQUEST_MODEL: "m",
                sc.SESSION_ID: "s-1",
            }
        with tracer.start_as_current_span("step", attributes=attributes):
            pass


def test_same_findings_as_checking_inline(sender: str) -> None:
    found: dict[str, list[Violation]] = {"inline": [], "process": []}
    for checking, violations in found.items():
        processor = DurabilitySpanProcessor(
            mode="silent",
            checking=checking,
            on_violation=violations.append,
            max_sessions=50,  # type: ignore[arg-type]
        )
        provider, _ = provider_with(processor)
        run_scenario(provider.get_tracer("t"), seed=11)
        assert processor.force_flush()
        provider.shutdown()
        assert processor.actions_checked == 300

    def comparable(violations: list[Violation]) -> list[tuple]:
        # span and trace ids (and action ids made from them) are random per run
        ids = re.compile("[0-9a-f]{16,32}").sub
        return sorted(
            (v.rule, v.session_id, ids("#", v.action_id or ""), ids("#", v.message)) for v in violations
        )

    assert len(found["inline"]) > 50
    assert comparable(found["process"]) == comparable(found["inline"])


def test_span_end_returns_before_the_checker_has_seen_it(sender: str) -> None:
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=seen.append)
    provider, exporter = provider_with(processor)
    tracer = provider.get_tracer("t")
    with (
        session("s-1"),
        tracer.start_as_current_span("pay", attributes={sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}),
    ):
        pass
    assert len(exporter.get_finished_spans()) == 1  # the exporter already has it
    assert processor._offload.native == (sender == "native")  # type: ignore[union-attr]
    assert processor.native == (sender == "native")
    assert processor.wait_checked(timeout_s=30)
    assert [v.rule for v in seen] == ["unkeyed-side-effect"]
    assert seen[0].session_id == "s-1"
    provider.shutdown()


def test_end_session_answers_with_the_end_of_session_findings(sender: str) -> None:
    processor = DurabilitySpanProcessor(mode="silent", checking="process")
    provider, _ = provider_with(processor)
    start_unfinished_email(provider, "s-9")
    assert [v.rule for v in processor.end_session("s-9")] == ["unresolved-side-effect"]
    assert processor.end_session("s-9") == []  # ended once
    provider.shutdown()


class Trip(enum.StrEnum):
    NINE = "s-9"


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_end_session_of_an_id_of_a_str_subclass_ends_the_session_of_its_text(checking: str) -> None:
    """A ``StrEnum`` member (or any ``str`` subclass) names the session of its text, as it
    does checking inline: marshal refuses a subclass, so the checker process was never
    asked, and ``end_session`` answered ``[]`` with the session left open."""
    processor = DurabilitySpanProcessor(mode="silent", checking=checking)  # type: ignore[arg-type]
    provider, _ = provider_with(processor)
    start_unfinished_email(provider, "s-9")
    assert [v.rule for v in processor.end_session(Trip.NINE)] == ["unresolved-side-effect"]
    assert processor.end_session("s-9") == []  # ended, once
    provider.shutdown()


def test_end_session_of_an_id_no_session_can_have_leaves_the_checker_checking(sender: str) -> None:
    """A list killed the checker process (the engine could not look it up, and nothing
    caught that there), so every later span went unchecked for the life of the application;
    an object marshal cannot carry held ``end_session`` for its whole 30 s timeout with the
    Python sender, waiting for an answer to a request that was never sent."""
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=seen.append)
    provider, _ = provider_with(processor)
    started = time.monotonic()
    assert processor.end_session(["s-9"]) == []  # type: ignore[arg-type]
    assert processor.end_session(object()) == []  # type: ignore[arg-type]
    assert time.monotonic() - started < 20  # neither waited out the 30 s timeout
    start_unfinished_email(provider, "s-9")
    assert [v.rule for v in processor.end_session("s-9")] == ["unresolved-side-effect"]
    assert processor.spans_dropped == 0
    provider.shutdown()


def test_shutdown_ends_sessions_and_reaps_the_checker_process(sender: str) -> None:
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=seen.append)
    provider, _ = provider_with(processor)
    start_unfinished_email(provider, "s-2")
    child = processor._offload._process  # type: ignore[union-attr]
    provider.shutdown()
    assert [v.rule for v in seen] == ["unresolved-side-effect"]
    assert child.poll() == 0


def open_descriptors() -> set[str]:
    """What this process's open file descriptors are open on (``pipe:[inode]``, a path)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used, closed since
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists descriptors through /proc")
def test_shutdown_closes_every_pipe_to_the_checker_process(sender: str) -> None:
    """A process that builds processors and shuts them down (a provider per tenant, a test
    suite) must not keep a pipe per checker it ever started for as long as it keeps the
    processor object."""
    before = open_descriptors()
    processors = []
    for _ in range(3):
        processor = DurabilitySpanProcessor(mode="silent", checking="process")
        assert processor.wait_checked(30)
        processor.shutdown()
        processors.append(processor)  # kept, as a provider keeps its processors
    assert {fd for fd in open_descriptors() - before if fd.startswith("pipe:")} == set()


def test_a_dead_checker_process_fails_open(caplog: pytest.LogCaptureFixture, sender: str) -> None:
    processor = DurabilitySpanProcessor(mode="log", checking="process")
    provider, exporter = provider_with(processor)
    tracer = provider.get_tracer("t")
    assert processor.wait_checked(timeout_s=30)
    child = processor._offload._process  # type: ignore[union-attr]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    wait_until(lambda: "failing open" in caplog.text)
    assert processor.internal_errors >= 1
    assert "failing open" in caplog.text
    for n in range(5):
        with tracer.start_as_current_span(
            "pay", attributes={sc.ACTION_ID: f"p{n}", sc.ACTION_KIND: "payment"}
        ):
            pass
    assert len(exporter.get_finished_spans()) == 5  # the application is untouched
    assert processor.spans_dropped == 5
    started = time.monotonic()
    assert processor.force_flush(timeout_millis=30_000) is False  # says so, at once
    assert time.monotonic() - started < 15  # not after its 30 s
    provider.shutdown()


def test_a_checker_process_that_cannot_start_gives_way_to_inline_checking(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, sender: str
) -> None:
    """An embedding program (uWSGI, mod_wsgi) has a ``sys.executable`` that is no Python:
    the checker process it starts ends at once. Its spans were dropped from then on."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="log", checking="process", on_violation=seen.append)
    provider, exporter = provider_with(processor)
    # The switch to inline checking is made, then logged (outside the lock): wait for both.
    wait_until(lambda: processor.checking == "inline" and bool(caplog.text))
    assert processor.checking == "inline"
    assert "could not start; checking inline instead" in caplog.text
    assert processor.internal_errors == 1
    with provider.get_tracer("t").start_as_current_span(
        "pay", attributes={sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}
    ):
        pass
    assert [v.rule for v in seen] == ["unkeyed-side-effect"]  # checked inline, at once
    assert processor.spans_dropped == 0 and processor.actions_checked == 1
    start_unfinished_email(provider, "s-2")
    assert processor.end_sessions()
    assert [v.rule for v in seen][1:] == ["unresolved-side-effect"]
    provider.shutdown()
    assert len(exporter.get_finished_spans()) == 2


@pytest.mark.parametrize("executable", [None, ""])
def test_no_sys_executable_gives_way_to_inline_checking(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, executable: str | None
) -> None:
    """An embedded interpreter that cannot say where a Python is has ``sys.executable``
    None (or empty): the constructor raised TypeError into the application's setup,
    where the docs promise inline checking when no checker process can be started."""
    monkeypatch.setattr(sys, "executable", executable)
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="log", checking="process", on_violation=seen.append)
    provider, _ = provider_with(processor)
    assert processor.checking == "inline" and processor.internal_errors == 1
    assert "sys.executable is not set" in caplog.text
    with provider.get_tracer("t").start_as_current_span(
        "pay", attributes={sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}
    ):
        pass
    assert [v.rule for v in seen] == ["unkeyed-side-effect"]
    provider.shutdown()


_NO_THREADS_SCRIPT = """
import os, threading
from opentelemetry.sdk.trace import TracerProvider
from durable_sessions import semconv as sc
from durable_sessions.processor import DurabilitySpanProcessor

provider = TracerProvider()  # its resource detectors run on threads
# A stack no address space holds: every Python thread fails to start, as in a process at
# its thread or memory limit (pthread_create says EAGAIN). The native sender's thread,
# made with the default stack, still starts: with it, the reader thread is the one that fails.
threading.stack_size(1 << 47)
seen = []
processor = DurabilitySpanProcessor(mode="log", checking="process", on_violation=seen.append)
threading.stack_size(0)
provider.add_span_processor(processor)
attributes = {sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}
with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
    pass
try:
    os.waitpid(-1, os.WNOHANG)
    children = "left"
except ChildProcessError:
    children = "none"
print(processor.checking, [v.rule for v in seen], processor.internal_errors, children)
provider.shutdown()
"""


def test_a_thread_that_cannot_start_gives_way_to_inline_checking(sender: str) -> None:
    """A process at its thread limit: the checker's reader (or the pure-Python sender's
    writer) cannot start. ``RuntimeError: can't start new thread`` reached the code that
    built the processor, where a checker process that cannot be started gives way to
    inline checking (logged once, counted)."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_THREADS_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Checked inline, at once; the checker process killed and reaped.
    assert done.stdout.split("\n")[0] == "inline ['unkeyed-side-effect'] 1 none", done.stderr
    assert "starting the checker process (checking inline instead)" in done.stderr
    assert done.stderr.count("failing open") == 1


# The native sender writes from a thread of its own, not a Python one.
@pytest.mark.parametrize(
    ("sender", "failing"), [("native", "reader"), ("python", "reader"), ("python", "writer")]
)
def test_a_checker_whose_setup_fails_is_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch, sender: str, failing: str
) -> None:
    """Setup after Popen that fails (a thread that cannot start: the process's thread
    limit) raised with the checker process left running, waiting on its input for ever
    when the native sender's copy of the pipe kept it open."""
    use_sender(monkeypatch, sender)
    started: list[subprocess.Popen[bytes]] = []

    class RecordedPopen(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    start = threading.Thread.start

    def start_unless_failing(thread: threading.Thread) -> None:
        if thread.name == f"durable_sessions.offload.{failing}":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(subprocess, "Popen", RecordedPopen)
    monkeypatch.setattr(threading.Thread, "start", start_unless_failing)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            checker_process(report=lambda violations: None, on_error=lambda where, error: None)
        (process,) = started
        assert process.returncode is not None, "the checker process was left running"
        with pytest.raises(ChildProcessError):  # reaped: no zombie left
            os.waitpid(process.pid, os.WNOHANG)
        assert process.stdout is not None and process.stdout.closed
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_a_full_queue_drops_and_counts_instead_of_blocking(sender: str) -> None:
    errors: list[str] = []
    checker = checker_process(
        report=lambda violations: None,
        on_error=lambda where, error: errors.append(where),
        queue_limit=3,
        interval_s=60,  # nothing is sent until asked
    )
    for n in range(10):
        checker.submit(span_message({sc.SESSION_ID: "s", sc.ACTION_ID: f"a{n}", sc.ACTION_KIND: "clock"}))
    assert checker.dropped == 7
    assert checker.sync(timeout_s=30)
    assert checker.actions == 3
    checker.close()
    assert errors == []


def test_values_marshal_cannot_carry_are_dropped_and_counted(sender: str) -> None:
    found: list[Violation] = []
    checker = checker_process(
        report=found.extend, on_error=lambda where, error: pytest.fail(f"{where}: {error}")
    )
    checker.submit(
        span_message({sc.SESSION_ID: "s", sc.ACTION_ID: "odd", sc.ACTION_KIND: "payment", "x": object()})
    )
    checker.submit(span_message({sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}))
    assert checker.sync(timeout_s=30)
    assert checker.dropped == 1
    assert checker.actions == 1
    assert [(v.rule, v.action_id) for v in found] == [("unkeyed-side-effect", "p1")]
    checker.close()


def test_raise_mode_needs_inline_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match='mode="raise" needs checking="inline"'):
        DurabilitySpanProcessor(mode="raise", checking="process")
    with pytest.raises(ConfigurationError, match="unknown checking 'elsewhere'"):
        DurabilitySpanProcessor(checking="elsewhere")  # type: ignore[arg-type]
    monkeypatch.setenv("DURABLE_SESSIONS_CHECKING", "process")
    processor = DurabilitySpanProcessor(mode="silent")
    assert processor.checking == "process"
    assert processor.checker is None
    processor.shutdown()


def test_no_checker_process_means_checking_inline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    seen: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=seen.append)
    assert processor.checking == "inline"
    assert "starting the checker process (checking inline instead)" in caplog.text
    provider, _ = provider_with(processor)
    with provider.get_tracer("t").start_as_current_span(
        "pay", attributes={sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}
    ):
        pass
    assert [v.rule for v in seen] == ["unkeyed-side-effect"]
    provider.shutdown()


def test_off_mode_starts_no_process() -> None:
    processor = DurabilitySpanProcessor(mode="off", checking="process")
    assert processor._offload is None
    assert processor.force_flush()


def checker_process(**options: Any) -> CheckerProcess:
    return CheckerProcess(select_rules(), key_window_s=86_400, max_sessions=10, **options)


def span_message(attributes: dict[str, Any]) -> tuple:
    return (SPAN, attributes, False, 1_700_000_000_000_000_000, 1_700_000_000_100_000_000, 1, 2, None)


@pytest.mark.parametrize(
    "violation",
    [
        Violation(
            "unkeyed-side-effect",
            Severity.ERROR,
            "m",
            "s",
            "a",
            trace_id="0" * 32,
            span_id="1" * 16,
            kind="payment",
        ),
        Violation("unreadable-line", Severity.WARNING, "bad — ü", None, None, file="x.jsonl", line=3),
    ],
)
def test_violations_cross_the_pipe_unchanged(violation: Violation) -> None:
    assert violation_from(violation_fields(violation)) == violation


_KEYS = st.sampled_from(
    [
        sc.ACTION_ID,
        sc.ACTION_KIND,
        sc.attribute("result"),
        sc.attribute("status"),
        sc.SESSION_ID,
        sc.GEN_AI_OPERATION_NAME,
        sc.GEN_AI_SYSTEM,
        sc.GEN_AI_PROVIDER_NAME,
        sc.GEN_AI_REQUEST_MODEL,
        sc.GEN_AI_TOOL_CALL_ID,
        sc.OPENINFERENCE_SPAN_KIND,
        sc.TRACELOOP_SPAN_KIND,
        sc.OUTPUT_VALUE,
        "http.request.method",
        "agent.action",
        "xagent.action.kind",
    ]
)
_VALUES = st.one_of(
    st.sampled_from(["chat", "LLM", "TOOL", "tool", "payment", "execute_tool", "embeddings"]),
    st.text(max_size=5),
    st.integers(),
    st.booleans(),
)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.dictionaries(st.one_of(_KEYS, st.text(max_size=12)), _VALUES, max_size=6))
def test_the_pre_filter_never_skips_an_action(attributes: dict[str, Any]) -> None:
    mapped = map_attributes(attributes, {}, False, 0, 1, 2, None, False)
    if mapped is not None:
        assert may_be_action(attributes)


def test_a_child_forked_from_a_forked_child_checks_its_spans_too(sender: str) -> None:
    """A worker forked from a worker that already started a checker of its own (a pool
    inside a preloaded server's worker) starts another: each process's spans are checked
    by its own checker, and none reaches another's."""
    found: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=found.append)
    provider, _ = provider_with(processor)
    tracer = provider.get_tracer("t")
    read_end, write_end = os.pipe()

    def pay(action_id: str) -> None:
        with tracer.start_as_current_span(
            "pay", attributes={sc.ACTION_ID: action_id, sc.ACTION_KIND: "payment"}
        ):
            pass

    def checked(action_id: str) -> str:
        found.clear()
        pay(action_id)
        flushed = processor.force_flush()
        return f"{flushed}:{','.join(v.action_id for v in found)}:{processor.actions_checked} "

    def grandchild() -> int:
        os.write(write_end, checked("grandchild").encode())
        provider.shutdown()
        return 0

    def child() -> int:
        os.write(write_end, checked("child").encode())
        code = exit_code_in_fork(grandchild)
        os.write(write_end, checked("child-again").encode())
        provider.shutdown()
        return code

    assert exit_code_in_fork(child, timeout_s=60) == 0
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read().decode().split() == [
            "True:child:1",
            "True:grandchild:1",
            "True:child-again:2",
        ]
    pay("parent")
    assert processor.wait_checked(timeout_s=30)
    assert processor.actions_checked == 1  # only the parent's span reached the parent's checker
    assert processor.spans_dropped == 0
    provider.shutdown()


def test_many_threads_ending_spans_at_once_are_all_checked(sender: str) -> None:
    import threading

    found: list[Violation] = []
    processor = DurabilitySpanProcessor(
        mode="silent", checking="process", on_violation=found.append, max_sessions=100
    )
    provider, _ = provider_with(processor)
    tracer = provider.get_tracer("t")

    def end_spans(thread: int) -> None:
        for n in range(1000):
            attributes = {sc.SESSION_ID: f"s-{thread}", sc.ACTION_ID: f"p{n}", sc.ACTION_KIND: "payment"}
            with tracer.start_as_current_span("pay", attributes=attributes):
                pass

    threads = [threading.Thread(target=end_spans, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert processor.wait_checked(timeout_s=60)
    assert processor.spans_dropped == 0
    assert processor.actions_checked == 6000
    assert len(found) == 6000  # every payment lacks a key: one finding each, none lost or doubled
    assert {(v.session_id, v.action_id) for v in found} == {
        (f"s-{t}", f"p{n}") for t in range(6) for n in range(1000)
    }
    provider.shutdown()
