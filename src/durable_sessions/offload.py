"""Checking in a child process, so the application only hands ended spans over.

``DurabilitySpanProcessor(checking="process")`` starts one checker process
(``python -m durable_sessions.offload``) and talks to it over two pipes:

- the application's threads hand each candidate span's parts to a sender and return
  (a full sender drops the span and counts it, it never blocks);
- the sender sends them in batches, every ``interval_s`` or sooner when a batch fills.
  The native sender (:mod:`durable_sessions._native`, a C extension built where a
  compiler is available) is the span processor's ``on_end`` itself: it encodes SDK
  spans in marshal's format and writes them from a thread that never takes the GIL.
  The pure-Python sender (:class:`_ThreadSender`, and ``DURABLE_SESSIONS_NATIVE=false``)
  queues message tuples and marshals them on a writer thread;
- the checker process maps and checks the spans with the same engine the inline mode
  uses (:func:`durable_sessions.span_check.check_span`) and sends back what it finds;
- a reader thread hands those findings to the processor's reporting (log, counter,
  callback), on that thread.

Frames in both directions are a 4-byte little-endian length and a :mod:`marshal`ed
list of messages. ``marshal`` keeps every attribute value type exactly (NaN, big
integers, tuples) and is safe here because both ends are the same interpreter.
Checking this way costs a second CPU's time instead of the application's; it cannot
raise into the application, so ``mode="raise"`` needs the inline mode.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import marshal
import os
import signal
import struct
import subprocess
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any

from opentelemetry.trace import SpanContext, StatusCode

from durable_sessions.engine import Checker
from durable_sessions.mapping import exact
from durable_sessions.native import native_module
from durable_sessions.rules import Rule, rule_references, rules_from_references
from durable_sessions.span_check import ACTION_KIND, ACTION_PREFIX, MAYBE_ACTION_KEYS, SpanParts, check_span
from durable_sessions.violation import Severity, Violation

SPAN, RESOURCE, END_SESSION, FINISH, SYNC = 0, 1, 2, 3, 4
"""Messages to the checker process: ``(SPAN, *SpanParts)``, ``(RESOURCE, attributes)``,
``(END_SESSION, token, session_id)``, ``(FINISH, token)``, ``(SYNC, token)``."""
FOUND, DONE, FAILED, READY = 0, 1, 2, 3
"""Messages back: ``(READY,)`` first, once the process can check,
``(FOUND, violations, spans checked so far)``,
``(DONE, token, violations, actions checked so far, spans checked so far)``, ``(FAILED, error)``."""

DEFAULT_QUEUE_LIMIT = 65_536
DEFAULT_BATCH_SIZE = 512
DEFAULT_INTERVAL_S = 0.05
CHECKER_NICENESS = 10
"""Added to the checker process's niceness: checking is background work."""
NATIVE_BYTES_PER_SPAN = 256
"""What the native sender budgets per span when it turns span counts into bytes."""
_HEADER = struct.Struct("<I")

Report = Callable[[list[Violation]], None]
ErrorHandler = Callable[[str, Exception], None]


def encode_frame(messages: list[Any]) -> bytes:
    """One frame of messages (raises ValueError for a value marshal cannot carry)."""
    data = marshal.dumps(messages)
    return _HEADER.pack(len(data)) + data


def write_frame(stream: IO[bytes], frame: bytes) -> None:
    """Send one encoded frame."""
    stream.write(frame)
    stream.flush()


def read_frame(stream: IO[bytes]) -> list[Any] | None:
    """The next frame's messages, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        return None
    return marshal.loads(data)


def violation_fields(violation: Violation) -> tuple:
    """A violation as plain values, for a frame."""
    return (
        violation.rule,
        violation.severity.value,
        violation.message,
        violation.session_id,
        violation.action_id,
        violation.file,
        violation.line,
        violation.trace_id,
        violation.span_id,
        violation.kind,
        violation.occurrence,
    )


def violation_from(fields: Iterable[Any]) -> Violation:
    """The inverse of :func:`violation_fields`."""
    rule, severity, *rest = fields
    return Violation(rule, Severity(severity), *rest)


_forks = [0]
"""How many times this process is a fork's child of the process that imported this module."""
_checkers: weakref.WeakSet[CheckerProcess] = weakref.WeakSet()
"""The checker processes this process started and has not closed."""


