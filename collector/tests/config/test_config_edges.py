"""The sidecar's configuration, secrets, shutdown, ``sessions`` CLI, ``/metrics`` and
``/healthz`` checked against what ``collector/README.md`` and ``docs/deployment.md`` promise.

- the README's table and examples name exactly the options the code has, and every option
  works from the file, the environment and a flag, in that order of precedence;
- invalid configuration (including ``nan``/``inf`` numbers and blank header values) stops
  ``serve`` with exit code 2 and a message naming the key, never a traceback;
- an IPv6 endpoint is served on the HTTP port as on the gRPC port;
- secrets (token, webhook credentials and query values, OTLP headers, store passwords in
  the authority or the query) appear neither in ``config`` output, nor in error messages,
  nor in the log, and the redaction keeps each log line one JSON object;
- ``serve`` stops cleanly on SIGTERM/SIGINT;
- the ``sessions`` CLI answers every failure with one line and its documented exit code,
  and its flags beat the environment;
- ``/metrics`` matches the README, and an open ``/healthz`` tells a caller without the
  token only ok/unhealthy.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import LineBuffer, loopback_config, wait_for
from durable_sessions_collector import config as config_module
from durable_sessions_collector.cli import main
from durable_sessions_collector.config import (
    OPTIONS,
    ConfigError,
    load,
    redact_store_url,
    redact_url,
    url_secrets,
)
from durable_sessions_collector.security import RedactingStream
from durable_sessions_collector.service import HANGUP_ACTION, Service
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer, free_port

ROOT = Path(__file__).parents[3]
README = (ROOT / "collector" / "README.md").read_text()
DEPLOYMENT = (ROOT / "docs" / "deployment.md").read_text()
TOKEN = "audit-" + uuid.uuid4().hex  # unique: finding it anywhere is meaningful
KEYS = {option.key for option in OPTIONS}


# --- helpers ----------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any DURABLE_SESSIONS_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_SESSIONS_")}
    env.update(extra)
    return env


def cli(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
    )


def serve_refused(
    tmp_path: Path, text: str | None, *argv: str, timeout: float = 60
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``serve`` on ``text`` written as ``tmp_path``'s configuration file (left unwritten
    when None), with ``argv`` and a SQLite store there: the file's path and the run, which
    must have stopped with exit code 2 (invalid configuration)."""
    path = tmp_path / "collector.yaml"
    if text is not None:
        path.write_text(text)
    result = cli(
        "serve", "--config", str(path), "--store", f"sqlite:///{tmp_path / 's.db'}", *argv, timeout=timeout
    )
    assert result.returncode == 2, result.stderr
    return path, result


def readme_table() -> list[tuple[str, str, str, str]]:
    """(key, variable, flag, default) of each row of README's configuration table."""
    rows = []
    for line in README.splitlines():
        match = re.match(
            r"^\| `([a-z_.]+)` \| `(DURABLE_SESSIONS_\w+)` \| `(--[a-z-]+)(?: \{true,false\})?` \| ([^|]+) \|",
            line,
        )
        if match:
            rows.append((match[1], match[2], match[3], match[4].strip()))
    return rows


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.S)


def dotted_keys(node: dict[str, Any], prefix: str = "") -> set[str]:
    found: set[str] = set()
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if dotted not in KEYS and isinstance(value, dict):
            found |= dotted_keys(value, dotted + ".")
        else:
            found.add(dotted)
    return found


def sidecar_yaml_blocks() -> list[str]:
    """The sidecar configuration examples (not the Collector's) of both documents."""
    blocks = yaml_blocks(README) + yaml_blocks(DEPLOYMENT)
    return [b for b in blocks if "store:" in b or b.lstrip().startswith(("# collector.yaml", "alerts:"))]


