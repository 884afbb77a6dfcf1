"""Pickling exceptions made from other arguments than their message.

A process pool hands a worker's exception back pickled, and an exception pickles by
default as ``type(error)(*error.args)``, its message: the constructor of an exception made
from other arguments failed in the parent (``ActionInDoubt`` read the message as its
entry), and ``concurrent.futures`` took that for a dead worker, broke the pool and killed
the other workers, their sessions' actions midway.

This module imports nothing of the package, so that every module defining such an
exception can import it (``journal`` imports ``session_lock``, which could not import
``journal`` back).
"""

from __future__ import annotations

from typing import Any


def reduced(error: BaseException, *arguments: Any) -> tuple[Any, ...]:
    """What ``error.__reduce__`` returns to pickle ``error`` as ``type(error)(*arguments)``
    (what it was made from) and its attributes."""
    return type(error), arguments, error.__dict__