def _after_fork_in_child() -> None:
    _forks[0] += 1
    for checker in list(_checkers):
        checker._let_go_of_pipe()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _file_id(fd: int) -> tuple[int, int] | None:
    """What ``fd`` is open on (device and inode), or None when it is not open."""
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_dev, status.st_ino


class _ThreadSender:
    """Sends messages from a bounded queue, marshalled in batches by a writer thread.

    The pure-Python way; :class:`durable_sessions._native.Handoff` is the native one with
    the same methods, used when it was built.
    """

    def __init__(
        self,
        stream: IO[bytes],
        on_error: ErrorHandler,
        *,
        queue_limit: int,
        batch_size: int,
        interval_s: float,
    ) -> None:
        self._stream = stream
        self._on_error = on_error
        self._queue: deque[tuple] = deque()
        self._queue_limit = queue_limit
        self._batch_size = batch_size
        self._interval_s = interval_s
        self._wake = threading.Event()
        self._closing = False
        self.error: OSError | ValueError | None = None
        self.dropped = 0
        self.sent = 0
        """Span messages written to the stream."""
        self._generation = _forks[0]
        self._writer = threading.Thread(
            target=self._write_loop, name="durable_sessions.offload.writer", daemon=True
        )
        self._writer.start()

    def send(self, message: tuple, urgent: bool = False) -> bool:
        """Queue one message; never blocks. False when sending has stopped or, for a span,
        when the queue is full (a span not queued is counted in ``dropped``)."""
        queue = self._queue
        is_span = message[0] == SPAN
        if (
            (is_span and len(queue) >= self._queue_limit)
            or self.error is not None
            or self._closing
            or self._generation != _forks[0]  # a forked child: the writer thread is the parent's
        ):
            self.dropped += is_span
            return False
        queue.append(message)
        if urgent or len(queue) == self._batch_size:
            self._wake.set()
        return True

    def stop(self) -> None:
        """Refuse (and count) further messages; what is queued is still sent."""
        self._closing = True
        if self._generation == _forks[0]:  # a forked child leaves the parent's writer alone
            self._wake.set()

    def close(self, timeout_s: float) -> bool:
        """Send what is queued, then stop; False if still sending after ``timeout_s``.

        In a forked child it only stops: the writer thread, the stream and the locks they
        hold are the parent's (a lock taken by the writer at the fork is never released here).
        """
        self._closing = True
        if self._generation != _forks[0]:
            return True
        self._wake.set()
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            return False
        with contextlib.suppress(OSError):
            self._stream.close()
        return True

    def _write_loop(self) -> None:
        queue = self._queue
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while queue:
                batch = [queue.popleft() for _ in range(min(len(queue), self._batch_size * 8))]
                try:
                    frame, spans = self._encode(batch)
                    write_frame(self._stream, frame)
                    self.sent += spans
                except (OSError, ValueError) as error:
                    self.error = error
                    self.dropped += sum(message[0] == SPAN for message in (*batch, *queue))
                    self._on_error("sending spans to the checker process", error)
                    return
            if self._closing:
                return

    def _encode(self, batch: list[tuple]) -> tuple[bytes, int]:
        """``batch`` as a frame and the number of spans in it, leaving out (and counting)
        any message marshal cannot carry."""
        spans = sum(message[0] == SPAN for message in batch)
        try:
            return encode_frame(batch), spans
        except ValueError:
            kept = [message for message in batch if _can_marshal(message)]
            kept_spans = sum(message[0] == SPAN for message in kept)
            self.dropped += spans - kept_spans
            return encode_frame(kept), kept_spans


def _context_is_tuple() -> bool:
    """Whether a ``SpanContext`` keeps its trace and span ids as its first two items
    (it does, as a typed tuple); the native sender then reads them without a call."""
    context = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=False)
    return isinstance(context, tuple) and context[:2] == (context.trace_id, context.span_id)


