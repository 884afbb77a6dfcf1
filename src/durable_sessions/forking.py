"""Objects that hold locks (or connections) a forked child must not inherit.

A forked child has only the thread that forked: a lock another thread held at the fork
stays held for ever in the child, and a database connection would be shared by two
processes. An object registers a reset with :func:`after_fork`, which runs in every
child forked while the object lives.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

_RESETS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def after_fork(owner: Any, reset: Callable[[Any], None]) -> None:
    """Run ``reset(owner)`` in each child process forked while ``owner`` is alive."""
    _RESETS[owner] = reset


def _in_child() -> None:
    for owner, reset in list(_RESETS.items()):
        reset(owner)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
