"""Crash points: where the kill-and-resume harness kills an agent process.

The harness (:mod:`durable_sessions.harness`) runs the agent with
``DURABLE_SESSIONS_KILL_AT=<point>:<n>`` in its environment, and
:func:`durable_sessions.instrument.action` calls :func:`before` and :func:`after` at two
boundaries of every action the process really runs (replayed ones are not counted),
numbered by the order in which the actions started:

- ``before``: the write-ahead entry is in the journal, the action's body has not run;
- ``after``: the body has run (the side effect happened, the question was answered),
  its outcome is not yet in the journal.

At the ``n``-th such boundary of the run the global tracer provider is flushed, and
so is every provider an action of the process was given (``tracer_provider=``), so
that the spans that ended before the crash reach their exporter, as they would have in
a process that died a little later; then the process kills itself with ``SIGKILL``: no
``finally`` block, no ``atexit`` handler, no span end runs, as in a real crash. Without
the harness's variables an action only counts its boundary (an environment lookup once
per process, a process id check and an increment per action).
"""

from __future__ import annotations

import logging
import os
import signal
import weakref

from opentelemetry import trace as trace_api

logger = logging.getLogger("durable_sessions")

ENV = "DURABLE_SESSIONS_KILL_AT"
COUNT_ENV = "DURABLE_SESSIONS_COUNT_BOUNDARIES"
"""A file to which each boundary appends a line: how the harness counts a reference run's."""
POINTS: tuple[str, ...] = ("before", "after")


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
        self.counting: str | None = None

    def load(self) -> None:
        self.pid, self.point, self.seen = os.getpid(), None, 0
        self.counting = os.environ.get(COUNT_ENV) or None
        value = os.environ.get(ENV)
        if not value:
            return
        try:
            self.point, self.count = parse(value)
        except ValueError as error:  # fail open: a bad setting must not stop the agent
            logger.warning("durable_sessions: %s; no crash point is set", error)


_TARGET = _Target()
_BEFORE_LINE = b"b\n"


def before(provider: object | None = None) -> int:
    """The boundary before a running action's body: count it, and die here if it is the
    configured one. Returns its number, for :func:`after`. ``provider``: the tracer
    provider the action was given, if any, flushed with the global one at the crash.

    Under the harness (``DURABLE_SESSIONS_COUNT_BOUNDARIES`` set) boundaries are numbered
    across every process of the run, by the order their lines land in that file, so an
    agent whose actions run in worker processes is numbered as the reference run counted
    it; otherwise within this process.
    """
    target = _target()
    if provider is not None and target.point is not None:
        _note_provider(provider)
    if target.counting is None:
        target.seen += 1
        number = target.seen
    else:
        number = _append(target.counting, _BEFORE_LINE) // len(_BEFORE_LINE) or target.seen + 1
        target.seen = number
    if target.point == "before" and number == target.count:
        _die()
    return number


def after(boundary: int) -> None:
    """The boundary after the body of the action whose :func:`before` returned ``boundary``
    (an action that ran others inside it has its own number, not theirs)."""
    target = _target()
    if target.counting is not None:
        _append(target.counting + AFTER_SUFFIX, f"{boundary}\n".encode())
    if target.point == "after" and boundary == target.count:
        _die()


AFTER_SUFFIX = ".after"
"""The file beside the count file that lists the boundaries whose ``after`` was passed."""


def counted(path: str | os.PathLike[str]) -> tuple[int, set[int]]:
    """What a run counted in ``path`` (its ``DURABLE_SESSIONS_COUNT_BOUNDARIES``): how many
    boundaries it passed, and the numbers of those whose ``after`` it passed too."""
    try:
        passed = os.stat(path).st_size // len(_BEFORE_LINE)
    except FileNotFoundError:
        return 0, set()
    try:
        with open(os.fspath(path) + AFTER_SUFFIX) as afters:
            lines = afters.read().split()
    except FileNotFoundError:
        lines = []
    return passed, {int(line) for line in lines if line.isdigit()}


def _target() -> _Target:
    if _TARGET.pid != os.getpid():  # a new process (or a forked child) reads its own setting
        _TARGET.load()
    return _TARGET


def _append(path: str, line: bytes) -> int:
    """Append ``line`` to ``path``; the file's size right after it (0 when it cannot be written).

    ``O_APPEND`` puts each write at the end, whichever process writes, and leaves this
    descriptor's offset just after its own line: the line's place in the file.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:  # fail open: the harness reports a count it cannot read
        logger.debug("durable_sessions: could not count a boundary in %s", path, exc_info=True)
        return 0
    try:
        os.write(fd, line)
        return os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        logger.debug("durable_sessions: could not count a boundary in %s", path, exc_info=True)
        return 0
    finally:
        os.close(fd)


_PROVIDERS: list[weakref.ref[object]] = []
"""The providers actions were given in this process, with a crash point set: the spans
they ended before the crash are flushed too (with a ``BatchSpanProcessor`` they would
be lost with the process, and the harness would not see what the killed run did)."""


def _note_provider(provider: object) -> None:
    if any(noted() is provider for noted in _PROVIDERS):
        return
    try:
        _PROVIDERS.append(weakref.ref(provider))
    except TypeError:  # not weakly referable: flushed only as the global one
        logger.debug("durable_sessions: cannot note tracer provider %r for the crash", provider)


def _die() -> None:
    providers = [trace_api.get_tracer_provider(), *(noted() for noted in _PROVIDERS)]
    for provider in {id(p): p for p in providers if p is not None}.values():
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            try:
                flush()
            except Exception:  # the crash goes ahead whatever the exporter does
                logger.debug("durable_sessions: flushing spans before the crash failed", exc_info=True)
    if _TARGET.counting is not None and os.getpgrp() == os.getsid(0):
        # Under the harness a run is a session of its own: the crash takes the whole agent,
        # its worker processes too, as a machine or container going down would.
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
