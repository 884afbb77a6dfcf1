"""One JSON object per line on standard error: operational events and alert lines alike.

Lines are written by one thread of the log's own, in the order they were logged, and
flushed. A thread that logs a line waits until it is written, as long as the stream
takes lines; once a write has been blocked for :data:`BLOCKED_WRITE_S` (the reader of a
standard-error pipe stalled, a log shipper is stuck), nobody waits on the log any more:
lines are queued, up to :data:`MAX_QUEUED_LINES`, and written once the stream takes
lines again; lines beyond that bound are **dropped** and counted
(:attr:`JsonLog.dropped`), and a ``log-lines-dropped`` line later says how many were
lost. So nothing — serving requests, committing records, a SIGTERM's clean stop — waits
on the log for long.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from durable_sessions_collector import jsontext

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}

BLOCKED_WRITE_S = 1.0
"""Longest a thread waits for its line to be written while the stream does not take it."""

MAX_QUEUED_LINES = 10_000
"""Lines held while the stream is blocked; more are dropped."""

CHUNK_LINES = 256
"""Most lines written (and flushed) in one write."""

IDLE_EXIT_S = 5.0
"""The log's thread ends after this long without a line; the next line starts another."""


class JsonLog:
    """Writes ``{"ts", "level", "event", ...}`` lines from a thread of its own; thread-safe.

    :meth:`write` (and :meth:`info` and the rest) returns once its line is written, or
    after ``blocked_write_s`` if the stream does not take it, or at once if the stream is
    already known to be blocked; with ``wait=False`` it never waits, and is safe to call
    from a signal handler (no lock that the interrupted code may hold is needed).
    :meth:`flush` waits for every line logged before it. See the module's docstring.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        level: str = "INFO",
        *,
        blocked_write_s: float = BLOCKED_WRITE_S,
        max_queued_lines: int = MAX_QUEUED_LINES,
    ) -> None:
        self.stream = stream
        self.threshold = LEVELS.get(level.upper(), 20)
        self.blocked_write_s = blocked_write_s
        self.max_queued_lines = max_queued_lines
        self.dropped = 0
        """Lines dropped because the stream was blocked and the queue full (since this log was made)."""
        self._drops = itertools.count(1)  # next() is atomic: no lock a signal handler could wait on
        self._reported = 0  # dropped lines already announced by a log-lines-dropped line
        # SimpleQueue.put is reentrant (a signal handler may log while its thread is in put).
        self._queue: queue.SimpleQueue[str | Callable[[], object]] = queue.SimpleQueue()
        self._writing_since: float | None = None  # monotonic start of the write in progress
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def enabled(self, level: str) -> bool:
        return LEVELS[level] >= self.threshold

    def write(self, level: str, event: str, *, force: bool = False, wait: bool = True, **fields: Any) -> None:
        """Log one line; with ``wait``, return once it is written (see the class)."""
        if not force and not self.enabled(level):
            return
        if self._queue.qsize() >= self.max_queued_lines:
            self.dropped = next(self._drops)
            return
        self._queue.put(self._line(level, event, fields))
        if wait:
            self.flush()
        else:
            self._ensure_thread()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line logged before this call is written; return whether it was.

        Waits at most ``timeout``; without one, at most ``blocked_write_s``, and not at all
        when the stream is already blocked.
        """
        if timeout is None:
            if self.stuck():
                self._ensure_thread()
                return False
            timeout = self.blocked_write_s
        written = threading.Event()
        self.then(written.set)
        return written.wait(timeout)

    def then(self, callback: Callable[[], object]) -> None:
        """Have the log's thread call ``callback`` right after the lines logged before this
        call are written (an exception it raises is ignored)."""
        self._queue.put(callback)
        self._ensure_thread()

    def stuck(self) -> bool:
        """Whether a write has been blocked in the stream for ``blocked_write_s`` or more."""
        since = self._writing_since
        return since is not None and time.monotonic() - since >= self.blocked_write_s

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        # A signal handler may run while its thread holds this lock: never wait for it. A
        # thread that holds it is starting a log thread, or keeping one (see _retire):
        # either way the line just queued is written.
        if not self._starting.acquire(blocking=False):
            return
        try:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="durable-sessions-log", daemon=True)
                self._thread = thread
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now: the next line tries again
                    self._thread = None
        finally:
            self._starting.release()

    def _run(self) -> None:
        while True:
            try:
                lines, callback = self._take()
            except queue.Empty:
                if self._retire():
                    return
                continue
            if lines:
                self._emit(lines)
            if callback is not None:
                with contextlib.suppress(Exception):  # the log has nowhere better to report it
                    callback()

    def _take(self) -> tuple[list[str], Callable[[], object] | None]:
        """The next lines to write (one get, waiting up to ``IDLE_EXIT_S``, then what else
        is queued), up to and including the first callback queued after them."""
        lines: list[str] = []
        item = self._queue.get(timeout=IDLE_EXIT_S)
        while isinstance(item, str):
            lines.append(item)
            if len(lines) >= CHUNK_LINES:
                return lines, None
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return lines, None
        return lines, item

    def _retire(self) -> bool:
        """The log's thread has been idle: whether it ends. It ends unless a line came
        meanwhile and no other thread was started for it."""
        self._thread = None  # from here on, whoever queues a line starts a thread...
        if self._queue.empty():
            return True  # ...so no line queued after this check waits for this one
        with self._starting:
            if self._thread is None:
                self._thread = threading.current_thread()
                return False
        return True

    def _emit(self, lines: list[str]) -> None:
        dropped = self.dropped
        if dropped > self._reported:  # say first what the blocked stream cost
            lost = {"dropped": dropped - self._reported, "dropped_total": dropped}
            lines.insert(0, self._line("WARNING", "log-lines-dropped", lost))
            self._reported = dropped
        stream = self.stream or sys.stderr
        self._writing_since = time.monotonic()
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # closed, or standard error is None: the line goes nowhere
        finally:
            self._writing_since = None

    @staticmethod
    def _line(level: str, event: str, fields: dict[str, Any]) -> str:
        return jsontext.dumps(
            {"ts": round(time.time(), 6), "level": level.lower(), "event": event, **fields},
            default=str,
            ensure_ascii=False,
            separators=(",", ":"),
        )

    def debug(self, event: str, **fields: Any) -> None:
        self.write("DEBUG", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.write("INFO", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.write("WARNING", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.write("ERROR", event, **fields)


REPEATED_FAILURE_EVERY_S = 60.0
"""Least time between two lines of one failure that repeats (:class:`RepeatedFailure`)."""


class RepeatedFailure:
    """The error lines of a failure that repeats (every write failing while the store is
    down): the first at once, then at most one every ``every_s``, rather than one per
    failure. Each line's ``failures`` counts the failures since the first, and once it
    is over (:meth:`ok`) a ``recovered`` info line gives their total. Every line has the
    ``context`` fields (the channel, say). Thread-safe."""

    def __init__(
        self,
        log: JsonLog,
        event: str,
        recovered: str,
        *,
        every_s: float = REPEATED_FAILURE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.log = log
        self.context = context or {}
        self.event = event
        self.recovered = recovered
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._logged_at = -float("inf")

    def failed(self, **fields: Any) -> None:
        """One more failure: logged with ``fields`` unless a line of it was less than
        ``every_s`` ago."""
        with self._lock:
            self._failures += 1
            failures, now = self._failures, self.clock()
            if now - self._logged_at < self.every_s:
                return
            self._logged_at = now
        self.log.error(self.event, **self.context, **fields, failures=failures)

    def ok(self) -> None:
        """It succeeded: the failure, if any, is over."""
        with self._lock:
            failures, self._failures, self._logged_at = self._failures, 0, -float("inf")
        if failures:
            self.log.info(self.recovered, **self.context, failures=failures)
