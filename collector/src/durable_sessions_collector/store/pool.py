"""Read connections, lent one read at a time to whichever thread reads the store.

The HTTP server runs every client connection in a thread of its own (each health probe,
each metrics scrape), so a read connection per thread would leave one open connection
behind per client — file descriptors for SQLite, server connections for PostgreSQL —
until the store closes. A pool keeps at most ``max_idle`` of them open between reads,
whatever the number of threads that came and went, and at most ``max_open`` at once, so
that a burst of clients cannot take all of a PostgreSQL server's connections.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from durable_sessions_collector.store.base import StoreError

Connection = TypeVar("Connection")

MAX_IDLE = 8
MAX_OPEN = 32
WAIT_S = 10.0


class ReadPool(Generic[Connection]):
    """Lends read connections; opens one when none is idle, closes those it cannot keep.

    ``usable`` tells whether an idle connection can be lent again (a PostgreSQL
    connection may have broken since). ``close`` must not raise. A reader that finds
    ``max_open`` connections lent out waits up to ``wait_s`` for one, then gets a
    :class:`StoreError` (answered as retryable).
    """

    def __init__(
        self,
        connect: Callable[[], Connection],
        close: Callable[[Connection], None],
        usable: Callable[[Connection], bool] = lambda connection: True,
        max_idle: int = MAX_IDLE,
        max_open: int = MAX_OPEN,
        wait_s: float = WAIT_S,
    ) -> None:
        self._connect = connect
        self._close = close
        self._usable = usable
        self.max_idle = max_idle
        self.max_open = max_open
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(max_open)
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.opened = 0
        """How many connections the pool has opened in all (for tests and metrics)."""

    @property
    def idle(self) -> int:
        return len(self._idle)

    @contextmanager
    def lend(self) -> Iterator[Connection]:
        """A connection for one read; it goes back to the pool (or is closed) afterwards."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise StoreError(f"all {self.max_open} read connections stayed busy for {self.wait_s:g} s")
        try:
            connection = self._take()
            try:
                yield connection
            finally:
                self._give_back(connection)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections; those lent out are closed when given back."""
        with self._lock:
            self._closed = True
        self.drop_idle()

    def drop_idle(self) -> None:
        """Close the idle connections, so that the next reads open new ones: after the
        server dropped one (a restart, a failover, a proxy's idle timeout) it has most
        likely dropped them all, and each would otherwise fail one read to tell."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            self._close(connection)

    def _take(self) -> Connection:
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                break
            if self._usable(connection):
                return connection
            self._close(connection)
        connection = self._connect()
        with self._lock:
            self.opened += 1
        return connection

    def _give_back(self, connection: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(connection)
                return
        self._close(connection)
