"""The two ways ``checking="process"`` sends spans: the native sender and the pure-Python one.

The native sender (``durable_sessions._native``) is built by ``pip install`` where a C
compiler is available. A test that needs it skips when it was not built — unless
``DURABLE_SESSIONS_REQUIRE_NATIVE=1`` (as CI sets it), which makes its absence a failure.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "DURABLE_SESSIONS_REQUIRE_NATIVE"


def require_native(module: str = "_native", package: str = "durable_sessions") -> None:
    """Skip (or, in CI, fail) when the extension ``<package>.<module>`` was not built."""
    if importlib.util.find_spec(f"{package}.{module}") is not None:
        return
    message = f"{package}.{module} was not built (no C compiler at install time?)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires it")
    pytest.skip(message)


def use_sender(monkeypatch: pytest.MonkeyPatch, sender: str) -> None:
    """Make checker processes started from here on use ``sender`` ("native" or "python")."""
    if sender == "native":
        require_native()
        monkeypatch.delenv("DURABLE_SESSIONS_NATIVE", raising=False)
    else:
        monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", "false")


def use_engine(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """Make checkers made from here on use the C engine and fold (``engine`` "native"), or
    the Python reference ("python")."""
    if engine == "native":
        require_native("_engine")
        require_native("_memory")
        monkeypatch.delenv("DURABLE_SESSIONS_NATIVE", raising=False)
    else:
        monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", "false")
