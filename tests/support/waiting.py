"""Waiting for an effect of another thread or process, with deadlines a loaded machine meets."""

from __future__ import annotations

import time
from collections.abc import Callable

GENEROUS_S = 60.0
"""How long a test waits for something that takes well under a second on an idle machine:
on a slow, shared CI machine (two cores, a load of 8) it has taken seconds. It bounds
only a test that is failing anyway; one that passes waits no longer than the effect."""


def wait_until(condition: Callable[[], bool], timeout_s: float = GENEROUS_S) -> bool:
    """Whether ``condition()`` came true within ``timeout_s``: asked until it is, and once
    more at the deadline (a process descheduled past it is not failed for that)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()
