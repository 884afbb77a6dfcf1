"""Failures that repeat: logged once, not at every attempt, until the thing works again.

A journal on a read-only or full file system fails at every action, and a lock file that
cannot be made fails at every session block: logged each time, a long-running agent's
log fills with one line repeated. :class:`RepeatedFailures` remembers, per thing that
failed, the error it last failed with, so the caller logs the first failure (and one with
another error), not its repeats, and logs once when it works again, with how many
failures went unlogged.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import MutableMapping
from typing import Any

from durable_sessions import forking


class RepeatedFailures:
    """What each failing thing (a journal, a lock file) last failed with.

    ``weak``: the things are kept by weak reference (a journal object, which must not be
    kept alive by its failure); else by value (a path). A thing that cannot be kept
    (unhashable, or not weakly referenceable) is reported as failing afresh every time.
    """

    def __init__(self, *, weak: bool = False) -> None:
        self._lock = threading.Lock()
        self._failing: MutableMapping[Any, list[Any]] = weakref.WeakKeyDictionary() if weak else {}
        """thing → [what failed (an operation), the error's text, how many repeats went unlogged]"""
        forking.after_fork(self, RepeatedFailures._after_fork)

    def _after_fork(self) -> None:
        # Another thread may have held the lock at the fork: the child's own would stay
        # held for ever, and its first failure hang.
        self._lock = threading.Lock()

    def failed(self, thing: Any, what: str, error: str) -> bool:
        """Note that ``what`` (an operation) failed for ``thing`` with ``error``; whether to
        log it: True for the first failure, or one with another error than the last."""
        with self._lock:
            try:
                state = self._failing.get(thing)
                if state is not None and state[1] == error:
                    state[2] += 1
                    return False
                self._failing[thing] = [what, error, 0]
            except TypeError:  # nothing to remember it by
                pass
        return True

    def worked(self, thing: Any, what: str) -> tuple[str, int] | None:
        """Note that ``what`` worked for ``thing``, ending a failure of ``what`` (a full
        disk still reads: a read that works ends no write failure). The error and how
        many repeats of it went unlogged when there were any (log that it works again);
        else ``None``."""
        if not self._failing:  # the common case: nothing has failed
            return None
        with self._lock:
            try:
                state = self._failing.get(thing)
                if state is None or state[0] != what:
                    return None
                del self._failing[thing]
            except TypeError:
                return None
        return (state[1], state[2]) if state[2] else None


__all__ = ["RepeatedFailures"]
