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


def test_check_throughput_stops_when_its_baseline_tree_cannot_check(tmp_path: Path) -> None:
    """A ``--baseline`` tree whose check fails (here it exits 1, as a check that finds
    violations does) took no time worth comparing: the benchmark stops and says so,
    rather than print a ratio against a failure."""
    broken = tmp_path / "baseline" / "src" / "durable_sessions"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("not this tree")\n')
    (broken / "__main__.py").write_text("")
    command = [sys.executable, str(BENCHMARKS / "check_throughput.py"), "--actions", "200", "--sessions", "5"]
    result = subprocess.run(
        [*command, "--rounds", "1", "--baseline", str(tmp_path / "baseline")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout
    assert "RuntimeError: not this tree" in result.stderr  # the tree's own error, as it ran
    assert "the baseline tree's check did not report 200 actions: run it by hand" in result.stderr
    assert "check / tree's check" not in result.stdout


def test_check_throughput_s_otlp_log_holds_the_action_log_s_findings(tmp_path: Path) -> None:
    """``--otlp`` times the same records as spans: checked, the OTLP/JSON file (its
    retried requests included) gives the action log's actions and findings."""
    import importlib.util

    from durable_sessions.check import OfflineCheck
    from durable_sessions.rules import select_rules

    spec = importlib.util.spec_from_file_location("check_throughput", BENCHMARKS / "check_throughput.py")
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    log, otlp = str(tmp_path / "actions.jsonl"), str(tmp_path / "actions.otlp.jsonl")
    bench.generate(log, 6000, 40)
    bench.to_otlp(log, otlp)
    assert Path(otlp).read_bytes().count(b"\n") > 6000 // bench.OTLP_BATCH  # some requests sent twice

    def checked(path: str) -> tuple[int, list[tuple[str, str | None, str | None]]]:
        check = OfflineCheck([path], select_rules("all"))
        findings = sorted((v.rule, v.session_id, v.action_id) for v in check)
        return check.actions, findings

    actions, findings = checked(log)
    assert findings and checked(otlp) == (actions, findings) == (6000, findings)
