"""Configuration: defaults, file < environment < flags, and errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from durable_sessions_collector.cli import main
from durable_sessions_collector.config import OPTIONS, ConfigError, load, reference

EXAMPLE = """
receivers:
  grpc: {endpoint: 127.0.0.1:5319}
  http: {endpoint: 127.0.0.1:5320}
store: sqlite:///var/lib/durable-sessions/sessions.db
evaluation: {idle_s: 45, key_window_s: 3600, strict: true}
alerts:
  webhook: {url: https://alerts.example/hook, max_attempts: 8}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "collector.yaml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback_with_the_otlp_limits() -> None:
    config = load(None, env={})
    assert config.receivers_grpc_endpoint == "127.0.0.1:4319"
    assert config.receivers_http_endpoint == "127.0.0.1:4320"
    assert config.receivers_max_request_bytes == 64 * 1024 * 1024
    assert config.receivers_max_decoding_bytes == 1024 * 1024 * 1024
    assert config.evaluation_idle_s == 30 and config.evaluation_strict is False
    assert set(config.sources.values()) == {"default"}


def test_the_issue_example_file_loads(tmp_path: Path) -> None:
    config = load(write(tmp_path, EXAMPLE), env={})
    assert config.receivers_grpc_endpoint == "127.0.0.1:5319"
    assert config.store_path == "var/lib/durable-sessions/sessions.db"
    assert (config.evaluation_idle_s, config.evaluation_key_window_s, config.evaluation_strict) == (
        45,
        3600,
        True,
    )
    assert config.alerts_webhook_url == "https://alerts.example/hook"
    assert (
        config.sources["evaluation.idle_s"] == f"{tmp_path / 'collector.yaml'}:6:14"
    )  # the key's line and column


def test_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    path = write(tmp_path, EXAMPLE)
    env = {"DURABLE_SESSIONS_IDLE_S": "12.5", "DURABLE_SESSIONS_GRPC_ENDPOINT": "127.0.0.1:6000"}
    config = load(path, env=env, overrides={"evaluation_idle_s": "7"})
    assert config.receivers_grpc_endpoint == "127.0.0.1:6000"
    assert config.evaluation_idle_s == 7
    assert config.sources["evaluation.idle_s"] == "--idle-s"
    assert config.sources["receivers.grpc.endpoint"] == "DURABLE_SESSIONS_GRPC_ENDPOINT"
    # The config file itself can come from the environment.
    assert load(None, env={"DURABLE_SESSIONS_CONFIG": str(path)}).evaluation_idle_s == 45


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        (
            "evaluation: {idle_s: soon}",
            {},
            "collector.yaml:1:14: evaluation.idle_s: expected a positive number, got 'soon'",
        ),
        ("evaluation: {idle_s: -1}", {}, "evaluation.idle_s: expected a positive number, got -1"),
        (
            "",
            {"DURABLE_SESSIONS_IDLE_S": "soon"},
            "evaluation.idle_s: expected a positive number, got 'soon' (from DURABLE_SESSIONS_IDLE_S)",
        ),
        ("receivers: {grpc: {endpoint: nowhere}}", {}, "receivers.grpc.endpoint: expected host:port"),
        ("receivers: {grpc: {endpoint: '127.0.0.1:99999'}}", {}, "port from 0 to 65535"),
        ("store: mysql://x", {}, "store: expected sqlite:///PATH"),
        ("store: 'postgresql://u@h/db?schema=a-b'", {}, "store: schema must be a plain identifier"),
        ("evaluation: {strict: maybe}", {}, "evaluation.strict: expected true or false"),
        ("evaluation: {idle: 3}", {}, "evaluation.idle: unknown setting"),
        ("receivers: 4", {}, "receivers: expected a mapping of settings"),
        ("pipeline: {queue_size: 0}", {}, "pipeline.queue_size: expected a positive integer, got 0"),
        ("alerts: {webhook: {url: 'ftp://x'}}", {}, "alerts.webhook.url: expected an http(s) URL"),
        (
            "",
            {"DURABLE_SESSIONS_WEBHOOK_URL": "https://hooks.example/T0KEN-abcdef123?sig=SIGNATURE 99"},
            "alerts.webhook.url: the URL holds a space or control character, which no request can carry "
            "(percent-encode it: a space is %20), got 'https://hooks.example/***?sig=***'",
        ),
        (
            'alerts: {webhook: {url: "https://hooks.example/T0\\tKEN"}}',
            {},
            "alerts.webhook.url: the URL holds a space or control character",
        ),
        (
            "alerts: {webhook: {url: 'https://hooks.example/caf\u00e9'}}",
            {},
            "alerts.webhook.url: the URL holds a character that is not ASCII in its path or query",
        ),
        ("evaluation: [1", {}, "not valid YAML"),
    ],
)
def test_invalid_configuration_names_the_key(tmp_path: Path, text: str, env: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as caught:
        load(write(tmp_path, text), env=env)
    assert message in str(caught.value)


def test_a_webhook_url_error_shows_neither_its_path_nor_its_secrets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "ftp://user:s3cretpw@hooks.example/services/T00/B00/XXXXSECRETPATH?token=abcdefgh12345"
    assert main(["config", "--webhook-url", url]) == 2
    err = capsys.readouterr().err
    assert "alerts.webhook.url: expected an http(s) URL, got 'ftp://***@hooks.example/***?token=***'" in err
    assert "SECRETPATH" not in err and "s3cretpw" not in err and "abcdefgh12345" not in err
    assert main(["config", "--webhook-url", "https://hooks.example/hook?sig=a b"]) == 2
    assert "alerts.webhook.url: the URL holds a space" in capsys.readouterr().err


def test_a_webhook_url_with_surrounding_whitespace_is_still_taken() -> None:
    # urllib strips it before sending: a value read from a file or a variable with a newline works.
    assert load(None, env={"DURABLE_SESSIONS_WEBHOOK_URL": "https://hooks.example/x\n"}).alerts_webhook_url


def test_every_option_has_a_distinct_variable_and_flag_and_is_documented() -> None:
    assert len({o.env for o in OPTIONS}) == len({o.flag for o in OPTIONS}) == len(OPTIONS)
    assert all(o.env.startswith("DURABLE_SESSIONS_") for o in OPTIONS)
    table = reference()
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for option in OPTIONS:
        assert f"`{option.env}`" in table and f"`{option.flag}" in table
        assert f"`{option.env}`" in readme, f"{option.env} is not documented in collector/README.md"


def test_cli_stops_at_start_up_on_invalid_configuration(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", "serve", "--idle-s", "soon"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert (
        "invalid configuration: evaluation.idle_s: expected a positive number, got 'soon' (from --idle-s)"
        in (result.stderr)
    )
    assert "Traceback" not in result.stderr


def test_cli_names_the_port_it_cannot_bind(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable, "-m", "durable_sessions_collector", "serve",
                "--store", f"sqlite:///{tmp_path / 'x.db'}",
                "--grpc-endpoint", "127.0.0.1:0",
                "--http-endpoint", f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
    assert result.returncode == 2
    assert f"receivers.http.endpoint: cannot listen on 127.0.0.1:{port}" in result.stderr