class Served:
    """``durable-sessions-collector serve`` in a subprocess, its stderr read line by line."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "durable_sessions_collector", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env if env is not None else clean_env(),
        )
        self.lines: list[str] = []

    @classmethod
    def on_free_ports(cls, store: str) -> Served:
        """``serve`` on ``store``, its ports picked by the system."""
        return cls("--store", store, "--grpc-endpoint", "127.0.0.1:0", "--http-endpoint", "127.0.0.1:0")

    def read_until(self, event: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.process.stderr is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stderr], [], [], 0.2)
            if not ready:
                if self.process.poll() is not None:
                    break
                continue
            line = self.process.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            try:
                document = json.loads(line)
            except ValueError:
                continue
            if document.get("event") == event:
                return document
        raise AssertionError(f"no {event!r} line; stderr so far: {''.join(self.lines)}")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        _, rest = self.process.communicate(timeout=timeout)
        return self.process.returncode, "".join(self.lines) + rest

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def http(
    url: str,
    token: str | None = None,
    method: str = "GET",
    data: bytes | None = None,
    content_type: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if content_type:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(url, headers=headers, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def no_durable_sessions_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DURABLE_SESSIONS_"):
            monkeypatch.delenv(name)


# --- documentation vs. OPTIONS ----------------------------------------------------------------


def test_readme_table_lists_exactly_the_options_with_their_names_and_defaults() -> None:
    rows = readme_table()
    assert [row[0] for row in rows] == [option.key for option in OPTIONS]
    for (key, env, flag, default), option in zip(rows, OPTIONS, strict=True):
        assert (key, env, flag) == (option.key, option.env, option.flag)
        assert default == ("unset" if option.default is None else f"`{option.default}`"), key


def test_every_key_in_the_documented_examples_exists() -> None:
    blocks = sidecar_yaml_blocks()
    assert len(blocks) >= 4  # README's example, and deployment.md's sidecar files
    for block in blocks:
        keys = dotted_keys(yaml.safe_load(block))
        assert keys <= KEYS, (keys - KEYS, block)


def test_every_documented_option_has_a_working_environment_override(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "token").write_text("t" * 20)
    samples = {
        "receivers.grpc.endpoint": ("0.0.0.0:5000", "0.0.0.0:5000"),
        "receivers.http.endpoint": ("localhost:5001", "localhost:5001"),
        "receivers.http.max_connections": ("17", 17),
        "receivers.max_request_bytes": ("1024", 1024),
        "receivers.max_decoding_bytes": ("4096", 4096),
        "pipeline.queue_size": ("3", 3),
        "pipeline.retry_after_s": ("7", 7),
        "pipeline.max_batch": ("5", 5),
        "pipeline.ack_timeout_s": ("2.5", 2.5),
        "store": ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
        "retention.sessions_s": ("604800", 604800.0),
        "evaluation.idle_s": ("12.5", 12.5),
        "evaluation.key_window_s": ("60", 60.0),
        "evaluation.strict": ("yes", True),
        "evaluation.max_sessions": ("9", 9),
        "evaluation.max_actions_per_session": ("11", 11),
        "evaluation.attribute_value_limit": ("256", 256),
        "alerts.log.enabled": ("off", False),
        "alerts.webhook.url": ("https://h.example/hook", "https://h.example/hook"),
        "alerts.webhook.max_attempts": ("3", 3),
        "alerts.webhook.timeout_s": ("0.5", 0.5),
        "alerts.webhook.backoff_s": ("0.25", 0.25),
        "alerts.webhook.max_backoff_s": ("60", 60.0),
        "alerts.otlp.endpoint": ("https://otel.example:4317", "https://otel.example:4317"),
        "alerts.otlp.insecure": ("false", False),
        "alerts.otlp.headers": (
            "Authorization=Bearer%20abc,x-scope-orgid=team-a",
            (("authorization", "Bearer abc"), ("x-scope-orgid", "team-a")),
        ),
        "alerts.otlp.max_attempts": ("4", 4),
        "alerts.otlp.timeout_s": ("1.5", 1.5),
        "alerts.otlp.backoff_s": ("0.5", 0.5),
        "alerts.otlp.max_backoff_s": ("30", 30.0),
        "tls.cert_file": (str(tmp_path / "cert.pem"), str(tmp_path / "cert.pem")),
        "tls.key_file": (str(tmp_path / "cert.pem"), str(tmp_path / "cert.pem")),
        "tls.client_ca_file": (str(tmp_path / "cert.pem"), str(tmp_path / "cert.pem")),
        "auth.token": (TOKEN, TOKEN),
        "auth.token_file": (str(tmp_path / "token"), str(tmp_path / "token")),
        "log_level": ("debug", "DEBUG"),
    }
    assert set(samples) == KEYS
    needs = {
        "tls.cert_file": ["tls.key_file"],
        "tls.key_file": ["tls.cert_file"],
        "tls.client_ca_file": ["tls.cert_file", "tls.key_file"],
    }
    for option in OPTIONS:
        raw, expected = samples[option.key]
        env = {option.env: raw}
        for needed in needs.get(option.key, []):
            env[next(o.env for o in OPTIONS if o.key == needed)] = raw
        config = load(None, env=env)
        assert getattr(config, option.attr) == expected, option.key
        assert config.sources[option.key] == option.env


@pytest.mark.parametrize(
    ("key", "file_value", "env_value", "flag_value", "expected"),
    [
        ("pipeline.queue_size", 10, "20", "30", 30),
        ("evaluation.idle_s", 1.5, "2.5", "3.5", 3.5),
        ("evaluation.strict", False, "true", "false", False),
        ("receivers.http.endpoint", "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:3"),
        (
            "alerts.webhook.url",
            "https://a.example/",
            "https://b.example/",
            "https://c.example/",
            "https://c.example/",
        ),
    ],
)
def test_precedence_is_flag_then_environment_then_file(
    tmp_path: Path, key: str, file_value: Any, env_value: str, flag_value: str, expected: Any
) -> None:
    option = next(o for o in OPTIONS if o.key == key)
    document: dict[str, Any] = {}
    node = document
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = file_value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(document))
    # one key a line, indented two spaces a level
    assert load(path, env={}).sources[key] == f"{path}:{len(parents) + 1}:{2 * len(parents) + 1}"
    assert load(path, env={option.env: env_value}).sources[key] == option.env
    config = load(path, env={option.env: env_value}, overrides={option.attr: flag_value})
    assert getattr(config, option.attr) == expected and config.sources[key] == option.flag
    # Through the real command line too.
    result = cli(
        "config", "--config", str(path), option.flag, flag_value, env=clean_env(**{option.env: env_value})
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["sources"][key] == option.flag


def test_the_config_flag_beats_the_config_variable(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("evaluation: {idle_s: 11}\n")
    (tmp_path / "b.yaml").write_text("evaluation: {idle_s: 22}\n")
    env = {"DURABLE_SESSIONS_CONFIG": str(tmp_path / "a.yaml")}
    assert load(None, env=env).evaluation_idle_s == 11
    assert load(tmp_path / "b.yaml", env=env).evaluation_idle_s == 22


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " yes ", "on"])
def test_boolean_variables_accept_the_usual_spellings_of_true(raw: str) -> None:
    assert load(None, env={"DURABLE_SESSIONS_STRICT": raw}).evaluation_strict is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "off"])
def test_boolean_variables_accept_the_usual_spellings_of_false(raw: str) -> None:
    assert load(None, env={"DURABLE_SESSIONS_ALERT_LOG": raw}).alerts_log_enabled is False


def test_empty_variables_unset_optional_settings() -> None:
    env = {
        "DURABLE_SESSIONS_WEBHOOK_URL": "",
        "DURABLE_SESSIONS_AUTH_TOKEN": "",
        "DURABLE_SESSIONS_ATTRIBUTE_VALUE_LIMIT": "",
        "DURABLE_SESSIONS_ALERTS_OTLP_ENDPOINT": "",
        "DURABLE_SESSIONS_ALERTS_OTLP_INSECURE": "",
        "DURABLE_SESSIONS_ALERTS_OTLP_HEADERS": "",
        "DURABLE_SESSIONS_TLS_CERT_FILE": "",
        "DURABLE_SESSIONS_TLS_KEY_FILE": "",
        "DURABLE_SESSIONS_CONFIG": "",
    }
    config = load(None, env=env)
    assert config.alerts_webhook_url is None and config.auth_token is None
    assert config.evaluation_attribute_value_limit is None and config.alerts_otlp_endpoint is None
    assert config.alerts_otlp_insecure is None and config.alerts_otlp_headers is None
    assert config.tls_cert_file is None


def test_an_empty_variable_cannot_turn_off_the_token_the_file_requires(tmp_path: Path) -> None:
    """``DURABLE_SESSIONS_AUTH_TOKEN=`` (Compose writes ``${TOKEN}`` of an unset ``TOKEN``
    so) unset the file's auth.token: serve started with ``"auth": "none"`` and answered
    every client. It stops, naming the key, the variable and the file's line, and never
    showing the token."""
    path = tmp_path / "collector.yaml"
    path.write_text(
        f"receivers:\n  grpc: {{endpoint: 127.0.0.1:0}}\n  http: {{endpoint: 127.0.0.1:0}}\nauth: {{token: {TOKEN}}}\n"
    )
    store = f"sqlite:///{tmp_path / 's.db'}"
    for args, env, source in (
        ([], clean_env(DURABLE_SESSIONS_AUTH_TOKEN=""), "DURABLE_SESSIONS_AUTH_TOKEN"),
        (["--auth-token", ""], clean_env(), "--auth-token"),
    ):
        result = cli("serve", "--config", str(path), "--store", store, *args, env=env, timeout=30)
        assert result.returncode == 2, result.stderr
        assert (
            f"auth.token: {source} is empty, which would turn off the auth.token set in {path}:4:8; "
            f"leave {source} out to keep it, or remove the setting there"
        ) in result.stderr
        assert TOKEN not in result.stderr + result.stdout
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(
    ("key", "variable"),
    [
        ("auth.token_file", "DURABLE_SESSIONS_AUTH_TOKEN_FILE"),
        ("tls.cert_file", "DURABLE_SESSIONS_TLS_CERT_FILE"),
        ("tls.key_file", "DURABLE_SESSIONS_TLS_KEY_FILE"),
        ("tls.client_ca_file", "DURABLE_SESSIONS_TLS_CLIENT_CA_FILE"),
    ],
)
def test_an_empty_variable_cannot_turn_off_a_protection_the_file_sets(
    tmp_path: Path, key: str, variable: str
) -> None:
    """The TLS files and the token file too (emptying both TLS variables served plaintext)."""
    token_file, pem = tmp_path / "token", tmp_path / "x.pem"
    token_file.write_text(TOKEN + "\n")
    pem.write_text("not read by load\n")
    path = tmp_path / "collector.yaml"
    path.write_text(
        f"auth: {{token_file: {token_file}}}\n"
        f"tls: {{cert_file: {pem}, key_file: {pem}, client_ca_file: {pem}}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load(path, env={variable: ""})
    assert str(caught.value).startswith(
        f"{key}: {variable} is empty, which would turn off the {key} set in {path}:"
    )


def test_an_empty_variable_still_unsets_other_optional_settings_of_the_file(tmp_path: Path) -> None:
    """A webhook or an attribute limit set in the file may be turned off for one run."""
    path = tmp_path / "collector.yaml"
    path.write_text(
        "alerts: {webhook: {url: https://alerts.example/hook}}\nevaluation: {attribute_value_limit: 64}\n"
    )
    env = {"DURABLE_SESSIONS_WEBHOOK_URL": "", "DURABLE_SESSIONS_ATTRIBUTE_VALUE_LIMIT": ""}
    config = load(path, env=env)
    assert config.alerts_webhook_url is None and config.evaluation_attribute_value_limit is None


def test_a_variable_ending_in_a_line_break_means_what_it_means_without(tmp_path: Path) -> None:
    """A value from a Kubernetes Secret or ConfigMap file, or a ``$(cat …)``, ends in a
    line break. ``DURABLE_SESSIONS_STORE=sqlite:///…/s.db`` so ended was served from a new,
    empty file whose name ends in a line break; ``DURABLE_SESSIONS_LOG_LEVEL=debug`` so
    ended stopped start-up, where every other setting is read without the whitespace."""
    store = tmp_path / "s.db"
    served = Served(
        "--grpc-endpoint",
        "127.0.0.1:0",
        "--http-endpoint",
        "127.0.0.1:0",
        env=clean_env(DURABLE_SESSIONS_STORE=f"sqlite:///{store}\n", DURABLE_SESSIONS_LOG_LEVEL=" debug\n"),
    )
    try:
        started = served.read_until("started", timeout=30)
        assert started["store"] == f"sqlite:///{store}", "".join(served.lines)
        http(f"http://127.0.0.1:{started['http_port']}/healthz")
        assert served.read_until("http-request", timeout=30)["level"] == "debug"
    finally:
        served.kill()
    assert store.exists()
    assert not [path.name for path in tmp_path.iterdir() if "\n" in path.name]


@pytest.mark.parametrize(
    ("variable", "key", "raw", "expected"),
    [
        ("DURABLE_SESSIONS_MAX_BATCH", "pipeline.max_batch", "\u00b2", "expected a positive integer, got '\u00b2'"),
        ("DURABLE_SESSIONS_QUEUE_SIZE", "pipeline.queue_size", "\uff16\uff14", "expected a positive integer, got '\uff16\uff14'"),
        ("DURABLE_SESSIONS_IDLE_S", "evaluation.idle_s", "\u0661\u0660", "expected a positive number, got '\u0661\u0660'"),
    ],
)  # fmt: skip
def test_a_number_is_written_in_ascii_digits(
    tmp_path: Path, variable: str, key: str, raw: str, expected: str
) -> None:
    """``isdigit`` took a superscript two, on which ``int`` raised its own message
    ("invalid literal for int() with base 10"), and ``int``/``float`` read full-width or
    Arabic-Indic digits as numbers; from the variable and quoted in the file alike."""
    section, _, name = key.partition(".")
    path = tmp_path / "collector.yaml"
    path.write_text(f'{section}: {{{name}: "{raw}"}}\n', encoding="utf-8")
    for source, message in (
        (lambda: load(None, env={variable: raw}), f"{key}: {expected} (from {variable})"),
        (lambda: load(path, env={}), f"{path}:1:{len(section) + 4}: {key}: {expected}"),
    ):
        with pytest.raises(ConfigError) as caught:
            source()
        assert str(caught.value) == message


@pytest.mark.parametrize(
    ("variable", "key"),
    [
        ("DURABLE_SESSIONS_STRICT", "evaluation.strict"),
        ("DURABLE_SESSIONS_QUEUE_SIZE", "pipeline.queue_size"),
        ("DURABLE_SESSIONS_IDLE_S", "evaluation.idle_s"),
        ("DURABLE_SESSIONS_STORE", "store"),
        ("DURABLE_SESSIONS_GRPC_ENDPOINT", "receivers.grpc.endpoint"),
        ("DURABLE_SESSIONS_LOG_LEVEL", "log_level"),
    ],
)
def test_an_empty_variable_for_a_required_setting_is_an_error_naming_it(variable: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(None, env={variable: ""})
    assert str(caught.value).startswith(f"{key}: ") and f"(from {variable})" in str(caught.value)


# --- the file: keys given twice, lines, fuzzing ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "column", "problem"),
    [
        # a second block would quietly drop the first one's idle_s
        (
            "evaluation:\n  idle_s: 5\nevaluation:\n  strict: true\n",
            3,
            1,
            "'evaluation' is given twice (first at line 1)",
        ),
        ("evaluation:\n  idle_s: 5\n  idle_s: 7\n", 3, 3, "'idle_s' is given twice (first at line 2)"),
        ("evaluation: {idle_s: 5, idle_s: 7}\n", 1, 25, "'idle_s' is given twice (first at line 1)"),
    ],
)
def test_a_key_given_twice_in_the_file_is_an_error_naming_both_lines(
    tmp_path: Path, text: str, line: int, column: int, problem: str
) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path, env={})
    assert str(caught.value) == f"{path}:{line}:{column}: not valid YAML: {problem}; merge the two"


def test_a_section_left_empty_means_its_defaults(tmp_path: Path) -> None:
    """A section whose settings are all commented out is YAML's null, as the OpenTelemetry
    Collector's ``otlp:`` with nothing under it means its defaults: it was refused,
    'evaluation: expected a mapping of settings, …, got nothing'."""
    path = tmp_path / "collector.yaml"
    path.write_text(
        "evaluation:\n  # idle_s: 5\nalerts:\n  webhook:\n  otlp: {max_attempts: 3}\nreceivers: {grpc: }\n"
    )
    config = load(path, env={})
    assert (config.evaluation_idle_s, config.alerts_webhook_url, config.alerts_otlp_max_attempts) == (
        30.0,
        None,
        3,
    )
    assert config.sources["evaluation.idle_s"] == config.sources["alerts.webhook.url"] == "default"
    path.write_text("evaluation: 5\n")  # a value that is not nothing is still refused
    with pytest.raises(ConfigError, match="evaluation: expected a mapping of settings"):
        load(path, env={})


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        # the dotted key came after the nested one and quietly won over it
        ("evaluation:\n  idle_s: 30\nevaluation.idle_s: 5\n", "3:1", "evaluation.idle_s: write the key nested in "
         "the file, evaluation: {idle_s: …}"),
        ("receivers.grpc.endpoint: 127.0.0.1:5000\nreceivers:\n  grpc: {endpoint: 127.0.0.1:6000}\n", "1:1",
         "receivers.grpc.endpoint: write the key nested in the file, receivers: {grpc: {endpoint: …}}"),
        ("receivers:\n  grpc.endpoint: 127.0.0.1:5000\n", "2:3",
         "receivers.grpc.endpoint: write the key nested in the file, receivers: {grpc: {endpoint: …}}"),
        ("alerts.webhook: {url: https://alerts.example/hook}\n", "1:1",
         "alerts.webhook: write the key nested in the file, alerts: {webhook: …}"),
    ],
)  # fmt: skip
def test_a_dotted_key_in_the_file_is_an_error_naming_its_line_and_the_nested_form(
    tmp_path: Path, text: str, line: str, message: str
) -> None:
    """The file nests its keys. A dotted one was read too, undocumented, so one setting
    could be given twice (nested and dotted) and the last one won without a word, which
    is what the file's check for a key given twice is there to prevent."""
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path, env={})
    assert str(caught.value) == f"{path}:{line}: {message}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reciever:\n  grpc: {endpoint: 127.0.0.1:4319}\n", "{path}:1:1: reciever: unknown setting; did you mean receivers?"),
        ("receivers:\n  grcp: {endpoint: 127.0.0.1:4319}\n", "{path}:2:3: receivers.grcp: unknown setting; did you mean receivers.grpc?"),
        ("evaluation: {strict: true, idel_s: 3}\n", "{path}:1:28: evaluation.idel_s: unknown setting; did you mean evaluation.idle_s?"),
        ("loglevel: debug\n", "{path}:1:1: loglevel: unknown setting; did you mean log_level?"),
        ("tls: {cert: a.pem}\n", "{path}:1:7: tls.cert: unknown setting; did you mean tls.cert_file?"),
        ("frobnicate: 1\n", "{path}:1:1: frobnicate: unknown setting; known: alerts.log.enabled, "),
    ],
)  # fmt: skip
def test_a_misspelt_key_stops_serve_naming_it_and_the_closest_known_one(
    tmp_path: Path, text: str, expected: str
) -> None:
    """``reciever:`` was named, then followed by every one of the 36 keys, which left the
    user to spot the one meant."""
    path, result = serve_refused(tmp_path, text)
    assert expected.format(path=path) in result.stderr


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [("evaluation:\n\tidle_s: 5\n", 2, 1), ("evaluation:\n  idle_s:\t5\n", 2, 10)],
)
def test_a_tab_in_the_file_stops_serve_saying_to_use_spaces(
    tmp_path: Path, text: str, line: int, column: int
) -> None:
    """An editor's tab: PyYAML says only "found character '\\t' that cannot start any token"."""
    path, result = serve_refused(tmp_path, text)
    assert (
        f"{path}:{line}:{column}: not valid YAML: found character '\\t' that cannot start "
        "any token (YAML allows no tab there: use spaces)"
    ) in result.stderr


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("evaluation: {idle_s: 5}\n---\nstore: sqlite:///b.db\n", "2:1",
         "expected a single document in the stream at 1:1, but found another document"),
        ("evaluation:\n  idle_s: &t 5\n  key_window_s: &t 9\n", "3:17",
         "found duplicate anchor 't'; first occurrence at 2:11, second occurrence"),
    ],
    ids=["two documents", "an anchor twice"],
)  # fmt: skip
def test_a_yaml_error_relative_to_its_context_says_both(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    """PyYAML words some errors in two parts, the second relative to the first: the
    message said only 'not valid YAML: but found another document' or '… second occurrence'."""
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path, env={})
    assert str(caught.value) == f"{path}:{where}: not valid YAML: {problem}"


