"""``make demo``: examples/demo.py runs the sidecar and the example agents end to end."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.py"

UNRECOVERABLE = {
    "forgot-answer": "unrecorded-answer",
    "unkeyed-payment": "unkeyed-side-effect",
    "retry-forever": "unbounded-retry",
    "reasked-after-restart": "re-asked",
}


def run_demo(directory: Path, timeout: float, **environment: str) -> subprocess.CompletedProcess[str]:
    """``examples/demo.py`` run in ``directory`` (the demo must not depend on the working
    directory), with ``environment`` added to this process's."""
    return subprocess.run(
        [sys.executable, str(DEMO)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=directory,
        env={**os.environ, **environment},
    )


def test_demo_prints_the_unrecoverable_sessions_and_their_rules(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_demo(tmp_path, 60, PYTHONUNBUFFERED="1")
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


def test_demo_ignores_the_callers_sidecar_sdk_and_proxy_settings(tmp_path: Path) -> None:
    """A shell set up for a real sidecar (docs/deployment.md) runs the same demo: its
    ``DURABLE_SESSIONS_STORE`` used to receive the demo's sessions (environment variables
    override the demo's file), its token made the sidecar refuse the agents, a sampler
    dropped their spans, and an ``http_proxy`` took the loopback requests and exports."""
    store = tmp_path / "production.db"
    result = run_demo(
        tmp_path,
        90,
        DURABLE_SESSIONS_STORE=f"sqlite:///{store}",
        DURABLE_SESSIONS_AUTH_TOKEN="a-production-token-0123456789",
        OTEL_TRACES_SAMPLER="always_off",
        http_proxy="http://127.0.0.1:9",  # the discard port: nothing listens
        HTTP_PROXY="http://127.0.0.1:9",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unrecoverable sessions (4 of 5):" in result.stdout
    assert not store.exists(), "the demo wrote into the caller's store"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile
                continue
    return found


def test_a_sidecar_that_does_not_start_in_time_is_stopped_not_left_running(tmp_path: Path) -> None:
    """The demo gives up on a sidecar that has not logged ``started`` within 20 s; it
    returned 1 and left that process running, to serve later from a deleted directory."""
    slow = tmp_path / "slow"
    slow.mkdir()
    # Runs before the sidecar's own code: a start-up slower than the demo waits for.
    (slow / "sitecustomize.py").write_text(
        "import sys, time\n"
        "if 'durable_sessions_collector' in sys.orig_argv and 'serve' in sys.orig_argv:\n"
        "    time.sleep(60)\n"
    )
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    python_path = os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")]))
    result = run_demo(tmp_path, 90, PYTHONPATH=python_path, TMPDIR=str(temporary))
    leaked = _processes_mentioning(str(temporary))
    for pid in leaked:  # this test's own sidecar, when the demo left it
        os.kill(pid, 9)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "did not start within 20 s" in result.stderr
    assert not leaked, "the demo left its sidecar running"


def _demo_module() -> ModuleType:
    """``examples/demo.py`` imported, to call its functions with a setting changed."""
    spec = importlib.util.spec_from_file_location("durable_sessions_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_agent_that_hangs_is_named_in_one_line_and_the_sidecar_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An example agent that ran past its timeout stopped the demo with a traceback of
    subprocess.TimeoutExpired, its command line and the threads' frames."""
    hanging = tmp_path / "hanging"
    hanging.mkdir()
    pid_file = tmp_path / "agent.pid"
    # Runs before the agent's own code (agents get the caller's PYTHONPATH); the sidecar
    # and the other agents go on as usual.
    (hanging / "sitecustomize.py").write_text(
        "import os, sys, time\n"
        "if any(arg.endswith('booking.py') for arg in sys.orig_argv):\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(120)\n"
    )
    python_path = os.pathsep.join(filter(None, [str(hanging), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", python_path)
    temporary = tmp_path / "tmp"  # where the demo keeps its sidecar's store and log
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    demo = _demo_module()
    monkeypatch.setattr(demo, "AGENT_TIMEOUT_S", 5.0)

    code = demo.main()

    leaked = _processes_mentioning(str(temporary))
    hung = int(pid_file.read_text())
    for pid in [*leaked, hung]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    err = capsys.readouterr().err
    assert code == 1
    assert err == "demo: agent booking.py (run 1) did not finish within 5 s; it was stopped\n"
    assert not leaked, "the demo left its sidecar running"
    assert not _running(hung), "the demo left the hung agent running"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that runs (neither gone nor a zombie)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status
