"""What the sidecar does to the process that runs it: ``serve_forever`` owns its process
and makes the cyclic garbage collector rare; an embedding program keeps its settings."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from conftest import loopback_config
from durable_sessions_collector.service import GC_THRESHOLDS, Service

SERVE_THEN_STOP = """
import gc, os, signal, sys, threading, time
from durable_sessions_collector.config import load
from durable_sessions_collector.service import GC_THRESHOLDS, Service

config = load(None, env={}, overrides={
    "store": sys.argv[1], "receivers.grpc.endpoint": "127.0.0.1:0", "receivers.http.endpoint": "127.0.0.1:0",
})
default = gc.get_threshold()

def report_then_stop():
    deadline = time.monotonic() + 60
    while gc.get_threshold() == default and time.monotonic() < deadline:
        time.sleep(0.01)
    print("thresholds", gc.get_threshold() == GC_THRESHOLDS, "frozen", gc.get_freeze_count() > 0, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report_then_stop, daemon=True).start()
Service(config, log_stream=open(os.devnull, "w")).serve_forever()
print("stopped", flush=True)
"""


def test_serve_forever_makes_the_collector_rare(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SERVE_THEN_STOP, f"sqlite:///{tmp_path / 's.db'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["thresholds True frozen True", "stopped"]


def test_an_embedded_sidecar_leaves_the_collector_alone(tmp_path: Path) -> None:
    before = gc.get_threshold()
    config = loopback_config(f"sqlite:///{tmp_path / 's.db'}")
    with open(os.devnull, "w") as sink, Service(config, log_stream=sink):
        assert gc.get_threshold() == before != GC_THRESHOLDS