@pytest.mark.parametrize(
    "text",
    [
        "evaluation: {idle_s: " + "[" * 2000 + "]" * 2000 + "}\n",
        "store: " + "{a: " * 2000 + "1" + "}" * 2000 + "\n",
    ],
    ids=["lists", "mappings"],
)
def test_a_file_nested_too_deeply_stops_serve_with_a_message(tmp_path: Path, text: str) -> None:
    """PyYAML composes nested nodes by recursion: 2000 levels ended serve with a
    RecursionError traceback and exit code 1."""
    path, result = serve_refused(tmp_path, text)
    assert result.stderr == (
        f"durable-sessions-collector: invalid configuration: {path}: lists or mappings nested too deeply to read\n"
    )


def test_a_value_of_aliases_nested_many_times_over_is_refused_at_once(tmp_path: Path) -> None:
    """Aliases nest one list in another at no cost: eight levels of ten make 10^8 items,
    whose full ``repr`` in the error ("expected a positive number, got [[…") did not end
    (serve hung, its memory growing). The error quotes the value cut short."""
    levels = ["    - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"    - &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    path, result = serve_refused(tmp_path, "evaluation:\n  idle_s:\n" + "\n".join(levels) + "\n", timeout=30)
    assert (
        f"invalid configuration: {path}:2:3: evaluation.idle_s: expected a positive number, "
        "got [['x', 'x', 'x', 'x', ...]" in result.stderr
    )
    assert result.stderr.endswith("...]\n") and len(result.stderr) < 1000


@pytest.mark.parametrize(
    ("text", "column", "problem"),
    [
        ("idle_s: 2026-02-30", 11, "a value that looks like a date or time but is none (day is out of range for month)"),
        ("idle_s: 2026-01-01 25:00:00", 11, "a value that looks like a date or time but is none (hour must be in 0..23)"),
        ("idle_s: " + "9" * 5000, 11, "an integer of more than 4300 digits"),
    ],
    ids=["date", "time", "integer"],
)  # fmt: skip
def test_a_value_yaml_cannot_build_stops_serve_naming_its_place(
    tmp_path: Path, text: str, column: int, problem: str
) -> None:
    """PyYAML reads ``2026-02-30`` as a date and a run of digits as an integer, and raised
    ``ValueError`` (not a YAML error) for a day or hour out of range and past ``int``'s
    4300-digit text limit: serve ended in a traceback with exit code 1."""
    path, result = serve_refused(tmp_path, f"evaluation:\n  strict: true\n  {text}\n")
    assert f"invalid configuration: {path}:3:{column}: not valid YAML: {problem}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "variable", ["DURABLE_SESSIONS_AUTH_TOKEN_FILE", "DURABLE_SESSIONS_TLS_CLIENT_CA_FILE"]
)
def test_a_directory_given_for_a_file_is_named_a_directory(tmp_path: Path, variable: str) -> None:
    """A Secret volume's mount point given for the file in it was "no such file: '/etc/…'",
    which sent the user looking for a path that is there."""
    key = next(option.key for option in OPTIONS if option.env == variable)
    with pytest.raises(ConfigError) as caught:
        load(None, env={variable: str(tmp_path)})
    assert str(caught.value) == f"{key}: a directory, not a file: {str(tmp_path)!r} (from {variable})"


