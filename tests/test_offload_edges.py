"""Regression tests for the edges of ``checking="process"`` and its lifecycle: a checker
process that is killed or stopped, queue overflow, very large values, forking,
environment variables and interpreter exit.

What they hold the processor to:

- every span handed to a checker that dies unchecked is counted in ``spans_dropped``:
  those still queued in the sender, and those already in the pipe or read by the
  checker but not yet reported as checked;
- a worker forked from a process with a checker lets go of its inherited copy of the
  checker's input, so the parent's ``shutdown`` still ends the checker promptly and
  cleanly while the worker lives on;
- a forked worker's ``shutdown`` never touches the parent's stream or its locks, so it
  cannot hang on a lock the parent's writer thread held at the fork;
- a forked worker checks its own spans in a checker process of its own, started at its
  first action span, quietly (no internal error, no "failing open" warning), and ends
  that checker at its shutdown or exit.

Each test runs with both senders (the native one and ``DURABLE_SESSIONS_NATIVE=false``)
unless it says otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from durable_sessions import processor as processor_module
from durable_sessions import semconv as sc
from durable_sessions.processor import ConfigurationError, DurabilitySpanProcessor
from durable_sessions.violation import Violation
from tests.support.forks import exit_code_in_fork
from tests.support.senders import use_sender
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
PAD = "x" * 200


@pytest.fixture(params=["native", "python"])
def sender(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_sender(monkeypatch, request.param)
    return request.param


class Run:
    """A provider (an in-memory exporter first) with a process-mode processor."""

    def __init__(self, **options: Any) -> None:
        self.found: list[Violation] = []
        options.setdefault("mode", "silent")
        options.setdefault("checking", "process")
        options.setdefault("on_violation", self.found.append)
        self.processor = DurabilitySpanProcessor(**options)
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("edges")

    @property
    def checker(self) -> subprocess.Popen:
        return self.processor._offload._process  # type: ignore[union-attr]

    def pay(self, n: int, *, session_id: str = "s", **extra: Any) -> None:
        attributes = {sc.SESSION_ID: session_id, sc.ACTION_ID: f"p{n}", sc.ACTION_KIND: "payment", **extra}
        with self.tracer.start_as_current_span("pay", attributes=attributes):
            pass


@pytest.fixture
def run(sender: str) -> Iterator[Run]:
    r = Run()
    assert r.processor.checking == "process"
    assert r.processor.wait_checked(timeout_s=30)  # the checker is up and answering
    yield r
    with contextlib.suppress(ProcessLookupError):
        os.kill(r.checker.pid, signal.SIGCONT)  # never leave a stopped checker behind
    r.provider.shutdown()


def pipe_fill(pid: int) -> tuple[int, int]:
    """(bytes waiting, capacity) of the pipe the checker process ``pid`` reads spans from."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        waiting = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
        return waiting, fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(fd)


