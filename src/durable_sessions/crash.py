"""Crash points: where the kill-and-resume harness kills an agent process.

The harness (:mod:`durable_sessions.harness`) runs the agent with
``DURABLE_SESSIONS_KILL_AT=<point>:<n>`` in its environment, and
:func:`durable_sessions.instrument.action` calls :func:`reached` at two boundaries of
every action the process really runs (replayed ones are not counted):

- ``before``: the write-ahead entry is in the journal, the action's body has not run;
- ``after``: the body has run (the side effect happened, the question was answered),
  its outcome is not yet in the journal.

At the ``n``-th such boundary of the process the global tracer provider is flushed (so
the spans that ended before the crash reach their exporter, as they would have in a
process that died a little later) and the process kills itself with ``SIGKILL``: no
``finally`` block, no ``atexit`` handler, no span end runs, as in a real crash. Without
the variable nothing happens here beyond one dictionary lookup per process.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Literal

from opentelemetry import trace as trace_api

logger = logging.getLogger("durable_sessions")

ENV = "DURABLE_SESSIONS_KILL_AT"
POINTS: tuple[str, ...] = ("before", "after")
Point = Literal["before", "after"]


def parse(value: str) -> tuple[str, int]:
    """``"after:3"`` → ``("after", 3)``; a ``ValueError`` names what is wrong."""
    point, _, count = value.partition(":")
    if point not in POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"{ENV}={value!r}: expected <point>:<n> with point one of {', '.join(POINTS)} and n ≥ 1"
        )
    return point, int(count)


class _Target:
    """The crash point of this process, read from its environment once."""

    def __init__(self) -> None:
        self.pid = -1
        self.point: str | None = None
        self.count = 0
        self.seen = 0

    def load(self) -> None:
        self.pid, self.point, self.seen = os.getpid(), None, 0
        value = os.environ.get(ENV)
        if not value:
            return
        try:
            self.point, self.count = parse(value)
        except ValueError as error:  # fail open: a bad setting must not stop the agent
            logger.warning("durable_sessions: %s; no crash point is set", error)


_TARGET = _Target()


def reached(point: Point) -> None:
    """Count a boundary of a running action; kill the process at the configured one."""
    if _TARGET.pid != os.getpid():  # a new process (or a forked child) reads its own setting
        _TARGET.load()
    if _TARGET.point is None:
        return
    if point == "before":
        _TARGET.seen += 1
    if point == _TARGET.point and _TARGET.seen == _TARGET.count:
        _die()


def _die() -> None:
    provider = trace_api.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        try:
            flush()
        except Exception:  # the crash goes ahead whatever the exporter does
            logger.debug("durable_sessions: flushing spans before the crash failed", exc_info=True)
    os.kill(os.getpid(), signal.SIGKILL)