@pytest.mark.parametrize(
    "variable", ["DURABLE_SESSIONS_AUTH_TOKEN_FILE", "DURABLE_SESSIONS_TLS_CLIENT_CA_FILE"]
)
def test_a_file_setting_ending_in_a_line_break_names_the_file_without_it(
    tmp_path: Path, variable: str
) -> None:
    """A path from a Kubernetes ConfigMap or a ``$(cat …)`` ends in a line break, which
    every other setting is read without: the file was "no such file: '…\\n'"."""
    path = tmp_path / "secret"
    path.write_text(TOKEN + "\n")
    key = next(option for option in OPTIONS if option.env == variable)
    extra = {"DURABLE_SESSIONS_TLS_CERT_FILE": str(path), "DURABLE_SESSIONS_TLS_KEY_FILE": str(path)}
    env = {variable: f" {path}\n", **(extra if "TLS" in variable else {})}
    assert getattr(load(None, env=env), key.attr) == str(path)


@pytest.mark.parametrize("given", ["store", "/dev/zero"])
def test_a_config_that_is_no_configuration_file_is_refused_unread(tmp_path: Path, given: str) -> None:
    """``--config`` given the store (for ``--store``) or a device read the whole of it into
    memory, a store of gigabytes, or /dev/zero without end (serve hung, its memory
    growing), before saying it was not UTF-8."""
    path = Path(given) if given.startswith("/") else tmp_path / "sessions.db"
    if not given.startswith("/"):
        path.write_bytes(b"SQLite format 3\x00" + b"\x00" * (2 * 1024 * 1024))
    result = cli("config", "--config", str(path), timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"durable-sessions-collector: invalid configuration: {path}: more than 1048576 bytes, "
        "which no configuration file needs; is it the file meant?\n"
    )


def test_an_empty_config_flag_stops_serve_saying_so(tmp_path: Path) -> None:
    """``--config "$CONFIG"`` with ``CONFIG`` unset read the current directory as the file:
    "cannot read configuration file '.': Is a directory"."""
    result = cli("serve", "--config", "", "--store", f"sqlite:///{tmp_path / 's.db'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "durable-sessions-collector: invalid configuration: --config: an empty path; give the file, "
        "or leave --config out\n"
    )


def test_a_token_of_digits_unquoted_in_the_file_is_refused_saying_to_quote_it(tmp_path: Path) -> None:
    """A token of digits is a valid bearer token, and is taken from the variable; bare in
    the file YAML reads it as a number (``0``-led, of digits 0-7: octal), which no longer
    spells it. The error said only "expected a string"; it says why and what to do, never
    the value."""
    digits = "9" + str(uuid.uuid4().int)[:20]
    path, result = serve_refused(tmp_path, f"auth: {{token: {digits}}}\n")
    assert (
        f"{path}:1:8: auth.token: YAML read the token as a number: quote it in the file (value not shown)\n"
        in result.stderr
    )
    assert digits[:12] not in result.stderr
    path.write_text(f'auth: {{token: "{digits}"}}\n')
    assert (
        load(path, env={}).auth_token
        == digits
        == load(None, env={"DURABLE_SESSIONS_AUTH_TOKEN": digits}).auth_token
    )


def test_errors_and_sources_name_the_place_of_the_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(
        "# the sidecar\nreceivers:\n  grpc: {endpoint: 127.0.0.1:4319}\nevaluation:\n  idle_s: soon\n"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}:5:3: evaluation.idle_s: expected ")):
        load(path, env={})
    path.write_text("evaluation:\n  strict: true\n  idel_s: 3\n")
    with pytest.raises(
        ConfigError, match="^" + re.escape(f"{path}:3:3: evaluation.idel_s: unknown setting;")
    ):
        load(path, env={})
    path.write_text("receivers:\n  grpc: {endpoint: 127.0.0.1:4319}\nevaluation:\n\n  strict: true\n")
    sources = load(path, env={}).sources
    assert (sources["receivers.grpc.endpoint"], sources["evaluation.strict"]) == (
        f"{path}:2:10",
        f"{path}:5:3",
    )
    assert sources["evaluation.idle_s"] == "default"


def test_a_file_that_is_not_utf8_is_a_config_error_naming_its_place(tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_bytes("evaluation:\n  strict: true\nstore: sqlite:///café.db\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load(path, env={})
    assert str(caught.value) == f"{path}:3:21: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    path.write_bytes("evaluation: {idle_s: 4}\n".encode("utf-16"))  # with its byte order mark
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load(path, env={})
    path.write_bytes(b"\xef\xbb\xbfevaluation: {idle_s: 4}\n")  # UTF-8 with a byte order mark is UTF-8
    assert load(path, env={}).evaluation_idle_s == 4


def test_merge_keys_may_be_overridden_and_keep_their_place(tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text("evaluation:\n  <<: {idle_s: 5, strict: true}\n  idle_s: 9\n")
    config = load(path, env={})
    assert (config.evaluation_idle_s, config.evaluation_strict) == (9, True)
    assert (config.sources["evaluation.idle_s"], config.sources["evaluation.strict"]) == (
        f"{path}:3:3",
        f"{path}:2:3",  # the merge key's place
    )


_ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = document
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(node, dict):
            node[leaf] = value
    return document


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flat=st.dictionaries(st.sampled_from(sorted(KEYS)), _ANY_VALUE, max_size=4))
def test_fuzz_any_value_of_any_setting_loads_or_is_a_config_error(
    tmp_path: Path, flat: dict[str, Any]
) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(_nested(flat)))
    with contextlib.suppress(ConfigError):
        load(path, env={})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_fuzz_any_file_text_loads_or_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with contextlib.suppress(ConfigError):
        load(path, env={})


@settings(max_examples=300, deadline=None)
@given(option=st.sampled_from(OPTIONS), text=st.text(max_size=40))
def test_fuzz_any_environment_value_loads_or_is_a_config_error(option: Any, text: str) -> None:
    with contextlib.suppress(ConfigError):
        load(None, env={option.env: text})


# --- invalid configuration stops start-up, exit code 2 ----------------------------------------


@pytest.mark.parametrize(
    ("yaml_text", "args", "expected"),
    [
        ("evaluation: {idle: 3}\n", [], "collector.yaml:1:14: evaluation.idle: unknown setting; "),
        (
            "pipeline: {queue_size: many}\n",
            [],
            "pipeline.queue_size: expected a positive integer, got 'many'",
        ),
        ("evaluation: {strict: maybe}\n", [], "evaluation.strict: expected true or false"),
        ("receivers: {grpc: {endpoint: nowhere}}\n", [], "receivers.grpc.endpoint: expected host:port"),
        (
            "",
            ["--http-endpoint", "127.0.0.1:70000"],
            "receivers.http.endpoint: expected host:port with a port from 0 to 65535, got '127.0.0.1:70000' "
            "(from --http-endpoint)",
        ),
        ("store: mysql://db/x\n", [], "store: expected sqlite:///PATH"),
        (
            "tls: {cert_file: /nonexistent/cert.pem, key_file: /nonexistent/key.pem}\n",
            [],
            "collector.yaml:1:7: tls.cert_file: no such file: '/nonexistent/cert.pem'\n",
        ),
        ("evaluation: {idle_s: -5}\n", [], "evaluation.idle_s: expected a positive number, got -5"),
        (
            "alerts: {webhook: {max_attempts: -1}}\n",
            [],
            "alerts.webhook.max_attempts: expected a positive integer",
        ),
        ("evaluation: {idle_s: [1\n", [], "not valid YAML"),
        (None, [], "cannot read configuration file"),
        # Over gRPC's receive limit (a C int): start-up ended in an OverflowError traceback,
        # exit code 1, after the store was opened.
        # Longer than a thread can wait: every Export failed (503) with an OverflowError.
        (
            "pipeline: {ack_timeout_s: 1e12}\n",
            [],
            "pipeline.ack_timeout_s: expected at most 1000000000 seconds (about 31 years), got '1e12'",
        ),
        # An integer past float's range: a traceback (OverflowError) while the file was read.
        (
            "evaluation: {idle_s: 1" + "0" * 400 + "}\n",
            [],
            "evaluation.idle_s: expected at most 1000000000 seconds",
        ),
        ("", ["--retention-s", "2e9"], "retention.sessions_s: expected at most 1000000000 seconds"),
        # Past a float's range, as the metrics' gauges take it: an OverflowError traceback
        # at start (and a hang, the HTTP port bound and never started).
        (
            "",
            ["--http-max-connections", "1" + "0" * 400],
            "receivers.http.max_connections: expected a positive integer of at most 9007199254740992 (2^53)",
        ),
        (
            "receivers: {max_decoding_bytes: 9007199254740993}\n",
            [],
            "receivers.max_decoding_bytes: expected a positive integer of at most",
        ),
        # Past protobuf's Duration range: a 503's RetryInfo could not be written, a 500 went out.
        (
            "pipeline: {retry_after_s: 1000000000000}\n",
            [],
            "pipeline.retry_after_s: expected at most 1000000000",
        ),
        (
            "receivers: {max_request_bytes: 2147483648}\n",
            [],
            "receivers.max_request_bytes: expected a positive integer of at most 2147483647",
        ),
        # Endpoints the bind at start-up refused with "Name or service not known" or
        # grpcio's bare "Failed to bind", after the store was opened.
        (
            "receivers: {grpc: {endpoint: 'http://127.0.0.1:4319'}}\n",
            [],
            "collector.yaml:1:20: receivers.grpc.endpoint: expected host:port, without a scheme or path "
            "(e.g. 127.0.0.1:4319), got 'http://127.0.0.1:4319'\n",
        ),
        (
            "",
            ["--http-endpoint", "::1:4320"],
            "receivers.http.endpoint: expected host:port, with an IPv6 address in brackets (e.g. [::1]:4319), "
            "got '::1:4320' (from --http-endpoint)",
        ),
        (
            "",
            ["--grpc-endpoint", "127.0.0.1:\uff14\uff13\uff11\uff19"],
            "receivers.grpc.endpoint: expected host:port with a port from 0 to 65535",
        ),
        (
            "receivers: {http: {endpoint: 'my host:4320'}}\n",
            [],
            "receivers.http.endpoint: expected host:port, without spaces, got 'my host:4320'",
        ),
        # Both receivers on one port: the second bind said "Address already in use".
        (
            "receivers: {grpc: {endpoint: '127.0.0.1:4399'}}\n",
            ["--http-endpoint", "localhost:4399"],
            "receivers.http.endpoint: localhost:4399 takes the port of receivers.grpc.endpoint "
            "(127.0.0.1:4399, from ",
        ),
        (
            "",
            ["--max-request-bytes", "4294967296"],
            "receivers.max_request_bytes: expected a positive integer of at most 2147483647 (2 GiB - 1, "
            "the largest message protobuf and gRPC take), got '4294967296' (from --max-request-bytes)",
        ),
    ],
)
def test_invalid_configuration_stops_serve_with_exit_code_2(
    tmp_path: Path, yaml_text: str | None, args: list[str], expected: str
) -> None:
    _, result = serve_refused(tmp_path, yaml_text, *args)
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "s.db").exists()  # stopped before opening anything


