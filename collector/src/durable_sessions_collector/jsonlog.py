"""One JSON object per line on standard error: operational events and alert lines alike.

A line is written synchronously, by the thread that logs it, and flushed. When the stream
stops taking lines (the reader of a standard-error pipe stalled, a log shipper is stuck),
the thread writing blocks in the write; every other thread gives up after
:data:`BLOCKED_WRITE_S` and **drops** its line instead of waiting, so that nothing —
serving requests, a SIGTERM's clean stop — waits on the log forever. Dropped lines are
counted (:attr:`JsonLog.dropped`), and once the stream takes lines again a
``log-lines-dropped`` line says how many were lost.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}

BLOCKED_WRITE_S = 1.0
"""Longest a line waits for the stream while another line's write is blocked in it."""


class JsonLog:
    """Writes ``{"ts", "level", "event", ...}`` lines; thread-safe, flushed per line.

    A line that cannot be written within ``blocked_write_s`` because the stream is blocked
    (another thread's write of a line has not returned) is dropped and counted in
    :attr:`dropped`; see the module's docstring.
    """

    def __init__(
        self, stream: TextIO | None = None, level: str = "INFO", *, blocked_write_s: float = BLOCKED_WRITE_S
    ) -> None:
        self.stream = stream
        self.threshold = LEVELS.get(level.upper(), 20)
        self.blocked_write_s = blocked_write_s
        self.dropped = 0
        """Lines dropped because the stream was blocked (since this log was made)."""
        self._reported = 0  # dropped lines already announced by a log-lines-dropped line
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._writing_since: float | None = None  # monotonic start of the write in progress

    def enabled(self, level: str) -> bool:
        return LEVELS[level] >= self.threshold

    def write(self, level: str, event: str, *, force: bool = False, **fields: Any) -> None:
        if not force and not self.enabled(level):
            return
        line = self._line(level, event, fields)
        if not self._acquire():
            with self._count_lock:
                self.dropped += 1
            return
        try:
            self._writing_since = time.monotonic()
            stream = self.stream or sys.stderr
            dropped = self.dropped
            if dropped > self._reported:  # say first what the blocked stream cost
                lost = {"dropped": dropped - self._reported, "dropped_total": dropped}
                line = self._line("WARNING", "log-lines-dropped", lost) + "\n" + line
                self._reported = dropped
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass
        finally:
            self._writing_since = None
            self._lock.release()

    def _acquire(self) -> bool:
        """Take the stream, waiting at most until the write in progress has been blocked
        for ``blocked_write_s``: once it has, give up at once."""
        if self._lock.acquire(blocking=False):
            return True
        since = self._writing_since
        wait = self.blocked_write_s if since is None else since + self.blocked_write_s - time.monotonic()
        return self._lock.acquire(timeout=max(0.0, wait))

    def stuck(self) -> bool:
        """Whether a line's write is blocked in the stream (the stream is still not free
        after waiting as :meth:`write` would)."""
        if self._acquire():
            self._lock.release()
            return False
        return True

    @staticmethod
    def _line(level: str, event: str, fields: dict[str, Any]) -> str:
        return json.dumps(
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
