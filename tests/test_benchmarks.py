"""The benchmarks' own failures: what they show when a measurement cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_session_rebuild_shows_why_its_baseline_child_failed(tmp_path: Path) -> None:
    """A ``--baseline`` tree whose collector cannot run ended the benchmark with a bare
    CalledProcessError, the child's error message hidden in its captured stderr."""
    broken = tmp_path / "baseline" / "collector" / "src" / "durable_sessions_collector"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("this baseline cannot read schema version 99")\n')
    # 2,000 actions: a session below 1,000 keeps no state for the "restored" rounds to restore
    command = [sys.executable, str(BENCHMARKS / "session_rebuild.py"), "--actions", "2000", "--rounds", "1"]
    result = subprocess.run(
        [*command, "--baseline", str(tmp_path / "baseline")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout
    assert f"the re-fed measurement with {broken.parent} failed (exit code 1):" in result.stderr
    assert "RuntimeError: this baseline cannot read schema version 99" in result.stderr
    assert "CalledProcessError" not in result.stderr