def test_the_longest_ack_timeout_is_waited_for(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """1e9 s is the longest duration a setting may give; an Export then waits for its
    commit as with the default, and is answered OK."""
    sidecar = start_sidecar(pipeline__ack_timeout_s="1e9")
    attributes = {"session.id": "long-ack", "agent.action.id": "a", "agent.action.kind": "tool_call"}
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "name": "step",
        "startTimeUnixNano": "1700000000000000000",
        "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attributes.items()],
    }
    request = urllib.request.Request(
        sidecar.http_url + "/v1/traces",
        data=json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert (response.status, json.loads(response.read())) == (200, {})
    assert [a["action_id"] for a in sidecar.session("long-ack")["actions"]] == ["a"]


def test_the_largest_request_limit_grpc_takes_is_served(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """2 GiB - 1 is the largest ``receivers.max_request_bytes``, and both ports start with it."""
    sidecar = start_sidecar(receivers__max_request_bytes=str(2**31 - 1))
    assert sidecar.service.grpc_port and sidecar.service.http_port
    assert sidecar.get("/healthz")[0] == 200


def test_invalid_variable_stops_serve_naming_key_and_variable(tmp_path: Path) -> None:
    result = cli("serve", env=clean_env(DURABLE_SESSIONS_MAX_BATCH="0"))
    assert result.returncode == 2
    assert "pipeline.max_batch: expected a positive integer, got 0 (from DURABLE_SESSIONS_MAX_BATCH)" in (
        result.stderr
    )


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("DURABLE_SESSIONS_IDLE_S", "nan"),
        ("DURABLE_SESSIONS_ACK_TIMEOUT_S", "NaN"),
        ("DURABLE_SESSIONS_KEY_WINDOW_S", "inf"),
        ("DURABLE_SESSIONS_WEBHOOK_TIMEOUT_S", "Infinity"),
    ],
)
def test_nan_and_infinity_are_not_positive_numbers(variable: str, raw: str) -> None:
    """``nan`` compares false with everything (``nan <= 0`` is False), so it slipped past the
    positivity check: an idle_s of nan means no session ever ends. Infinity is no duration
    either. Both are errors naming the key and the variable."""
    key = next(o.key for o in OPTIONS if o.env == variable)
    with pytest.raises(ConfigError) as caught:
        load(None, env={variable: raw})
    assert str(caught.value).startswith(f"{key}: expected a positive number, got {raw!r}")
    assert f"(from {variable})" in str(caught.value)


def test_nan_in_the_file_stops_serve_with_exit_code_2(tmp_path: Path) -> None:
    """YAML's ``.nan`` is a float too: ``serve`` refuses it before opening anything."""
    _, result = serve_refused(tmp_path, "evaluation: {idle_s: .nan}\n", timeout=30)
    assert "evaluation.idle_s: expected a positive number, got nan" in result.stderr
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(
    ("text", "key", "raw"),
    [
        ("evaluation: {idle_s: 1e3}\n", "evaluation.idle_s", "1e3"),
        ("evaluation: {key_window_s: 8.64e4}\n", "evaluation.key_window_s", "8.64e4"),
        ("retention: {sessions_s: 6.048E5}\n", "retention.sessions_s", "6.048E5"),
        ("alerts:\n  webhook: {timeout_s: 25e-1}\n", "alerts.webhook.timeout_s", "25e-1"),
        ("pipeline: {ack_timeout_s: '7.5'}\n", "pipeline.ack_timeout_s", "7.5"),  # quoted: as a variable
    ],
)
def test_a_number_in_the_file_means_what_it_means_in_a_variable(
    tmp_path: Path, text: str, key: str, raw: str
) -> None:
    """YAML 1.1, which the file is read as, needs a dot and a signed exponent in a float
    (``1.0e+3``): ``1e3`` and ``8.64e4`` arrived as strings and were refused ("expected a
    positive number, got '1e3'"), while the same text in the variable was a number."""
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    option = next(o for o in OPTIONS if o.key == key)
    from_file = getattr(load(path, env={}), option.attr)
    assert from_file == float(raw) == getattr(load(None, env={option.env: raw}), option.attr)


@pytest.mark.parametrize(
    ("text", "key", "raw", "expected"),
    [
        ('pipeline: {queue_size: "64"}\n', "pipeline.queue_size", "64", 64),
        ("receivers: {max_request_bytes: '1048576'}\n", "receivers.max_request_bytes", "1048576", 1048576),
        ('evaluation: {attribute_value_limit: "4096"}\n', "evaluation.attribute_value_limit", "4096", 4096),
        ('evaluation: {strict: "true"}\n', "evaluation.strict", "true", True),
        ("alerts: {log: {enabled: 'off'}}\n", "alerts.log.enabled", "off", False),
        ('alerts: {otlp: {insecure: "false"}}\n', "alerts.otlp.insecure", "false", False),
    ],
)
def test_a_quoted_integer_or_boolean_in_the_file_means_what_it_means_in_a_variable(
    tmp_path: Path, text: str, key: str, raw: str, expected: Any
) -> None:
    """Templating tools (Helm's ``quote``, envsubst into ``"${VAR}"``) write every value as a
    string. A quoted number was read already; a quoted integer or boolean was refused
    with a message that contradicted itself: "expected a positive integer, got '64'"."""
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    option = next(o for o in OPTIONS if o.key == key)
    from_file = getattr(load(path, env={}), option.attr)
    assert from_file == expected == getattr(load(None, env={option.env: raw}), option.attr)
    assert type(from_file) is type(expected)


@pytest.mark.parametrize("raw", ["1", "0", "true", "false", "yes", "No", "ON", "off"])
@pytest.mark.parametrize(
    ("key", "template"),
    [
        ("evaluation.strict", "evaluation: {strict: RAW}"),
        ("alerts.log.enabled", "alerts: {log: {enabled: RAW}}"),
        ("alerts.otlp.insecure", "alerts: {otlp: {insecure: RAW}}"),
    ],
)
def test_a_boolean_unquoted_in_the_file_means_what_it_means_in_a_variable(
    tmp_path: Path, key: str, template: str, raw: str
) -> None:
    """Every spelling a variable takes, written bare in the file. ``strict: 1`` arrived as
    the number 1 and was refused ("expected true or false, got 1") while
    ``DURABLE_SESSIONS_STRICT=1`` was true; YAML 1.1's yes/no/on/off were read already."""
    path = tmp_path / "collector.yaml"
    path.write_text(template.replace("RAW", raw) + "\n")
    option = next(o for o in OPTIONS if o.key == key)
    from_file = getattr(load(path, env={}), option.attr)
    assert from_file is getattr(load(None, env={option.env: raw}), option.attr)
    assert from_file is (raw.lower() in ("1", "true", "yes", "on"))


@pytest.mark.parametrize(
    ("flag", "key"), [("--strict", "evaluation.strict"), ("--alerts-otlp-insecure", "alerts.otlp.insecure")]
)
def test_a_true_false_flag_given_alone_means_true(tmp_path: Path, flag: str, key: str) -> None:
    """``durable-sessions check --strict`` takes no value; ``serve --strict`` stopped with
    'argument --strict: expected one argument'. It means true alone, and still takes one."""
    path = tmp_path / "collector.yaml"
    path.write_text("alerts: {log: {enabled: false}}\n")
    for argv, expected in (([flag], True), ([flag, "false"], False), (["--alert-log"], True)):
        result = cli("config", "--config", str(path), *argv)
        assert result.returncode == 0, result.stderr
        shown = json.loads(result.stdout)
        which = key if argv[0] == flag else "alerts.log.enabled"
        assert (shown["settings"][which], shown["sources"][which]) == (expected, argv[0])


@pytest.mark.parametrize("raw", ["2", "-1", "1.0"])
def test_a_number_other_than_1_or_0_is_not_a_boolean_in_the_file_nor_in_a_variable(
    tmp_path: Path, raw: str
) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(f"evaluation: {{strict: {raw}}}\n")
    for source in (lambda: load(path, env={}), lambda: load(None, env={"DURABLE_SESSIONS_STRICT": raw})):
        with pytest.raises(ConfigError, match=r"evaluation\.strict: expected true or false"):
            source()


