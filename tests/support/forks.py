"""Running a piece of a test in a forked child, with a bound on how long it may take."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.support.waiting import GENEROUS_S


def exit_code_in_fork(child: Callable[[], int], timeout_s: float = GENEROUS_S) -> int:
    """Fork; the child runs ``child`` and exits with what it returns (3 if it raised).
    The parent waits at most ``timeout_s``, then kills it and fails the test."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child did not finish within {timeout_s} s")
    return os.waitstatus_to_exitcode(done[1])