def _native_sender(stream: IO[bytes], *, queue_limit: int, batch_size: int, interval_s: float) -> Any:
    """The native sender (:mod:`durable_sessions._native`), or None when it was not built
    or ``DURABLE_SESSIONS_NATIVE=false``."""
    native = native_module()
    if native is None:
        return None
    sender = native.Handoff(
        fd=stream.fileno(),  # duplicated: the sender's thread owns its copy
        span_op=SPAN,
        action_kind=ACTION_KIND,
        markers=tuple(MAYBE_ACTION_KEYS),
        prefix=ACTION_PREFIX,
        error_code=StatusCode.ERROR,
        batch_bytes=batch_size * NATIVE_BYTES_PER_SPAN,
        limit_bytes=queue_limit * NATIVE_BYTES_PER_SPAN,
        limit_count=queue_limit,
        interval_s=interval_s,
        context_is_tuple=_context_is_tuple(),
    )
    stream.close()  # the native sender's copy of the pipe is now the only one
    return sender


class CheckerProcess:
    """The application's side of a checker process.

    ``report`` receives the violations the process finds, on the reader thread.
    Raises ``OSError`` when no process can be started (``sys.executable`` unset, or no
    program); a setup that fails once the process is started kills and reaps it before
    raising (a thread that cannot start: ``RuntimeError`` for the reader and the
    pure-Python sender's writer, ``OSError`` for the native sender's). ``on_error`` is told when the process
    cannot be written to or read from, or dies; the checking then stops, and later spans
    are dropped and counted, never raised about. A span carrying a value ``marshal``
    cannot represent is dropped and counted.

    Spans go over through the native sender's ``on_end`` (see :meth:`span_handler`)
    when it was built, otherwise as messages given to :meth:`submit`.

    In a process forked from the one that started it, nothing of it runs: the child lets
    go of its copy of the checker's input at the fork (so the parent's :meth:`close`
    alone ends it), drops and counts its spans, and answers no request, quietly; the span
    processor starts a checker of the child's own instead.
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        key_window_s: float,
        max_sessions: int,
        report: Report,
        on_error: ErrorHandler,
        on_unstartable: ErrorHandler | None = None,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        batch_size: int = DEFAULT_BATCH_SIZE,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        config = {
            "rules": rule_references(rules),
            "key_window_s": key_window_s,
            "max_sessions": max_sessions,
        }
        self._report = report
        self._on_error = on_error
        self._on_unstartable = on_unstartable
        self._ready = False  # whether the process said it can check (READY)
        self._closing = False
        self._alive = True
        self._tokens = itertools.count(1)
        self._answers: dict[int, list[Violation]] = {}
        self._waiting: set[int] = set()
        self._answered = threading.Condition()
        self._generation = _forks[0]
        self.actions = 0
        """Actions the process had checked at its latest answer (``sync``, ``finish``, …)."""
        self._checked = 0  # spans the process has said it checked
        self._lost = False  # whether it stopped (or was stopped) before checking all it was sent
        if not sys.executable:  # None or "": the interpreter cannot say where a Python is (embedded)
            raise FileNotFoundError(
                errno.ENOENT, "sys.executable is not set: no Python to run the checker in"
            )
        with _group_signals_blocked():  # the checker starts with them held, until it ignores them
            self._process = subprocess.Popen(
                [sys.executable, "-m", "durable_sessions.offload", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=_checker_environment(),
            )
        try:
            self._connect({"queue_limit": queue_limit, "batch_size": batch_size, "interval_s": interval_s})
        except BaseException:  # a thread that cannot start: the process would wait for input for ever
            self._abandon()
            raise

    def _connect(self, sizes: dict[str, Any]) -> None:
        """Start the sender and the reader on the started process's pipes."""
        stdin: IO[bytes] = self._process.stdin  # type: ignore[assignment]
        pipe = _file_id(stdin.fileno())
        self._sender = _native_sender(stdin, **sizes) or _ThreadSender(stdin, self._fail, **sizes)
        self.native = not isinstance(self._sender, _ThreadSender)
        """Whether the native sender (:mod:`durable_sessions._native`) is in use."""
        # The sender's end of the pipe, which a forked child lets go of (_let_go_of_pipe).
        self._pipe = (self._sender.fd if self.native else stdin.fileno(), pipe)
        _checkers.add(self)
        self._reader = threading.Thread(
            target=self._read_loop, name="durable_sessions.offload.reader", daemon=True
        )
        self._reader.start()

    def _abandon(self) -> None:
        """Kill and reap the process of a setup that failed, and close its pipes."""
        _checkers.discard(self)
        self._alive = False
        self._process.kill()
        sender = getattr(self, "_sender", None)
        if sender is not None:  # its writes fail at once now: it ends, closing its copy of the pipe
            sender.close(_EXIT_WAIT_S)
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]

    @property
    def dropped(self) -> int:
        """Spans not checked: not sent (the queue was full, a value could not be sent, or
        the sending had stopped), or sent to a process that ended, or was ended, before it
        said it had checked them."""
        dropped = self._sender.dropped
        if self._lost and not self._forked():
            dropped += max(0, self._sender.sent - self._checked)
        return dropped

    def span_handler(self, fallback: Callable[[Any], None]) -> Callable[[Any], None] | None:
        """With the native sender, a ``SpanProcessor.on_end`` that hands an SDK span over
        without running Python code, and calls ``fallback(span)`` with any span it does not
        hand over (a resource it has not sent yet, a span that is not the SDK's, a value
        it does not encode). None with the pure-Python sender.
        """
        if not self.native:
            return None
        self._sender.fallback = fallback
        return self._sender.on_end

    def sent_resource(self, resource: object) -> None:
        """The spans of ``resource`` may now go over natively (its attributes were submitted)."""
        if self.native:
            self._sender.resource = resource

    def submit(self, message: tuple) -> None:
        """Queue one message for the checker process; never blocks, drops (and counts) when full."""
        self._sender.send(message)

    def end_session(self, session_id: str, timeout_s: float) -> list[Violation] | None:
        """End one session; its end-of-session violations, or None if no answer came in time.

        A ``str`` subclass (a ``StrEnum`` member) names the session of its text, as the
        inline checker's lookup finds it: marshal refuses the subclass itself."""
        session_id = exact(session_id)
        if not _can_marshal((END_SESSION, 0, session_id)):
            return []  # an id no attribute value can be, so no session's: nothing to ask (or wait) for
        return self._ask(lambda token: (END_SESSION, token, session_id), timeout_s)

    def sync(self, timeout_s: float) -> bool:
        """Wait until every message queued so far has been checked and its findings reported."""
        return self._ask(lambda token: (SYNC, token), timeout_s) is not None

    def finish(self, timeout_s: float) -> list[Violation] | None:
        """Check everything queued, then end every session; None if that took longer than ``timeout_s``."""
        return self._ask(lambda token: (FINISH, token), timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop sending, let the process finish what it was sent, and reap it.

        Called on the reader thread (from an ``on_violation`` callback), it does not wait
        for the reader, which ends once the callback returns. In a forked child it only
        stops: the process, the sender and the reader are the parent's.
        """
        self._closing = True
        if self.native:
            self._sender.fallback = None  # it refers back to the span processor
        if self._forked():
            self._sender.close(timeout_s)  # returns at once in a forked child
            self._alive = False
            return
        _checkers.discard(self)
        if not self._sender.close(timeout_s):  # stuck writing to a process that stopped reading
            self._lost = True
            self._process.kill()
            self._sender.close(timeout_s)
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._lost = True
            self._process.kill()
            self._process.wait()
        if threading.current_thread() is not self._reader:  # else closed from an on_violation callback
            self._reader.join(timeout_s)
        self._alive = False
        if not self._reader.is_alive():  # its input, read to the end: closed, not kept until collected
            with contextlib.suppress(OSError):
                self._process.stdout.close()  # type: ignore[union-attr]

    # -- internals -----------------------------------------------------------------

    def _forked(self) -> bool:
        """Whether this is a forked child of the process that started the checker."""
        return self._generation != _forks[0]

    def _let_go_of_pipe(self) -> None:
        """In a forked child (just after the fork): put ``/dev/null`` in place of the
        child's copy of the sender's end of the pipe, so that the parent's ``close`` alone
        ends the checker's input. The descriptor stays open (on ``/dev/null``) for the
        objects that still hold it; they never write to it in the child."""
        fd, pipe = self._pipe
        if fd < 0 or pipe is None or _file_id(fd) != pipe:
            return  # already closed in the parent, or its number reused
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)

    def _ask(self, make: Callable[[int], tuple], timeout_s: float) -> list[Violation] | None:
        if not self._alive or self._forked():  # a forked child's spans go unchecked, quietly
            return None
        token = next(self._tokens)
        with self._answered:
            self._waiting.add(token)
        if not self._sender.send(make(token), urgent=True):
            if self._sender.error is not None:
                self._fail("sending spans to the checker process", self._sender.error)
            return None
        if threading.current_thread() is self._reader:
            # Asked from an on_violation callback, which runs on the reader thread: the
            # answer can only be read once the callback returns (waiting here stalled every
            # report for the whole timeout). What it finds is reported as it arrives.
            with self._answered:
                self._waiting.discard(token)
            return None
        with self._answered:
            self._answered.wait_for(lambda: token in self._answers or not self._alive, timeout_s)
            self._waiting.discard(token)  # an answer arriving after the timeout is not kept
            return self._answers.pop(token, None)

    def _read_loop(self) -> None:
        stdout = self._process.stdout
        try:
            while (messages := read_frame(stdout)) is not None:  # type: ignore[arg-type]
                for message in messages:
                    self._receive(message)
        except (OSError, ValueError, EOFError, TypeError) as error:
            self._fail("reading the checker process's findings", error)
            return
        if not self._closing:
            self._fail(
                "the checker process", RuntimeError(f"it exited unexpectedly ({self._how_it_ended()})")
            )
        with self._answered:
            self._answered.notify_all()

    def _how_it_ended(self) -> str:
        """How the process ended, once its output closed: it may take a moment to exit."""
        try:
            code = self._process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return "it closed its output and is still running"
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"

    def _receive(self, message: tuple) -> None:
        if message[0] == FOUND:
            self._checked = message[2]
            self._report([violation_from(fields) for fields in message[1]])
        elif message[0] == DONE:
            violations = [violation_from(fields) for fields in message[2]]
            self.actions = message[3]
            self._checked = message[4]
            self._report(violations)
            with self._answered:
                if message[1] in self._waiting:
                    self._answers[message[1]] = violations
                self._answered.notify_all()
        elif message[0] == READY:
            self._ready = True
        else:
            self._on_error("the checker process", RuntimeError(message[1]))

    def _fail(self, where: str, error: Exception) -> None:
        """The process stopped checking: told to ``on_unstartable`` when it never said it
        was ready (it could not start: ``sys.executable`` is no Python, an import failed),
        to ``on_error`` otherwise."""
        if not self._alive or self._forked():
            return
        self._alive = False
        self._lost = True  # what it was sent and did not say it checked is counted dropped
        self._sender.stop()  # later spans are dropped and counted
        unstartable = not self._ready and self._on_unstartable is not None
        (self._on_unstartable if unstartable else self._on_error)(where, error)  # type: ignore[misc]
        with self._answered:
            self._answered.notify_all()


_EXIT_WAIT_S = 1.0
"""How long the reader waits for the exit code of a checker whose output closed."""


_GROUP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
"""Signals the checker process ignores: they reach it with its application's process group."""


def _group_signals() -> list[signal.Signals]:
    """:data:`_GROUP_SIGNALS` that this platform has."""
    return [getattr(signal, name) for name in _GROUP_SIGNALS if hasattr(signal, name)]


@contextlib.contextmanager
def _group_signals_blocked() -> Iterator[None]:
    """Block :data:`_GROUP_SIGNALS` in the calling thread while the block runs.

    A process started meanwhile inherits the blocked mask through ``exec``: a signal sent
    to the group while the checker is still starting (its interpreter and imports take a
    moment) waits, and is discarded when the checker ignores it, instead of killing it
    first. Other threads of the application take a signal meanwhile; this one acts on it
    once the block ends.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _group_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


IN_CHECKER_ENV = "DURABLE_SESSIONS_IN_CHECKER"
"""Set in a checker process's environment: a span processor built there starts no other.

Whatever runs in every Python process (``opentelemetry-instrument``'s ``sitecustomize``
and the configurator it loads, a ``.pth`` hook) runs in the checker process too; one
that builds ``DurabilitySpanProcessor(checking="process")`` started a checker from the
checker, and so on: a chain of processes that grew while the application ran and went
on growing after it exited (they ignore the signals a terminal or supervisor sends)."""


def _checker_environment() -> dict[str, str]:
    """The checker process's environment: this one, marked (:data:`IN_CHECKER_ENV`), with
    the directory this package was imported from first on ``PYTHONPATH`` when a new
    interpreter would not find it there (a vendored copy, a zipapp, a layer added to
    ``sys.path`` at run time), and not when the package is in a site-packages directory,
    which must not go ahead of the standard library."""
    import site

    env = {**os.environ, IN_CHECKER_ENV: "1"}

    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    try:
        sites = [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site module
        sites = []
    if any(os.path.abspath(directory) == root for directory in sites):
        return env
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _can_marshal(message: tuple) -> bool:
    try:
        marshal.dumps(message)
    except ValueError:
        return False
    return True


# -- the checker process -------------------------------------------------------------


class _Session:
    """The checker process's side: one engine, fed from frames."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.checker = Checker(
            rules_from_references(config["rules"]),
            key_window_s=config["key_window_s"],
            max_sessions=config["max_sessions"],
        )
        self.resource: Mapping[str, Any] = {}
        self.spans = 0
        """Span messages checked so far (each answer says so)."""

    def answer(self, messages: list[tuple]) -> list[tuple]:
        """The replies to one frame, in order: findings before the answer that follows them."""
        replies: list[tuple] = []
        found: list[tuple] = []
        for message in messages:
            op = message[0]
            if op == SPAN:
                self.spans += 1
                try:
                    found.extend(
                        map(
                            violation_fields, check_span(self.checker, SpanParts(*message[1:]), self.resource)
                        )
                    )
                except Exception as error:  # one bad span must not stop the checking
                    replies.append((FAILED, f"checking a span failed: {error!r}"))
            elif op == RESOURCE:
                self.resource = message[1]
            else:
                if found:
                    replies.append((FOUND, found, self.spans))
                    found = []
                try:
                    ended = [violation_fields(v) for v in self._ended(message)]
                except Exception as error:  # a session id the engine cannot look up (a list)
                    replies.append((FAILED, f"ending sessions failed: {error!r}"))
                    ended = []  # answered all the same: its caller is waiting
                replies.append((DONE, message[1], ended, self.checker.actions, self.spans))
        if found:
            replies.append((FOUND, found, self.spans))
        return replies

    def _ended(self, message: tuple) -> list[Violation]:
        if message[0] == END_SESSION:
            return self.checker.end_session(message[2])
        if message[0] == FINISH:
            return self.checker.finish()
        return []  # SYNC: only the findings before it