def test_a_blank_header_value_in_the_file_stops_serve_naming_the_key(tmp_path: Path) -> None:
    """A header value of spaces is empty, in the file as in the variable's key=value form: an
    error naming alerts.otlp.headers (exit code 2), not a crash while the log's secrets are
    collected, and the message does not repeat the value."""
    path = tmp_path / "collector.yaml"
    path.write_text('alerts:\n  otlp: {endpoint: "127.0.0.1:4317", headers: {x-api-key: "   "}}\n')
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}:2:38: alerts\.otlp\.headers: header 'x-api-key': expected a non-empty",
    ):
        load(path, env={})
    result = cli(
        "serve",
        "--config",
        str(path),
        "--store",
        f"sqlite:///{tmp_path / 's.db'}",
        "--grpc-endpoint",
        "127.0.0.1:0",
        "--http-endpoint",
        "127.0.0.1:0",
        timeout=30,
    )
    assert "Traceback" not in result.stderr, result.stderr[-400:]
    assert result.returncode == 2
    assert f"invalid configuration: {path}:2:38: alerts.otlp.headers: header 'x-api-key'" in result.stderr


@pytest.mark.parametrize(
    "headers",
    [
        "Authorization: Bearer s3cretT0kenValue",  # a header line, not key=value
        "Authorization: Bearer s3cretT0kenValue==",  # the same, its base64 padding read as '='
        "x-api-key=abc,s3cretT0kenValue",  # a comma in the value, not percent-encoded
    ],
)
def test_a_malformed_headers_setting_never_shows_its_values(headers: str, tmp_path: Path) -> None:
    """alerts.otlp.headers errors named the item they could not read, and so printed the
    credential: 'got 'Authorization: Bearer <token>' alone', or as the key before a
    base64 token's '='. They say which item and what is wrong, not what it holds."""
    env = {**clean_env(), "DURABLE_SESSIONS_ALERTS_OTLP_HEADERS": headers}
    result = cli("serve", "--alerts-otlp-endpoint", "127.0.0.1:4317", "--store",
                 f"sqlite:///{tmp_path / 's.db'}", env=env, timeout=30)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "invalid configuration: alerts.otlp.headers: " in result.stderr
    assert "s3cretT0kenValue" not in result.stderr, result.stderr
    assert "item " in result.stderr and "key=value" in result.stderr, result.stderr


def test_an_invalid_header_key_is_named() -> None:
    """A key that is one word (no space or ':', so no credential) is still named."""
    with pytest.raises(ConfigError, match=r"'grpc-timeout' is not a valid gRPC metadata key"):
        load(None, env={"DURABLE_SESSIONS_ALERTS_OTLP_HEADERS": "grpc-timeout=1S"})


@pytest.mark.parametrize(
    ("grpc", "http", "refused"),
    [
        ("127.0.0.1:4399", "127.0.0.1:4399", True),
        ("127.0.0.1:4399", "127.0.0.1:04399", True),
        ("localhost:4399", "[::1]:4399", True),
        ("0.0.0.0:4399", "127.0.0.1:4399", True),
        ("[::]:4399", "127.0.0.1:4399", True),
        ("0.0.0.0:4399", "sidecar.example:4399", True),
        # Each of these binds two addresses, as the OS allows.
        ("127.0.0.1:0", "127.0.0.1:0", False),
        ("127.0.0.1:4399", "[::1]:4399", False),
        ("[::1]:4399", "localhost:4399", False),  # the HTTP server listens on a name's IPv4
        ("0.0.0.0:4399", "[::1]:4399", False),
        ("127.0.0.1:4399", "127.0.0.2:4399", False),
        ("127.0.0.1:4399", "127.0.0.1:4400", False),
    ],
)
def test_both_receivers_on_one_address_and_port_is_an_error_naming_both_keys(
    grpc: str, http: str, refused: bool
) -> None:
    env = {"DURABLE_SESSIONS_GRPC_ENDPOINT": grpc, "DURABLE_SESSIONS_HTTP_ENDPOINT": http}
    if not refused:
        assert load(None, env=env).receivers_http_endpoint == http
        return
    with pytest.raises(ConfigError) as caught:
        load(None, env=env)
    assert str(caught.value) == (
        f"receivers.http.endpoint: {http} takes the port of receivers.grpc.endpoint ({grpc}, from "
        "DURABLE_SESSIONS_GRPC_ENDPOINT); each receiver needs its own port (from DURABLE_SESSIONS_HTTP_ENDPOINT)"
    )


def test_an_ipv6_http_endpoint_is_served(tmp_path: Path) -> None:
    """``[::1]:PORT`` is a valid endpoint for both ports: the HTTP port listens on ::1 (and
    answers there) as the gRPC port does."""
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    served = Served(
        "--store",
        f"sqlite:///{tmp_path / 's.db'}",
        "--grpc-endpoint",
        "[::1]:0",
        "--http-endpoint",
        "[::1]:0",
    )
    try:
        started = served.read_until("started", timeout=30)
        assert started["http_port"] > 0
        status, _, body = http(f"http://[::1]:{started['http_port']}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
    finally:
        served.kill()


# --- secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        (f"auth: {TOKEN}\n", "auth: expected a mapping of settings, e.g. auth: {token: …}, got a string"),
        (
            f"alerts:\n  webhook: https://hooks.example/services/{TOKEN}\n",
            "alerts.webhook: expected a mapping of settings, e.g. alerts: {webhook: {url: …}}, got a string",
        ),
    ],
)
def test_a_secret_given_to_a_section_stops_serve_without_showing_it(
    tmp_path: Path, yaml_text: str, expected: str
) -> None:
    """A secret written a level too high (``auth: TOKEN`` for ``auth: {token: TOKEN}``)
    is refused naming the section and its line, and never quoted back: the error used to
    repeat the value, the token or the webhook's secret path."""
    path, result = serve_refused(tmp_path, yaml_text)
    assert f"invalid configuration: {path}:{yaml_text.count(chr(10))}:" in result.stderr
    assert expected in result.stderr
    assert TOKEN not in result.stderr + result.stdout


def test_config_output_hides_every_secret(tmp_path: Path) -> None:
    env = clean_env(
        DURABLE_SESSIONS_AUTH_TOKEN=TOKEN,
        DURABLE_SESSIONS_WEBHOOK_URL="https://hookuser:hookpass-123456@alerts.example/h?sig=hooksig-abcdef",
        DURABLE_SESSIONS_ALERTS_OTLP_HEADERS="authorization=Bearer%20otlpsecret-987654",
        DURABLE_SESSIONS_STORE="postgresql://ds:dbpass-424242@db.internal:5432/ds?password=qpass-777777",
    )
    result = cli("config", env=env)
    assert result.returncode == 0, result.stderr
    for secret in (
        TOKEN,
        "hookpass-123456",
        "hooksig-abcdef",
        "otlpsecret-987654",
        "dbpass-424242",
        "qpass-777777",
    ):
        assert secret not in result.stdout + result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert settings["auth.token"] == "***"
    assert settings["alerts.otlp.headers"] == {"authorization": "***"}
    assert settings["alerts.webhook.url"] == "https://***@alerts.example/***?sig=***"


def test_secrets_never_reach_the_log(tmp_path: Path) -> None:
    """Token, webhook credentials and query value are redacted in every line (the ``started``
    line logs the store URL; a webhook that fails logs its error)."""
    hook_password = "hookpass-" + uuid.uuid4().hex[:8]
    hook_sig = "hooksig-" + uuid.uuid4().hex[:8]
    with WebhookServer(fail_first=None, fail_status=500) as hook:
        url = hook.url.replace("http://", f"http://hookuser:{hook_password}@") + f"?sig={hook_sig}"
        config = loopback_config(
            f"sqlite:///{tmp_path / 's.db'}",
            {
                "auth.token": TOKEN,
                "alerts.webhook.url": url,
                "alerts.webhook.max_attempts": "2",
                "alerts.webhook.backoff_s": "0.05",
                "log_level": "DEBUG",
            },
        )
        log = LineBuffer()
        service = Service(config, log_stream=log).start()
        try:
            agent = Agent(
                grpc_exporter(f"127.0.0.1:{service.grpc_port}", headers={"authorization": f"Bearer {TOKEN}"}),
                "inc-1",
            )
            agent.action("leak-1", "a1", "payment")  # unkeyed-side-effect → an alert
            agent.shutdown()
            wait_for(lambda: any(line["event"] == "alert-dead-letter" for line in log.lines()), timeout=30)
            status, _, _ = http(f"http://127.0.0.1:{service.http_port}/api/sessions", token="wrong-" + TOKEN)
            assert status == 401
        finally:
            service.stop()
    text = json.dumps(log.lines())
    for secret in (TOKEN, hook_password, hook_sig):
        assert secret not in text
    assert len(hook.requests) == 2 and hook.requests[0].headers["authorization"].startswith("Basic ")


