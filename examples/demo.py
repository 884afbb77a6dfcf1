"""`make demo`: the whole flow, end to end, on this machine.

1. start the sidecar (``durable-sessions-collector serve``) as a subprocess, on free
   loopback ports, with a SQLite store in a temporary directory and ``idle_s: 1``;
2. run the example agents of ``examples/agents/``, each a separate process exporting
   with the real OTLP/gRPC exporter: a booking agent that crashes and recovers cleanly,
   and one agent per common mistake (an unrecorded answer, an unkeyed payment, an
   unbounded retry, a question asked again after a restart);
3. wait until the sidecar has judged every session (each ends after 1 s idle);
4. print the unrecoverable sessions and their violations, read from the HTTP API;
5. stop the sidecar. Exits 0 when all of that worked; otherwise 1, after a message
   saying what went wrong (an agent that fails, or runs past ``AGENT_TIMEOUT_S``, is
   named), with the sidecar stopped.

The demo is self-contained: the sidecar and the agents do not read the caller's
``DURABLE_SESSIONS_*`` or ``OTEL_*`` variables (a shell set up for a real sidecar would
otherwise point the demo at its store, its webhook and its token), and the HTTP API is
exported to and read without the ``http_proxy`` a shell may set for the outside world.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent
AGENTS = EXAMPLES / "agents"
IDLE_S = 1.0
TIMEOUT_S = 25.0
AGENT_TIMEOUT_S = 60.0
"""How long an example agent may run before the demo stops it and gives up."""

# (script, phase): the first wave runs side by side; the second is the restarted processes.
FIRST_WAVE = [
    ("booking.py", 1),
    ("unrecorded_answer.py", 1),
    ("unkeyed_payment.py", 1),
    ("unbounded_retry.py", 1),
    ("reasked_after_restart.py", 1),
]
SECOND_WAVE = [("booking.py", 2), ("reasked_after_restart.py", 2)]
SESSIONS = {
    "booking-ok": "booking.py",
    "forgot-answer": "unrecorded_answer.py",
    "unkeyed-payment": "unkeyed_payment.py",
    "retry-forever": "unbounded_retry.py",
    "reasked-after-restart": "reasked_after_restart.py",
}


class DemoError(Exception):
    """The demo cannot go on; the message says why."""


class AgentHung(DemoError):
    """An example agent ran past :data:`AGENT_TIMEOUT_S` and was stopped."""


def own_environment(**extra: str) -> dict[str, str]:
    """The caller's environment without the variables that configure the sidecar
    (``DURABLE_SESSIONS_*``: its store, ports, token, alert channels) or the OpenTelemetry
    SDK (``OTEL_*``: sampler, headers, protocol), plus ``extra``. Environment variables
    override the demo's configuration file, so ``DURABLE_SESSIONS_STORE`` would put the
    demo's sessions into the caller's real store and fire its real webhook."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("DURABLE_SESSIONS_", "OTEL_"))}
    # gRPC sends even loopback channels through $http_proxy unless $no_grpc_proxy or
    # $no_proxy (read in that order) exempts the host.
    for name in ("no_grpc_proxy", "no_proxy"):
        kept[name] = f"{kept[name]},127.0.0.1" if kept.get(name) else "127.0.0.1"
    return {**kept, **extra}