def main(argv: list[str] | None = None) -> int:
    """Run as the checker process: frames in on stdin, findings out on stdout."""
    args = sys.argv[1:] if argv is None else argv
    # This process ends when the application closes the pipe, never before it. Signals
    # sent to the whole process group are the application's to act on: Ctrl-C, the
    # SIGTERM of a supervisor that stops a group (systemd's default KillMode, supervisord's
    # stopasgroup), a closed terminal's SIGHUP. Killed by them, the checker would miss the
    # spans the application ends while it shuts down gracefully.
    # They were blocked since the process started (_group_signals_blocked): one that came
    # meanwhile is pending, and ignoring it discards it. They stay blocked, and ignored.
    for number in _group_signals():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(number, signal.SIG_IGN)
    # Checking is background work: where it competes with the application for a CPU,
    # the application goes first.
    with contextlib.suppress(OSError, AttributeError):
        os.nice(CHECKER_NICENESS)
    session = _Session(json.loads(args[0]))
    source = sys.stdin.buffer
    # Frames own the real stdout; anything printed goes to stderr instead of corrupting them.
    sink = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        write_frame(sink, encode_frame([(READY,)]))
    except BrokenPipeError:  # the application is gone already: nothing to check
        return 0
    while (messages := read_frame(source)) is not None:
        replies = session.answer(messages)
        if replies:
            write_frame(sink, encode_frame(replies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