@pytest.mark.parametrize(
    ("store", "shown"),
    [
        (
            "postgresql+psycopg://ds:dbpass-424242@db.internal/ds",  # SQLAlchemy spelling
            "postgresql+psycopg://ds:***@db.internal/ds",
        ),
        (
            "mysql://ds:dbpass-424242@db.internal/ds?password=dbpass-424242",
            "mysql://ds:***@db.internal/ds?password=***",
        ),
    ],
)
def test_an_unsupported_store_url_is_quoted_without_its_password(store: str, shown: str) -> None:
    """The error for a store URL of another scheme quotes it back (so the user sees which
    setting is wrong), with its password hidden, as for a postgresql:// URL: ``serve`` and
    ``config`` print it on stderr."""
    with pytest.raises(ConfigError) as caught:
        load(None, env={"DURABLE_SESSIONS_STORE": store})
    assert "store: expected sqlite:///PATH" in str(caught.value)
    assert f"got {shown!r}" in str(caught.value)
    assert "dbpass-424242" not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://ds@h/db?schema=s", "postgresql://ds@h/db?schema=s"),
        ("postgresql://ds:pw@h:5432/db?schema=s", "postgresql://ds:***@h:5432/db?schema=s"),
        (
            "postgresql://ds@h/db?sslmode=require&password=p%26w&schema=s",
            "postgresql://ds@h/db?sslmode=require&password=***&schema=s",
        ),
        ("postgresql://ds@h/db?sslpassword=keypass", "postgresql://ds@h/db?sslpassword=***"),
        ("postgresql://ds:p@ss@h:5x/db", "postgresql://ds:***@h:5x/db"),  # malformed: still redacted
        ("postgresql://ds:pw@[::1/db", "postgresql://ds:***@[::1/db"),
        ("sqlite:///var/x.db", "sqlite:///var/x.db"),
    ],
)
def test_store_urls_are_shown_with_every_password_hidden(url: str, shown: str) -> None:
    """One rule for ``config`` output, configuration errors and the store's own messages:
    the password of the authority and of ``?password=`` (which libpq reads as well) is
    ``***``; user, host, database and the other parameters stay, to tell which store."""
    assert redact_store_url(url) == shown


def test_config_output_hides_a_percent_encoded_query_password() -> None:
    """``config`` shows the store URL as written, so the password is hidden where it is
    written, not only in its decoded form (``p%2Fw`` is ``p/w``)."""
    config = load(None, env={"DURABLE_SESSIONS_STORE": "postgresql://ds@h/db?password=p%2Fw-secret&schema=s"})
    assert config.display()["store"] == "postgresql://ds@h/db?password=***&schema=s"
    assert "p%2Fw-secret" in config.secrets() and "p/w-secret" in config.secrets()


def test_a_query_password_is_hidden_when_the_store_cannot_be_opened(tmp_path: Path) -> None:
    """A PostgreSQL store that cannot be reached stops ``serve`` (exit 2) with an error that
    names the store: the ``?password=`` value, which libpq reads like the authority's, is
    ``***`` there too."""
    pytest.importorskip("psycopg")
    secret = "qpass-" + uuid.uuid4().hex[:8]
    store = f"postgresql://ds@127.0.0.1:{free_port()}/ds?password={secret}&connect_timeout=2"
    result = cli(
        "serve",
        "--grpc-endpoint",
        "127.0.0.1:0",
        "--http-endpoint",
        "127.0.0.1:0",
        env=clean_env(DURABLE_SESSIONS_STORE=store),
        timeout=60,
    )
    assert result.returncode == 2 and "cannot open store" in result.stderr
    assert secret not in result.stderr
    assert "?password=***&connect_timeout=2" in result.stderr


def test_a_short_webhook_query_value_leaves_the_log_lines_intact(tmp_path: Path) -> None:
    """A webhook URL's query values are hidden wherever the URL is printed; only values long
    enough to be secrets go to the log's redactor, which replaces every occurrence. With
    ``?v=1`` registered, every '1' became '***': the ``ts`` numbers, the version and the
    ports, and the lines were no longer JSON. Each line must be one JSON object with its
    fields unchanged."""
    assert "1" not in url_secrets("https://hooks.example/ingest?v=1")
    config = loopback_config(
        f"sqlite:///{tmp_path / 's.db'}", {"alerts.webhook.url": "https://hooks.example/ingest?v=1"}
    )
    log = LineBuffer()
    service = Service(config, log_stream=log).start()
    service.stop()
    lines = log.lines()  # json.loads of each line: raises if one is not JSON
    started = next(line for line in lines if line["event"] == "started")
    assert isinstance(started["ts"], float)
    assert started["http_port"] == service.http_port and started["store"] == config.store


def test_a_webhook_url_shows_where_alerts_go_and_hides_a_secret_path() -> None:
    # The whole URL was registered with the log's redactor, secret or not: every delivery
    # line said "url": "***", whichever receiver failed. Webhook services put their secret
    # in the path (hooks.slack.com/services/T0/B0/X…), which config and the log showed.
    plain = "http://127.0.0.1:9/"
    assert url_secrets(plain) == [] and redact_url(plain, hide_path=True) == plain
    capability = "https://hooks.example/services/T0AAAA/B0BBBB/XyzSecret123"
    assert redact_url(capability, hide_path=True) == "https://hooks.example/***"
    assert url_secrets(capability) == [capability, "/services/T0AAAA/B0BBBB/XyzSecret123"]
    stream = io.StringIO()
    RedactingStream(stream, url_secrets(capability)).write(
        json.dumps({"url": redact_url(capability, hide_path=True), "raw": capability}) + "\n"
    )
    assert json.loads(stream.getvalue()) == {"url": "https://hooks.example/***", "raw": "***"}


def test_the_redactor_keeps_each_json_line_valid_whatever_the_secret() -> None:
    """A secret that reads like a number or a literal (``1``, ``true``) is replaced inside
    the JSON strings only: numbers and literals stay, and a secret with a quote or a
    backslash (a store password may hold both) leaves the line valid JSON.
    Text that is not a JSON line has every occurrence replaced."""
    out = io.StringIO()
    stream = RedactingStream(out, ["1", "true", 'pa"ss\\wd'])
    line = {"ts": 1.25, "ok": True, "n": 11, "store": 'postgresql://u:pa"ss\\wd@h/db', "id": "a1"}
    stream.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
    stream.write("plain text 1 true\n")
    first, second = out.getvalue().splitlines()
    assert json.loads(first) == {
        "ts": 1.25,
        "ok": True,
        "n": 11,
        "store": "postgresql://u:***@h/db",
        "id": "a***",
    }
    assert second == "plain text *** ***"


