"""``DURABLE_SESSIONS_*`` variables no part of the project reads: ``serve`` names each one
in a warning line at start-up, with the known variable it is closest to, never its value;
and every variable the sources name is one the sidecar knows."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from durable_sessions_collector.config import ENV_PREFIX, ConfigError, load
from durable_sessions_collector.environment import known_variables, unknown_variables
from tls_certs import mutual_tls_pki

ROOT = Path(__file__).parents[3]
SECRET = "s3cret-" + "x" * 24  # the value of an unknown variable: it may be a credential


def serve_until_started(tmp_path: Path, extra: dict[str, str]) -> list[dict[str, Any]]:
    """The JSON lines ``serve`` writes up to its ``started`` line, run with ``extra`` in its
    environment (beside the test process's own), then stopped."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)} | extra
    argv = ["--store", f"sqlite:///{tmp_path / 's.db'}", "--grpc-endpoint", "127.0.0.1:0"]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "durable_sessions_collector",
            "serve",
            *argv,
            "--http-endpoint",
            "127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stderr is not None
    text, deadline = "", time.monotonic() + 60
    try:
        while '"event":"started"' not in text.replace(" ", "") and time.monotonic() < deadline:
            if select.select([process.stderr], [], [], 0.2)[0]:
                line = process.stderr.readline()
                if not line:
                    break
                text += line
        process.terminate()
        text += process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert SECRET not in text
    # Standard error carries JSON lines only (log shippers parse it), warnings included.
    not_json = [line for line in text.splitlines() if not line.startswith("{")]
    assert not not_json, text
    lines = [json.loads(line) for line in text.splitlines()]
    assert any(line["event"] == "started" for line in lines), text
    return lines


def test_serve_warns_of_each_variable_nothing_reads_with_the_closest_known_one(tmp_path: Path) -> None:
    # The names are put together so that the search of the sources below does not find them.
    misspelt, lowercase, unrelated = (
        ENV_PREFIX + "IDEL_S",
        ENV_PREFIX.lower() + "idle_s",
        ENV_PREFIX + "FROBNICATE",
    )
    known = {  # read by the library, the client and the test suite, not by the sidecar
        "DURABLE_SESSIONS_MODE": "silent",
        "DURABLE_SESSIONS_NATIVE": "true",
        "DURABLE_SESSIONS_API_ENDPOINT": "http://127.0.0.1:1",
        "DURABLE_SESSIONS_TEST_POSTGRES_DSN": "postgresql://nobody@127.0.0.1:1/none",
        "DURABLE_SESSIONS_CONFIG": "",
    }
    lines = serve_until_started(tmp_path, {misspelt: "5", lowercase: SECRET, unrelated: SECRET, **known})
    warned = {line["variable"]: line for line in lines if line["event"] == "unknown-environment-variable"}
    assert set(warned) == {misspelt, lowercase, unrelated}
    assert warned[misspelt]["did_you_mean"] == "DURABLE_SESSIONS_IDLE_S"
    assert warned[lowercase]["did_you_mean"] == "DURABLE_SESSIONS_IDLE_S"
    assert "did_you_mean" not in warned[unrelated]
    assert all(line["level"] == "warning" for line in warned.values())
    started = next(line for line in lines if line["event"] == "started")
    assert started["idle_s"] == 30.0  # the misspelt variable was not read: the default stands


@pytest.mark.parametrize("value", ["maybe", " Flase "])
def test_serve_logs_a_native_switch_neither_on_nor_off_as_a_json_line(tmp_path: Path, value: str) -> None:
    # It was Python's warning text, two lines that are no JSON, among the JSON log lines.
    lines = serve_until_started(tmp_path, {"DURABLE_SESSIONS_NATIVE": value})
    warned = [line for line in lines if line["event"] == "invalid-environment-variable"]
    assert [line["variable"] for line in warned] == ["DURABLE_SESSIONS_NATIVE"]
    assert warned[0]["level"] == "warning"
    assert "the C extensions stay on" in warned[0]["note"]


def test_serve_says_nothing_of_a_native_switch_on_or_off(tmp_path: Path) -> None:
    for value in ("off", "TRUE", ""):
        lines = serve_until_started(tmp_path, {"DURABLE_SESSIONS_NATIVE": value})
        assert not [line for line in lines if line["event"] == "invalid-environment-variable"], value


_SOURCES = (
    "src",
    "collector/src",
    "tests",
    "collector/tests",
    "examples",
    "benchmarks",
    "scripts",
    ".ci",
    "docs",
)
_TEXT = {".py", ".md", ".c", ".h", ".toml", ".cfg", ".yaml", ".yml", ""}


def _named_variables() -> dict[str, Path]:
    """Each ``DURABLE_SESSIONS_*`` name written in the project's code, tests, scripts and
    documents, with a file that names it."""
    files = [ROOT / name for name in ("README.md", "collector/README.md", "Makefile", "pyproject.toml")]
    for directory in _SOURCES:
        files += [p for p in (ROOT / directory).rglob("*") if p.is_file() and p.suffix in _TEXT]
    found: dict[str, Path] = {}
    for path in files:
        if "__pycache__" in path.parts or not path.exists():
            continue
        for name in re.findall(r"DURABLE_SESSIONS_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            found.setdefault(name, path)
    return found


def test_every_variable_the_sources_name_is_known() -> None:
    named = _named_variables()
    assert "DURABLE_SESSIONS_IDLE_S" in named and "DURABLE_SESSIONS_KILL_AT" in named  # the search works
    missing = {
        name: str(path.relative_to(ROOT)) for name, path in named.items() if name not in known_variables()
    }
    assert not missing, (
        f"variables read but not in known_variables() (declare them where they are read): {missing}"
    )


# --- DURABLE_SESSIONS_CONFIG ------------------------------------------------------------------


def test_a_config_variable_ending_in_a_line_break_names_the_file_without_it(tmp_path: Path) -> None:
    """A value from a Kubernetes ConfigMap or a ``$(cat …)`` ends in a line break, which
    every other setting is read without (the store's, cd10730): the file was looked for
    under a name ending in one, 'No such file or directory'."""
    path = tmp_path / "collector.yaml"
    path.write_text("evaluation: {idle_s: 7}\n")
    assert load(None, env={"DURABLE_SESSIONS_CONFIG": f"{path}\n"}).evaluation_idle_s == 7
    assert (
        load(None, env={"DURABLE_SESSIONS_CONFIG": " \n"}).evaluation_idle_s == 30
    )  # blank: no file, as empty


def test_a_config_file_that_cannot_be_read_names_the_variable_that_gave_it(tmp_path: Path) -> None:
    """Set in a profile or an image, the variable is easily forgotten; the error named a
    file the command line never mentioned."""
    missing = tmp_path / "gone.yaml"
    with pytest.raises(ConfigError) as caught:
        load(None, env={"DURABLE_SESSIONS_CONFIG": str(missing)})
    assert str(caught.value) == (
        f"cannot read configuration file {str(missing)!r} (from DURABLE_SESSIONS_CONFIG): No such file or directory"
    )
    with pytest.raises(ConfigError) as caught:
        load(missing, env={})
    assert str(caught.value) == f"cannot read configuration file {str(missing)!r}: No such file or directory"


def test_the_config_command_names_a_variable_nothing_reads_too(tmp_path: Path) -> None:
    """``config`` is what one runs to see why a setting is not what was meant: it printed
    idle_s 30.0 from "default", beside a misspelt variable it did not mention."""
    misspelt = ENV_PREFIX + "IDEL_S"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    result = subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, misspelt: SECRET},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["sources"]["evaluation.idle_s"] == "default"
    assert result.stderr == (
        f"durable-sessions-collector: warning: {misspelt} is set, but no part of durable-sessions reads it; "
        "did you mean DURABLE_SESSIONS_IDLE_S?\n"
    )


def test_a_variable_named_after_a_key_of_the_file_is_pointed_to_the_setting_s_variable() -> None:
    """``evaluation.idle_s`` written as a variable the way other tools name theirs (the
    whole key) is too far from ``…_IDLE_S`` for a spelling match: it got no suggestion."""
    named = {
        ENV_PREFIX + "EVALUATION_IDLE_S": "DURABLE_SESSIONS_IDLE_S",
        ENV_PREFIX + "RECEIVERS_GRPC_ENDPOINT": "DURABLE_SESSIONS_GRPC_ENDPOINT",
        ENV_PREFIX + "RETENTION_SESSIONS_S": "DURABLE_SESSIONS_RETENTION_S",
        ENV_PREFIX + "ALERTS_LOG_ENABLED": "DURABLE_SESSIONS_ALERT_LOG",
    }
    assert dict(unknown_variables(dict.fromkeys(named, "x"))) == named


def test_the_sessions_client_reads_its_file_variables_without_a_line_break(tmp_path: Path) -> None:
    """The sidecar reads its own file settings so (and the client its token and endpoint):
    DURABLE_SESSIONS_CA_FILE ending in one was "cannot load the CA file '…\\n': No such
    file or directory". With the files found, the client gets as far as the port (closed)."""
    pki = mutual_tls_pki(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    env |= {
        "DURABLE_SESSIONS_CA_FILE": f"{pki['ca']}\n",
        "DURABLE_SESSIONS_CLIENT_CERT_FILE": f" {pki['client_cert']}\n",
        "DURABLE_SESSIONS_CLIENT_KEY_FILE": f"{pki['client_key']}\n",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "durable_sessions_collector",
            "sessions",
            "--endpoint",
            "https://127.0.0.1:1",
            "list",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    assert "cannot reach the sidecar at https://127.0.0.1:1" in result.stderr