def blocked_writing() -> bool:
    """Whether a thread of this process is blocked writing to a (full) pipe."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            if "pipe_write" in (task / "wchan").read_text():
                return True
    return False


def exited(pid: int) -> bool:
    """Whether ``pid`` is gone (or a zombie nobody reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


# -- a checker process that dies or stops ----------------------------------------------------


def test_sigkill_mid_run_fails_open_once_and_drops_later_spans(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    """Threads keep ending spans while the checker is killed: nothing raises into
    span.end(), the death is logged and counted once, later spans are counted dropped,
    and no restart is attempted (docs: "from then on drops spans")."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def end_spans(thread: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                run.pay(n, session_id=f"t{thread}")
                n += 1
        except BaseException as error:  # pragma: no cover - the failure being tested
            errors.append(error)

    threads = [threading.Thread(target=end_spans, args=(t,)) for t in range(4)]
    with caplog.at_level(logging.WARNING, logger="durable_sessions"):
        for thread in threads:
            thread.start()
        assert wait_until(lambda: len(run.exporter.get_finished_spans()) > 2000)
        pid = run.checker.pid
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: run.processor.internal_errors >= 1)
        dropped_at_death = run.processor.spans_dropped
        assert wait_until(lambda: run.processor.spans_dropped > dropped_at_death + 100)
        stop.set()
        for thread in threads:
            thread.join()
        assert wait_until(lambda: any("failing open" in r.getMessage() for r in caplog.records))
    assert errors == []
    assert run.processor.internal_errors == 1
    assert sum("failing open" in r.getMessage() for r in caplog.records) == 1
    assert run.checker.wait(timeout=30) == -signal.SIGKILL  # not restarted: the same, dead, process
    assert run.processor.wait_checked(timeout_s=5) is False
    started = time.monotonic()
    assert run.processor.force_flush(timeout_millis=30_000) is False
    run.provider.shutdown()
    assert time.monotonic() - started < 15  # not the flush's 30 s: a dead checker is not waited for


def test_spans_in_the_pipe_when_the_checker_dies_are_counted_as_dropped(run: Run) -> None:
    """Spans already written to the checker's pipe when it dies were never checked:
    ``spans_dropped`` counts every one of them."""
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    for n in range(100):
        run.pay(n)
    assert wait_until(lambda: pipe_fill(pid)[0] > 0)  # the batch is in the pipe
    if not run.processor.native:  # the pure-Python queue is empty once it was written
        assert wait_until(lambda: not run.processor._offload._sender._queue)  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: run.processor.internal_errors == 1)
    assert run.processor.force_flush(timeout_millis=1000) is False
    assert run.processor.actions_checked == 0  # none of them was checked …
    assert run.processor.spans_dropped == 100  # … so all of them are unchecked spans


def test_every_span_queued_or_in_the_pipe_when_the_checker_dies_is_counted(run: Run) -> None:
    """A full pipe and a full queue behind a stopped checker that is then killed: the
    spans in the sender's queue, in the frame being written, and in the pipe are all
    counted, none twice."""
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    for n in range(3000):
        run.pay(n, pad=PAD)
    assert wait_until(blocked_writing)  # the sender is stuck writing to the full pipe
    assert pipe_fill(pid)[0] > 0
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: run.processor.internal_errors == 1)
    assert wait_until(lambda: run.processor.spans_dropped == 3000)
    assert run.processor.force_flush(timeout_millis=1000) is False
    assert run.processor.actions_checked == 0
    assert run.processor.spans_dropped == 3000


def test_spans_checked_before_the_checker_dies_are_not_counted_as_dropped(run: Run) -> None:
    """Only what the checker had not reported as checked is counted when it dies."""
    for n in range(50):
        run.pay(n)
    assert run.processor.wait_checked(timeout_s=30)
    assert run.processor.actions_checked == 50
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    for n in range(50, 80):
        run.pay(n)
    assert wait_until(lambda: pipe_fill(pid)[0] > 0)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: run.processor.internal_errors == 1)
    assert wait_until(lambda: run.processor.spans_dropped == 30)
    run.provider.shutdown()
    assert run.processor.spans_dropped == 30


def test_force_flush_returns_within_its_timeout_when_the_checker_is_stopped(run: Run) -> None:
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    for n in range(500):
        run.pay(n)
    started = time.monotonic()
    assert run.processor.force_flush(timeout_millis=300) is False
    assert run.processor.wait_checked(timeout_s=0.3) is False
    assert time.monotonic() - started < 10  # returned, not waiting for the stopped checker for ever
    os.kill(pid, signal.SIGCONT)
    assert run.processor.wait_checked(timeout_s=30)  # nothing was lost by the timeouts
    assert run.processor.actions_checked == 500
    assert run.processor.spans_dropped == 0
    assert run.processor.internal_errors == 0


def test_shutdown_with_a_dead_checker_is_prompt_and_quiet(run: Run) -> None:
    run.pay(0)
    assert run.processor.wait_checked(timeout_s=30)
    run.checker.kill()
    run.checker.wait()
    assert wait_until(lambda: run.processor.internal_errors == 1)
    started = time.monotonic()
    run.processor.shutdown()  # must not raise
    assert time.monotonic() - started < processor_module.SHUTDOWN_CHECK_TIMEOUT_S  # not waited for
    assert run.processor.internal_errors == 1
    run.pay(1)  # after the processor's shutdown: ignored, never raised
    assert len(run.exporter.get_finished_spans()) == 2


def test_shutdown_with_a_stopped_checker_is_bounded(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checker that never answers (stopped, starved of CPU) held shutdown for 35 s; it
    waits SHUTDOWN_CHECK_TIMEOUT_S, then the process is stopped and its spans counted."""
    monkeypatch.setattr(processor_module, "SHUTDOWN_CHECK_TIMEOUT_S", 1.0)
    run.pay(0)
    assert run.processor.wait_checked(timeout_s=30)
    os.kill(run.checker.pid, signal.SIGSTOP)
    run.pay(1)
    started = time.monotonic()
    run.processor.shutdown()  # must not raise
    # The wait, then close's own bound of 5 s, with room for a loaded machine; below the
    # 10 + 5 s that a shutdown ignoring the wait's setting would take.
    assert time.monotonic() - started < 1.0 + 5 + 5
    assert run.checker.poll() is not None  # stopped and reaped, not left behind
    assert run.processor.spans_dropped == 1


# -- overflow, large values, many threads ----------------------------------------------------


def test_overflow_from_many_threads_is_dropped_counted_and_never_blocks(run: Run) -> None:
    """More than 65,536 spans behind a stopped checker: span.end() never waits, and every
    span is either checked (once the checker runs again) or counted in spans_dropped."""
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    per_thread, threads = 9_000, 8
    slow_ends: list[int] = []

    def end_spans(thread: int) -> None:
        slow = 0
        for n in range(per_thread):
            started = time.perf_counter()
            run.pay(n, session_id=f"t{thread}")
            slow += time.perf_counter() - started > 1.0
        slow_ends.append(slow)

    workers = [threading.Thread(target=end_spans, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    total = per_thread * threads
    assert run.processor.spans_dropped > 0
    # A stopped checker never blocks span.end(): an end that waited for room would make
    # every dropped span (thousands) slow. Some slow ends are the scheduler's, on a loaded
    # machine (one took 2 s at a load average of 9).
    assert sum(slow_ends) < run.processor.spans_dropped // 10, (sum(slow_ends), run.processor.spans_dropped)
    os.kill(pid, signal.SIGCONT)
    # Over 65,536 spans to check: more than 60 s with the Python sender on a loaded machine.
    assert run.processor.wait_checked(timeout_s=300)
    assert run.processor.actions_checked + run.processor.spans_dropped == total
    assert run.processor.actions_checked >= 65_536  # the queue held its documented size
    assert len(run.exporter.get_finished_spans()) == total
    assert run.processor.internal_errors == 0


def test_native_queue_is_bounded_at_16_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    use_sender(monkeypatch, "native")
    r = Run()
    assert r.processor.native
    pid = r.checker.pid
    assert r.processor.wait_checked(timeout_s=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        for n in range(12_000):  # about 2 KiB each: 24 MiB, far below 65,536 spans
            r.pay(n, pad="y" * 2048)
        assert r.processor.spans_dropped > 0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.processor.wait_checked(timeout_s=60)
    checked = r.processor.actions_checked
    assert checked + r.processor.spans_dropped == 12_000
    assert checked * 2048 < 18 * 2**20  # about 16 MiB (and what the pipe held) got through
    r.provider.shutdown()


def test_a_very_large_attribute_value_is_checked(run: Run) -> None:
    run.pay(0, note="z" * (20 * 2**20))  # 20 MiB: larger than the native queue's limit
    assert run.processor.wait_checked(timeout_s=60)
    assert run.processor.actions_checked == 1
    assert run.processor.spans_dropped == 0
    assert [(v.rule, v.action_id) for v in run.found] == [("unkeyed-side-effect", "p0")]


# -- fork ----------------------------------------------------------------------------------------


def shutdown_while_forked(run: Run, child: int, release: int) -> tuple[subprocess.Popen[bytes], float]:
    """Shut ``run``'s provider down while the forked ``child`` lives on, then let the child
    go (close ``release``, the pipe it reads) and reap it: the checker's process and how
    long the shutdown took."""
    try:
        checker = run.checker
        started = time.monotonic()
        run.provider.shutdown()
        return checker, time.monotonic() - started
    finally:
        os.close(release)
        os.waitpid(child, 0)


def test_a_forked_child_that_lives_on_does_not_delay_the_parents_shutdown(run: Run) -> None:
    """A worker forked after the processor started lets go of its inherited copy of the
    checker's input: while it lives, the parent's shutdown still ends the checker's input,
    so the checker exits by itself (0, not killed) and promptly."""
    release_read, release_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a long-lived worker: waits until the parent lets it go
        try:
            os.close(release_write)
            os.read(release_read, 1)
        finally:
            os._exit(0)
    os.close(release_read)
    checker, took = shutdown_while_forked(run, pid, release_write)
    assert checker.returncode == 0, f"the checker was killed (exit code {checker.returncode})"
    assert took < 5, f"shutdown took {took:.1f} s"  # below close's wait for a checker that does not exit
    assert run.processor.internal_errors == 0


def test_a_forked_grandchild_also_leaves_the_parents_checker_alone(run: Run) -> None:
    """A child forks again and both live on: the parent's shutdown is still prompt and clean."""
    release_read, release_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(release_write)
            if os.fork() == 0:
                os.read(release_read, 1)
                os._exit(0)
            os.read(release_read, 1)
            os.wait()
        finally:
            os._exit(0)
    os.close(release_read)
    checker, took = shutdown_while_forked(run, pid, release_write)
    assert checker.returncode == 0
    assert took < 5


def test_a_forked_child_can_shut_down_while_the_parent_is_mid_write(run: Run, sender: str) -> None:
    """The child is forked while the parent's sender is blocked writing to a full pipe
    (holding the stream's lock, with the Python sender): the child checks its own span
    and shuts down (what the SDK's atexit hook runs as a worker exits) without touching
    the parent's stream, and the parent's spans all arrive, uncorrupted."""
    pid = run.checker.pid
    os.kill(pid, signal.SIGSTOP)
    for n in range(3000):
        run.pay(n, pad=PAD)
    assert wait_until(blocked_writing)  # the writer is blocked mid-write

    def child() -> int:
        run.found.clear()
        run.pay(-1)
        flushed = run.processor.force_flush(timeout_millis=30_000)
        run.provider.shutdown()
        return 0 if flushed and [v.action_id for v in run.found] == ["p-1"] else 1

    assert exit_code_in_fork(child, timeout_s=30) == 0
    os.kill(pid, signal.SIGCONT)
    assert run.processor.wait_checked(timeout_s=30)  # the parent is unaffected
    assert run.processor.actions_checked == 3000


def test_a_forked_child_checks_its_spans_in_a_checker_of_its_own(
    run: Run, sender: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker forked from a process with a checker (a server that preloads the app,
    celery's prefork pool) starts a checker of its own at its first action span, as the
    SDK's batch processor starts a worker thread of its own: its spans are checked and
    reported in the child, its flush waits for them, and its shutdown ends that checker.
    Its spans went unchecked before (counted in spans_dropped), so under a preloading
    server nothing was ever checked. Nothing is logged, no internal error is counted,
    and the parent's checker is untouched."""
    read_end, write_end = os.pipe()
    parents_checker = run.checker

    def child() -> int:
        run.found.clear()  # the parent's, copied at the fork
        with caplog.at_level(logging.DEBUG, logger="durable_sessions"):
            for n in range(3):
                run.pay(n)
            flushed = run.processor.force_flush(timeout_millis=30_000)
            checker = run.checker
            run.provider.shutdown()
        result = {
            "flushed": flushed,
            "found": [(v.rule, v.action_id) for v in run.found],
            "dropped": run.processor.spans_dropped,
            "errors": run.processor.internal_errors,
            "records": [record.getMessage() for record in caplog.records],
            "own checker": checker.pid != parents_checker.pid,
            "its exit code": checker.returncode,
        }
        os.write(write_end, json.dumps(result).encode())
        return 0

    assert exit_code_in_fork(child, timeout_s=60) == 0
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        result = json.loads(reader.read())
    assert result == {
        "flushed": True,
        "found": [["unkeyed-side-effect", f"p{n}"] for n in range(3)],
        "dropped": 0,
        "errors": 0,
        "records": [],
        "own checker": True,
        "its exit code": 0,  # ended by the child's shutdown, not killed
    }, sender
    run.pay(99)  # the parent's checker is untouched and saw none of the child's spans
    assert run.processor.wait_checked(timeout_s=30)
    assert run.checker is parents_checker
    assert run.processor.actions_checked == 1
    assert run.processor.internal_errors == 0


def test_a_forked_child_that_exits_without_shutdown_leaves_no_checker_behind(run: Run) -> None:
    """A worker that ends by ``os._exit`` (as multiprocessing's do), with no shutdown,
    closes its checker's input by exiting: its checker ends too, and the parent's goes on."""
    read_end, write_end = os.pipe()

    def child() -> int:
        run.pay(1)
        os.write(write_end, str(run.checker.pid).encode())
        return 0

    assert exit_code_in_fork(child) == 0
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        childs_checker = int(reader.read())
    assert childs_checker != run.checker.pid
    assert wait_until(lambda: exited(childs_checker)), "the child's checker outlived it"
    run.pay(2)
    assert run.processor.wait_checked(timeout_s=30)
    assert run.processor.actions_checked == 1


# -- configuration from the environment ---------------------------------------------------------


def test_environment_configures_process_mode(monkeypatch: pytest.MonkeyPatch, sender: str) -> None:
    monkeypatch.setenv("DURABLE_SESSIONS_CHECKING", " process ")
    monkeypatch.setenv("DURABLE_SESSIONS_MAX_SESSIONS", "1")
    monkeypatch.setenv("DURABLE_SESSIONS_DISABLE", "unkeyed-side-effect")
    found: list[Violation] = []
    processor = DurabilitySpanProcessor(mode="silent", on_violation=found.append)
    assert processor.checking == "process"
    assert processor.checker is None
    assert processor.native == (sender == "native")
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("env")
    for session_id in ("s-1", "s-2"):  # an unfinished email each; s-2 evicts s-1 (max 1)
        attributes = {
            sc.SESSION_ID: session_id,
            sc.ACTION_ID: "e1",
            sc.ACTION_KIND: "email",
            sc.attribute("status"): "started",
        }
        with tracer.start_as_current_span("email", attributes=attributes):
            pass
        with tracer.start_as_current_span(  # unkeyed, but that rule is disabled
            "pay", attributes={sc.SESSION_ID: session_id, sc.ACTION_ID: "p", sc.ACTION_KIND: "payment"}
        ):
            pass
    assert processor.wait_checked(timeout_s=30)
    assert [(v.rule, v.session_id) for v in found] == [("unresolved-side-effect", "s-1")]
    provider.shutdown()  # ends s-2 too
    assert [(v.rule, v.session_id) for v in found] == [
        ("unresolved-side-effect", "s-1"),
        ("unresolved-side-effect", "s-2"),
    ]


def test_environment_mode_raise_or_off_with_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_SESSIONS_CHECKING", "process")
    monkeypatch.setenv("DURABLE_SESSIONS_MODE", "raise")
    with pytest.raises(ConfigurationError, match='needs checking="inline"'):
        DurabilitySpanProcessor()
    monkeypatch.setenv("DURABLE_SESSIONS_MODE", "off")
    processor = DurabilitySpanProcessor()
    assert processor._offload is None  # no process for a processor that does nothing
    assert processor.force_flush()
    monkeypatch.setenv("DURABLE_SESSIONS_MODE", "silent")
    monkeypatch.setenv("DURABLE_SESSIONS_CHECKING", "elsewhere")
    with pytest.raises(ConfigurationError, match="unknown checking"):
        DurabilitySpanProcessor()


# -- interpreter exit without shutdown --------------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from opentelemetry.sdk.trace import TracerProvider
    from durable_sessions import semconv as sc
    from durable_sessions.processor import DurabilitySpanProcessor

    def found(violation):
        os.write(1, f"found {violation.rule}\\n".encode())

    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=found)
    provider = TracerProvider(shutdown_on_exit=sys.argv[1] == "atexit")
    provider.add_span_processor(processor)
    attributes = {sc.SESSION_ID: "s", sc.ACTION_ID: "e1", sc.ACTION_KIND: "email",
                  sc.attribute("status"): "started"}
    with provider.get_tracer("t").start_as_current_span("email", attributes=attributes):
        pass
    print("checker", processor._offload._process.pid, flush=True)
    """
)


@pytest.mark.parametrize("exit_path", ["atexit", "no-shutdown"])
def test_interpreter_exit_without_shutdown(sender: str, exit_path: str) -> None:
    """The application exits without calling shutdown: it does not hang, the checker
    process ends too, and with the SDK's atexit hook the end-of-session finding is
    reported on the way out."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, exit_path],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 15
    lines = done.stdout.splitlines()
    checker = int(next(line for line in lines if line.startswith("checker")).split()[1])
    assert wait_until(lambda: exited(checker)), "the checker process outlived the app"
    reported = [line for line in lines if line.startswith("found")]
    assert reported == (["found unresolved-side-effect"] if exit_path == "atexit" else [])
    assert "Traceback" not in done.stderr


# -- how the checker ended, and where it imports the package from -----------------------------


def test_a_checker_killed_by_a_signal_is_said_to_be(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    """Not "exit code None" (read before the process had exited) nor "exit code -9"."""
    with caplog.at_level(logging.WARNING, logger="durable_sessions"):
        os.kill(run.checker.pid, signal.SIGKILL)
        assert wait_until(lambda: run.processor.internal_errors >= 1)
    assert "it exited unexpectedly (killed by SIGKILL)" in caplog.text


def test_the_checker_finds_a_package_imported_from_a_directory_put_on_sys_path(tmp_path: Path) -> None:
    """A vendored copy (a directory added to ``sys.path`` at run time, as a zipapp or a
    Lambda layer is), in an interpreter that does not have the package installed: the
    checker process must import the same copy."""
    bare = tmp_path / "bare"  # an interpreter with nothing installed
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    vendor = tmp_path / "vendor"  # the package and its dependencies, as `pip install --target` lays them out
    vendor.mkdir()
    site_packages = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    for entry in site_packages.iterdir():
        if not entry.name.startswith(("durable_sessions", "__editable__", "_durable_sessions")):
            (vendor / entry.name).symlink_to(entry)
    (vendor / "durable_sessions").symlink_to(ROOT / "src" / "durable_sessions")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(vendor)!r})
        from opentelemetry.sdk.trace import TracerProvider
        from durable_sessions.processor import DurabilitySpanProcessor
        found = []
        processor = DurabilitySpanProcessor(checking="process", mode="silent", on_violation=found.append)
        provider = TracerProvider()
        provider.add_span_processor(processor)
        attributes = {{"session.id": "s", "agent.action.id": "p1", "agent.action.kind": "payment"}}
        with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
            pass
        flushed = processor.force_flush(20_000)
        print(flushed, processor.checking, sorted({{v.rule for v in found}}), processor.internal_errors)
        provider.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(bare / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2)[:2] == ["True", "process"], done.stdout + done.stderr
    assert "unkeyed-side-effect" in done.stdout and done.stdout.strip().endswith(" 0"), done.stdout


_GROUP_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, select, signal, sys
    from opentelemetry.sdk.trace import TracerProvider
    from durable_sessions import semconv as sc
    from durable_sessions.processor import DurabilitySpanProcessor

    # A graceful shutdown, told through a pipe the signal writes to. A handler that set a
    # threading.Event could run while this thread held the Event's lock on its way into
    # wait(), and wait for that lock for ever.
    told, tell = os.pipe()
    os.set_blocking(tell, False)
    signal.set_wakeup_fd(tell)
    signal.signal(getattr(signal, sys.argv[1]), lambda *_: None)
    found = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=found.append)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    assert processor.wait_checked(30)
    print("ready", flush=True)
    assert select.select([told], [], [], 30)[0]
    attributes = {sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}  # unkeyed
    with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
        pass
    provider.shutdown()
    print("found", sorted({v.rule for v in found}), "errors", processor.internal_errors, flush=True)
    """
)


def _started_as_a_service(script: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """``python -c script args`` in a process group of its own, as a service has, with
    ``env`` added to this environment and its output piped (as text)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
        start_new_session=True,
    )


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_process_group_leaves_the_checker_to_the_applications_shutdown(
    sender: str, signal_name: str
) -> None:
    """A supervisor that stops a service signals its whole process group (systemd's default
    ``KillMode=control-group``, supervisord's ``stopasgroup``, ``kill -- -PGID``, a closed
    terminal's SIGHUP): the checker process must outlive the signal, so that the spans the
    application ends while it shuts down gracefully are still checked, with no internal
    error. The checker ends when the application closes its input, as after Ctrl-C."""
    app = _started_as_a_service(_GROUP_SIGNAL_SCRIPT, {"PYTHONPATH": str(ROOT / "src")}, signal_name)
    try:
        assert app.stdout is not None and app.stdout.readline().strip() == "ready"
        os.killpg(app.pid, getattr(signal, signal_name))
        out, err = app.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(app.pid, signal.SIGKILL)
    assert app.returncode == 0, err
    assert out.splitlines()[-1] == "found ['unkeyed-side-effect'] errors 0", err
    assert "failing open" not in err


_HELD_IN_STARTUP = """
# Run in the checker process before its main(): its start-up held until the application,
# which has signalled its process group meanwhile, writes to the FIFO.
import os
if os.environ.get("DURABLE_SESSIONS_IN_CHECKER"):
    with open(os.environ["STARTUP_FIFO"], "rb") as fifo:
        fifo.read(1)
"""

_SIGNAL_IN_STARTUP_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from opentelemetry.sdk.trace import TracerProvider
    from durable_sessions import semconv as sc
    from durable_sessions.processor import DurabilitySpanProcessor

    signal.signal(signal.SIGTERM, lambda *_: None)  # the application shuts down gracefully
    startup = os.open(os.environ["STARTUP_FIFO"], os.O_RDWR)  # open at once, read by the checker
    found = []
    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=found.append)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    os.killpg(0, signal.SIGTERM)  # a supervisor stops the group while the checker starts
    os.write(startup, b"x")  # the checker goes on starting
    ready = processor.wait_checked(60)
    attributes = {sc.SESSION_ID: "s", sc.ACTION_ID: "p1", sc.ACTION_KIND: "payment"}  # unkeyed
    with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
        pass
    checking = processor.checking
    provider.shutdown()
    print(ready, checking, sorted({v.rule for v in found}), "errors", processor.internal_errors, flush=True)
    """
)


def test_a_signal_to_the_process_group_while_the_checker_starts_leaves_it_running(
    sender: str, tmp_path: Path
) -> None:
    """The checker ignores the group's signals from its main() on; one that came while it
    was starting (the application stopped by its supervisor just after it started) killed
    it, and the processor checked inline, logging a checker that "could not start"."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HELD_IN_STARTUP)
    fifo = tmp_path / "startup.fifo"
    os.mkfifo(fifo)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")]), "STARTUP_FIFO": str(fifo)}
    app = _started_as_a_service(_SIGNAL_IN_STARTUP_SCRIPT, env)
    try:
        out, err = app.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(app.pid, signal.SIGKILL)
    assert app.returncode == 0, err
    assert out.splitlines()[-1] == "True process ['unkeyed-side-effect'] errors 0", err
    assert "failing open" not in err


_EVERY_PROCESS = """
# What opentelemetry-instrument's sitecustomize (and the configurator it loads) does: run
# in every Python process started with this PYTHONPATH, the checker process included.
import os
from durable_sessions.processor import DurabilitySpanProcessor
_PROCESSOR = DurabilitySpanProcessor(mode="silent", checking="process")
with open(os.environ["STARTED_LOG"], "a") as log:
    log.write(f"{os.getpid()} {_PROCESSOR.checking}\\n")
"""


def test_a_processor_built_in_every_process_does_not_start_a_chain_of_checkers(tmp_path: Path) -> None:
    """A processor built by a sitecustomize runs in the checker process too, which started
    a checker of its own, which started another: a chain that grew for as long as it ran,
    after the application had exited too. In a checker process it now checks inline."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_EVERY_PROCESS)
    started = tmp_path / "started.log"
    env = {**os.environ, "PYTHONPATH": str(site), "STARTED_LOG": str(started)}
    app = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3)"], env=env, start_new_session=True
    )
    try:
        assert app.wait(60) == 0
        # The app's checker writes its line once it has started, which on a loaded machine
        # can be after the app has exited.
        assert wait_until(lambda: len(started.read_text().splitlines()) >= 2), (
            "the app's checker never started"
        )
        time.sleep(1)  # what a chain would have grown by meanwhile
        lines = started.read_text().splitlines()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(app.pid, signal.SIGKILL)  # the whole chain: it is in the app's group
    assert [line.split()[1] for line in lines] == ["process", "inline"]  # the app, then its one checker
    assert lines[0].split()[0] == str(app.pid)
