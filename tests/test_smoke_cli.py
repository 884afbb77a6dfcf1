"""The CLIs run as installed commands and keep their exit-code contract."""

import os
import subprocess
import sys
from pathlib import Path

from durable_sessions import __version__
from tests.support.senders import require_native

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "logs"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "durable_sessions", *args], capture_output=True, text=True)


def test_recoverable_example_passes() -> None:
    result = run("check", str(EXAMPLES / "booking-recoverable.jsonl"), "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "durable-sessions OK" in result.stdout


def test_unrecoverable_example_fails_and_names_the_session() -> None:
    result = run("check", str(EXAMPLES / "booking-unrecoverable.jsonl"))
    assert result.returncode == 1
    assert "unrecoverable: trip-0413" in result.stdout
    for rule in ("unrecorded-answer", "unrecorded-result", "unkeyed-side-effect", "unbounded-retry"):
        assert f"[{rule}]" in result.stdout


EXTENSIONS = (
    "durable_sessions._native, durable_sessions._engine, durable_sessions._memory, durable_sessions._mapping"
)


def version(command: str, native: str) -> list[str]:
    """``--version`` of the installed ``command``, with ``DURABLE_SESSIONS_NATIVE=native``."""
    env = {**os.environ, "DURABLE_SESSIONS_NATIVE": native}
    done = subprocess.run(
        [str(Path(sys.executable).parent / command), "--version"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_version_says_which_c_extensions_run() -> None:
    """A build without a compiler installs no extension and says so only under ``pip -v``;
    ``--version`` is where a user (or a bug report) learns whether they run."""
    for module in ("_native", "_engine", "_memory", "_mapping"):
        require_native(module)
    require_native("_wire", "durable_sessions_collector.otlp")
    require_native("_rows", "durable_sessions_collector.store")
    assert version("durable-sessions", "") == [
        f"durable-sessions {__version__}",
        f"C extensions: {EXTENSIONS}",
    ]
    assert version("durable-sessions-collector", "true") == [
        f"durable-sessions-collector {__version__}",
        f"C extensions: {EXTENSIONS}, durable_sessions_collector.otlp._wire, durable_sessions_collector.store._rows",
    ]
    off = "C extensions off (DURABLE_SESSIONS_NATIVE); the Python code runs"
    assert version("durable-sessions", "off") == [f"durable-sessions {__version__}", off]
    assert version("durable-sessions-collector", "0") == [f"durable-sessions-collector {__version__}", off]