# The sidecar is on loopback: a proxy from the caller's environment would not reach it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Sidecar:
    """``durable-sessions-collector serve`` in a subprocess; its JSON log goes to a file."""

    def __init__(self, directory: Path) -> None:
        config = directory / "collector.yaml"
        config.write_text(
            "receivers:\n"
            "  grpc: {endpoint: '127.0.0.1:0'}\n"
            "  http: {endpoint: '127.0.0.1:0'}\n"
            f"store: 'sqlite:///{directory / 'sessions.db'}'\n"
            f"evaluation: {{idle_s: {IDLE_S}}}\n"
        )
        self.log_path = directory / "sidecar.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "durable_sessions_collector", "serve", "--config", str(config)],
            env=own_environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        try:
            started = self._wait_for_start()
        except DemoError:
            self.stop()  # not left running, on ports and a store no one will read
            raise
        self.grpc_port, self.http_port = started["grpc_port"], started["http_port"]

    def lines(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):  # a line being written
                    found.append(json.loads(line))
        return found

    def _wait_for_start(self) -> dict[str, Any]:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for line in self.lines():
                if line.get("event") == "started":
                    return line
            if self.process.poll() is not None:
                raise DemoError(f"the sidecar exited at start-up:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise DemoError(f"the sidecar did not start within 20 s:\n{self.log_path.read_text()}")

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        with _OPENER.open(url, timeout=10) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


def run_agents(wave: list[tuple[str, int]], env: dict[str, str]) -> None:
    """Run the agents of ``wave`` side by side and print what they print. Raises
    :class:`DemoError` when one fails, :class:`AgentHung` when one runs past
    :data:`AGENT_TIMEOUT_S` (it is killed)."""

    def run(item: tuple[str, int]) -> subprocess.CompletedProcess[str]:
        script, phase = item
        try:
            return subprocess.run(
                [sys.executable, str(AGENTS / script), "--phase", str(phase)],
                env=env,
                capture_output=True,
                text=True,
                timeout=AGENT_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:  # run() has killed it
            raise AgentHung(
                f"agent {script} (run {phase}) did not finish within {AGENT_TIMEOUT_S:g} s; it was stopped"
            ) from None

    with ThreadPoolExecutor(len(wave)) as pool:
        results = list(pool.map(run, wave))
    for (script, phase), result in zip(wave, results, strict=True):
        sys.stdout.write(result.stdout)
        if result.returncode != 0:
            raise DemoError(f"agent {script} (run {phase}) failed:\n{result.stderr}")
    sys.stdout.flush()


def wait_for_verdicts(sidecar: Sidecar) -> list[dict[str, Any]]:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        sessions = sidecar.get("/api/sessions")["sessions"]
        ended = {s["session_id"] for s in sessions if s["state"] == "ended"}
        if set(SESSIONS) <= ended:
            return sessions
        if time.monotonic() > deadline:
            raise DemoError(f"sessions not judged within {TIMEOUT_S:g} s: {sorted(set(SESSIONS) - ended)}")
        time.sleep(0.1)


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="durable-sessions-demo-") as temporary:
        directory = Path(temporary)
        try:
            sidecar = Sidecar(directory)
        except DemoError as error:
            print(f"demo: {error}", file=sys.stderr)
            return 1
        try:
            print(
                f"sidecar running: OTLP/gRPC on 127.0.0.1:{sidecar.grpc_port}, HTTP API on "
                f"127.0.0.1:{sidecar.http_port}, SQLite store in {directory}\n"
            )
            env = own_environment(
                OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{sidecar.grpc_port}",
                OTEL_EXPORTER_OTLP_TRACES_INSECURE="true",
                OTEL_BSP_SCHEDULE_DELAY="200",
                DEMO_STATE_DIR=str(directory / "agent-state"),
                PYTHONUNBUFFERED="1",
            )
            print("agents (each its own process, exporting OTLP/gRPC to the sidecar):")
            run_agents(FIRST_WAVE, env)
            run_agents(SECOND_WAVE, env)
            print(f"\nwaiting for the verdicts (a session is judged once idle for {IDLE_S:g} s) ...\n")
            sessions = wait_for_verdicts(sidecar)
            print("sessions:")
            for s in sorted(sessions, key=lambda s: s["session_id"]):
                print(f"  {s['session_id']:<24} {s['verdict']:<14} {s['actions']} action(s)")
            bad = sorted(s["session_id"] for s in sessions if s["verdict"] == "unrecoverable")
            print(f"\nunrecoverable sessions ({len(bad)} of {len(sessions)}):")
            for session_id in bad:
                detail = sidecar.get("/api/sessions/" + urllib.request.quote(session_id, safe=""))
                print(f"\n  {session_id}  (examples/agents/{SESSIONS.get(session_id, '?')})")
                for v in detail["violations"]:
                    if not v["resolved"]:
                        print(f"    {v['severity']}: {v['rule']} at action {v['action_id']}")
                        print(f"      {v['message']}")
            alerts = sum(1 for line in sidecar.lines() if line.get("event") == "violation")
            print(f"\nthe sidecar raised {alerts} alert(s), one JSON line each in its log")
        except (DemoError, urllib.error.URLError, OSError) as error:
            print(f"demo: {error}", file=sys.stderr)
            if not isinstance(error, AgentHung):  # the sidecar's log says nothing of an agent's hang
                print(f"sidecar log:\n{sidecar.log_path.read_text()[-4000:]}", file=sys.stderr)
            return 1
        finally:
            sidecar.stop()
        print(f"sidecar stopped; demo finished in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
