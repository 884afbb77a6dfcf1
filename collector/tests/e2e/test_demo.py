"""``make demo``: examples/demo.py runs the sidecar and the example agents end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.py"

UNRECOVERABLE = {
    "forgot-answer": "unrecorded-answer",
    "unkeyed-payment": "unkeyed-side-effect",
    "retry-forever": "unbounded-retry",
    "reasked-after-restart": "re-asked",
}


def test_demo_prints_the_unrecoverable_sessions_and_their_rules(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(DEMO)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,  # the demo must not depend on the working directory
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 30, f"the demo took {elapsed:.1f} s"
    out = result.stdout

    verdicts = dict(re.findall(r"^  (\S+)\s+(ok|at_risk|unrecoverable)\s+\d+ action", out, flags=re.M))
    assert verdicts == {"booking-ok": "ok", **dict.fromkeys(UNRECOVERABLE, "unrecoverable")}

    listed = out.split("unrecoverable sessions (4 of 5):", 1)[1]
    blocks = re.split(r"^\n  (?=\S)", listed, flags=re.M)[1:]
    found = {}
    for block in blocks:
        session_id = block.split()[0]
        found[session_id] = re.findall(r"^    error: (\S+) at action", block, flags=re.M)
    assert found == {session: [rule] for session, rule in UNRECOVERABLE.items()}
    assert "booking-ok" not in listed
    assert "the sidecar raised 4 alert(s)" in out
    assert "sidecar stopped" in out
