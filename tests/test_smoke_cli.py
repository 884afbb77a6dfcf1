"""The CLIs run as installed commands and keep their exit-code contract."""

import subprocess
import sys
from pathlib import Path

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