# --- shutdown ---------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_a_signal(tmp_path: Path, signum: int) -> None:
    served = Served.on_free_ports(f"sqlite:///{tmp_path / 's.db'}")
    try:
        started = served.read_until("started")
        status, _, body = http(f"http://127.0.0.1:{started['http_port']}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        served.process.send_signal(signum)
        code, stderr = served.finish()
    finally:
        served.kill()
    assert code == 0, stderr
    assert "Traceback" not in stderr
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert events[-2:] == ["signal", "stopped"]
    with socket.socket() as probe:  # the port is released (no listener left)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", started["http_port"]))


def test_serve_keeps_running_on_sighup_and_says_so(tmp_path: Path) -> None:
    # Before, SIGHUP (a closed terminal, or `kill -HUP` meant as "reload") ended the
    # process at once: no line, no clean stop.
    served = Served.on_free_ports(f"sqlite:///{tmp_path / 's.db'}")
    try:
        started = served.read_until("started")
        served.process.send_signal(signal.SIGHUP)
        line = served.read_until("signal")
        assert (line["signal"], line["action"]) == ("SIGHUP", HANGUP_ACTION)
        status, _, body = http(f"http://127.0.0.1:{started['http_port']}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"} and served.process.poll() is None
        served.process.send_signal(signal.SIGTERM)
        code, stderr = served.finish()
    finally:
        served.kill()
    assert code == 0, stderr
    assert [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")][-2:] == [
        "signal",
        "stopped",
    ]


def test_a_signal_while_the_store_does_not_answer_waits_and_a_second_ends_at_once() -> None:
    # The handlers are in place before the start (a signal right after the "started" line
    # found Python's defaults); a start that hangs must still be ended by asking again.
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        served = Served.on_free_ports(f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/test")
        try:
            silent.settimeout(60)
            connection, _ = silent.accept()  # the start is connecting to the store
            served.process.send_signal(signal.SIGTERM)
            assert served.read_until("signal")["signal"] == "SIGTERM"
            time.sleep(0.5)
            assert served.process.poll() is None  # still starting: it stops once started
            served.process.send_signal(signal.SIGTERM)
            code, _ = served.finish(timeout=10)
            connection.close()
        finally:
            served.kill()
    assert code == 128 + signal.SIGTERM


# --- the sessions CLI -------------------------------------------------------------------------


def test_sessions_cli_errors_have_one_line_and_exit_codes(start_sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(auth__token=TOKEN)
    endpoint = sidecar.http_url
    # 401: no token, wrong token.
    code, _, err = run_main(capsys, "sessions", "--endpoint", endpoint, "list")
    assert code == 1 and "refused the request (401" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_main(capsys, "sessions", "--endpoint", endpoint, "--token", "x" * 20, "list")
    assert code == 1 and "401 invalid bearer token" in err
    # 404.
    code, _, err = run_main(capsys, "sessions", "--endpoint", endpoint, "--token", TOKEN, "show", "nope")
    assert code == 1 and "answered 404: no session 'nope'" in err
    # Bad verdict, bad limit: usage errors, exit 2.
    code, _, err = run_main(capsys, "sessions", "--endpoint", endpoint, "list", "--verdict", "bad")
    assert code == 2 and "invalid choice: 'bad'" in err
    code, _, err = run_main(
        capsys, "sessions", "--endpoint", endpoint, "--token", TOKEN, "list", "--limit", "0"
    )
    assert code == 2 and "--limit must be from 1 to 1000" in err
    # The token never appears.
    assert TOKEN not in err
    # Sidecar down.
    code, _, err = run_main(capsys, "sessions", "--endpoint", f"127.0.0.1:{free_port()}", "list")
    assert code == 1 and "cannot reach the sidecar" in err and "is it running?" in err


def test_sessions_cli_token_file_flag_beats_the_token_variable(
    start_sidecar, tmp_path, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A flag beats the environment: ``--token-file`` is used even when
    $DURABLE_SESSIONS_AUTH_TOKEN is set (a stale one, or the sidecar's own on the same
    host)."""
    sidecar = start_sidecar(auth__token=TOKEN)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("DURABLE_SESSIONS_AUTH_TOKEN", "stale-token-0123456789")
    code, out, err = run_main(
        capsys, "sessions", "--endpoint", sidecar.http_url, "--token-file", str(tmp_path / "token"), "list"
    )
    assert code == 0, err
    assert out == "no sessions\n"


def test_sessions_cli_on_the_grpc_port_is_a_one_line_error_with_a_hint(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """The gRPC port does not answer HTTP/1.1, the likeliest mistake: exit code 1 and one
    line that says to use the HTTP port, not a traceback."""
    sidecar = start_sidecar()
    result = cli("sessions", "--endpoint", sidecar.grpc_endpoint, "list", timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-300:]
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "is it the sidecar's HTTP port (not the gRPC one)" in result.stderr


@pytest.mark.parametrize("endpoint", ["127.0.0.1:43x0", "http://[::1", "http://127.0.0.1:70000"])
def test_sessions_cli_malformed_endpoint_is_a_usage_error(endpoint: str) -> None:
    """An endpoint that is not an http(s) URL with a numeric port is bad usage: exit code 2
    (as documented in the README's "CLI: sessions") and one line naming --endpoint, not a
    traceback from urllib."""
    result = cli("sessions", "--endpoint", endpoint, "list", timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-300:]
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("durable-sessions-collector: --endpoint must be an http(s) URL")


# --- /metrics and /healthz --------------------------------------------------------------------


def documented_metrics() -> dict[str, set[str]]:
    section = README.split("Metrics (`GET /metrics`):", 1)[1].split("\n\n", 1)[0]
    found = {}
    for name, labels in re.findall(r"`(durable_sessions_[a-z_]+)(?:\{([a-z_,]+)\})?`", section):
        found[name] = set(labels.split(",")) if labels else set()
    return found


def test_metrics_names_and_labels_match_the_readme(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    documented = documented_metrics()
    assert len(documented) == 29
    with WebhookServer() as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url)
        agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
        agent.action("m-1", "a1", "payment")  # a violation: alerts on the log and webhook channels
        agent.action("m-1", "a1", "payment")  # the same action id again
        agent.shutdown()
        bad = {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": "zz" * 16,
                                    "spanId": "eee19b7ec3c1b175",
                                    "name": "x",
                                    "attributes": [{"key": "session.id", "value": {"stringValue": "m-1"}}],
                                }
                            ]
                        }
                    ]
                }
            ]
        }
        status, _, _ = http(
            sidecar.http_url + "/v1/traces",
            method="POST",
            data=json.dumps(bad).encode(),
            content_type="application/json",
        )
        assert status == 200
        wait_for(lambda: hook.accepted)
        wait_for(
            lambda: (
                sidecar.metric(
                    "durable_sessions_alert_deliveries_total", channel="webhook", outcome="delivered"
                )
                >= 1
            )
        )
        status, _, text = http(sidecar.http_url + "/metrics")
    assert status == 200
    labels: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = (
                re.sub(r"_(bucket|count|sum)$", "", sample.name)
                if family.type == "histogram"
                else sample.name
            )
            labels.setdefault(name, set()).add(frozenset(sample.labels) - {"le"})
    for name, expected in documented.items():
        if name in (
            "durable_sessions_credential_reloads_total",
            "durable_sessions_tls_certificate_expiry_timestamp_seconds",
        ):
            # Only with credentials read from files, or TLS (security/test_credential_rotation.py).
            assert name not in labels
            continue
        assert name in labels, f"{name} has no sample"
        assert labels[name] == {frozenset(expected)}, (name, labels[name])
    ours = {n for n in labels if n.startswith("durable_sessions_")}
    assert ours <= set(documented), ours - set(documented)


def test_healthz_is_open_and_metrics_need_the_token(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(auth__token=TOKEN)
    status, _, body = http(sidecar.http_url + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, _ = http(sidecar.http_url + "/healthz", method="HEAD")
    assert status == 200
    status, headers, _ = http(sidecar.http_url + "/metrics")
    assert status == 401 and headers["WWW-Authenticate"].startswith('Bearer realm="durable-sessions"')
    assert http(sidecar.http_url + "/metrics", token=TOKEN)[0] == 200
    status, _, _ = http(sidecar.http_url + "/healthz", method="POST", data=b"")
    assert status == 401  # only GET/HEAD /healthz is open


def break_the_store(path: str) -> None:
    """Make the running sidecar's store unreadable for real: its ``meta`` table is gone."""
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE meta")
    db.close()


def test_healthz_tells_the_reason_only_to_a_caller_with_the_token(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """README "Security": the open ``GET /healthz`` reveals only ok/unhealthy. The reason of a
    503 names the store (its file, or PostgreSQL's user@host/db): only a request with the
    token gets it."""
    sidecar = start_sidecar(auth__token=TOKEN)
    break_the_store(str(tmp_path / "sessions.db"))
    status, _, body = http(sidecar.http_url + "/healthz")
    assert status == 503
    assert json.loads(body) == {"status": "unhealthy"}
    status, _, body = http(sidecar.http_url + "/healthz", token="wrong-" + TOKEN)
    assert status == 503 and json.loads(body) == {"status": "unhealthy"}
    status, _, body = http(sidecar.http_url + "/healthz", token=TOKEN)
    assert status == 503
    assert json.loads(body) == {
        "status": "unhealthy",
        "reason": f"store {str(tmp_path / 'sessions.db')!r} cannot be read: no such table: meta",
    }


def test_healthz_tells_the_reason_when_no_token_is_configured(start_sidecar, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Without a token nothing on the port is private: the 503 says why."""
    sidecar = start_sidecar()
    break_the_store(str(tmp_path / "sessions.db"))
    status, _, body = http(sidecar.http_url + "/healthz")
    assert status == 503 and "cannot be read: no such table: meta" in json.loads(body)["reason"]


# --- examples in the documentation ------------------------------------------------------------


def test_the_readme_example_store_is_an_absolute_path() -> None:
    """By the table's own rule (``sqlite:///PATH`` relative, ``sqlite:////abs/path``
    absolute) the README example, the module's example and the error's hint must use four
    slashes for /var/lib, as docs/deployment.md does: three would store under the working
    directory."""
    example = next(b for b in yaml_blocks(README) if "store:" in b)
    store = yaml.safe_load(example)["store"]
    path = load(None, env={"DURABLE_SESSIONS_STORE": store}).store_path
    assert os.path.isabs(path), f"{store} is stored at ./{path}"
    assert "sqlite:///var/" not in (config_module.__doc__ or "")
    with pytest.raises(ConfigError) as caught:
        load(None, env={"DURABLE_SESSIONS_STORE": "mysql://h/db"})
    assert "e.g. sqlite:////var/lib/durable-sessions/sessions.db" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "tls:\n  cert_file: {cert}\n",
            "{path}:2:3: tls.key_file: required when tls.cert_file is set",
        ),
        (
            "tls:\n  client_ca_file: {cert}\n",
            "{path}:2:3: tls.cert_file: required when tls.client_ca_file is set",
        ),
        (
            "auth:\n  token: abcdefghijklmnopq\n  token_file: {cert}\n",
            "{path}:3:3: auth.token_file: set either auth.token or auth.token_file, not both; "
            "auth.token is set in {path}:2:3",
        ),
        (
            "alerts:\n  webhook:\n    backoff_s: 10\n    max_backoff_s: 5\n",
            "{path}:4:5: alerts.webhook.max_backoff_s: must be at least alerts.webhook.backoff_s (10), got 5",
        ),
        (
            "receivers:\n  grpc: {{endpoint: '127.0.0.1:4399'}}\n  http: {{endpoint: '127.0.0.1:4399'}}\n",
            "{path}:3:10: receivers.http.endpoint: 127.0.0.1:4399 takes the port of receivers.grpc.endpoint "
            "(127.0.0.1:4399, from {path}:2:10); each receiver needs its own port",
        ),
    ],
)
def test_a_setting_that_does_not_go_with_another_in_the_file_is_placed_as_compilers_do(
    tmp_path: Path, text: str, expected: str
) -> None:
    """The README's promise for every error about a key of the file, those that weigh two
    settings together included: ``FILE:LINE:COLUMN: KEY: message``. They said ``KEY:
    message (from FILE:LINE:COLUMN)``, which editors and CI annotations do not jump to."""
    cert = tmp_path / "cert.pem"
    cert.write_text("not read here\n")
    path = tmp_path / "collector.yaml"
    _, result = serve_refused(tmp_path, text.format(cert=cert))
    assert (
        result.stderr == f"durable-sessions-collector: invalid configuration: {expected.format(path=path)}\n"
    )
