"""Durations: one validator (``durable_sessions.seconds``) for the span processor, the
``durable-sessions`` CLI and the sidecar's configuration, so that a key window one of
them takes the others take too, each saying why in its own documented words."""

from __future__ import annotations

import reprlib
import subprocess
import sys
from pathlib import Path

import pytest
from durable_sessions_collector.config import ConfigError, load

from durable_sessions.processor import ConfigurationError, DurabilitySpanProcessor

REFUSED = [
    "inf",
    "-inf",
    "nan",
    "0",
    "-1",
    "1e400",
    "1e12",
    "1000000001",
    "\u0661\u0660",
    "\uff16\uff14",
    "5s",
    "abc",
]
ACCEPTED = [("1e9", 1e9), ("0.5", 0.5), ("86400", 86400.0), (" 60 ", 60.0)]
VARIABLE = "DURABLE_SESSIONS_KEY_WINDOW_S"


def processor_key_window(monkeypatch: pytest.MonkeyPatch, text: str) -> float | str:
    """The span processor's key window from ``text`` in its variable, or its refusal's reason."""
    monkeypatch.setenv(VARIABLE, text)
    try:
        processor = DurabilitySpanProcessor(mode="silent")
    except ConfigurationError as error:
        return str(error).removeprefix(f"{VARIABLE}={text.strip()!r} ")
    try:
        return processor._checker_options[1]
    finally:
        processor.shutdown()


def cli_key_window(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    log = tmp_path / "log.jsonl"
    log.write_text("")
    return subprocess.run(
        [sys.executable, "-m", "durable_sessions", "check", f"--key-window-s={text}", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("text", REFUSED)
def test_a_key_window_is_refused_by_the_processor_the_cli_and_the_sidecar_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    """The processor and the CLI took ``1e12`` (no limit) and Arabic-Indic or full-width
    digits (``float`` reads them) where the sidecar refused both."""
    reason = processor_key_window(monkeypatch, text)
    assert isinstance(reason, str), f"the processor took {text!r} as {reason}"
    assert reason in (
        "is not a number",
        "must be a positive number of seconds",
        "must be at most 1000000000 seconds (about 31 years)",
    )
    result = cli_key_window(tmp_path, text)
    assert result.returncode == 2 and f"--key-window-s: {text!r} {reason}" in result.stderr, result.stderr
    with pytest.raises(ConfigError) as refused:
        load(None, env={VARIABLE: text})
    sidecar = {
        "is not a number": f"expected a positive number, got {text!r} (from {VARIABLE})",
        "must be a positive number of seconds": f"expected a positive number, got {text!r}",
        "must be at most 1000000000 seconds (about 31 years)": f"expected at most 1000000000 seconds (about 31 years), got {text!r}",
    }[reason]
    assert str(refused.value).startswith(f"evaluation.key_window_s: {sidecar}")


@pytest.mark.parametrize(("text", "seconds"), ACCEPTED)
def test_a_key_window_is_taken_by_the_processor_the_cli_and_the_sidecar_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, seconds: float
) -> None:
    assert processor_key_window(monkeypatch, text) == seconds
    result = cli_key_window(tmp_path, text)
    assert result.returncode == 0, result.stderr
    assert load(None, env={VARIABLE: text}).evaluation_key_window_s == seconds


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param(10**400, "must be at most 1000000000 seconds (about 31 years)", id="10**400"),
        pytest.param(-(10**400), "must be a positive number of seconds", id="-10**400"),
        (float("inf"), "must be a positive number of seconds"),
        (True, "is not a number"),
        ("60", "is not a number"),  # the constructor takes numbers; text is the variable's
    ],
)
def test_the_processor_argument_is_refused_with_the_reason_that_applies(value: object, reason: str) -> None:
    """An integer past a float's range was 'must be a positive number of seconds', which
    10**400 is."""
    with pytest.raises(ConfigurationError) as refused:
        DurabilitySpanProcessor(mode="silent", key_window_s=value)  # type: ignore[arg-type]
    assert str(refused.value) == f"key_window_s={reprlib.repr(value)} {reason}"  # 400 digits by their ends


@pytest.mark.parametrize(
    ("text", "retention", "idle"),
    [
        ("0", 0.0, "expected a positive number, got 0"),
        ("-1", "expected a number of 0 or more, got -1", "expected a positive number, got -1"),
        (".nan", "expected a number of 0 or more, got nan (not a finite number)", "expected a positive number, got nan (not a finite number)"),
        ("1e9", 1e9, 1e9),
        (str(10**400), "expected at most 1000000000 seconds (about 31 years), got 1000000000000", "expected at most 1000000000 seconds (about 31 years), got 1000000000000"),
        ("'5s'", "expected a number of 0 or more, got '5s'", "expected a positive number, got '5s'"),
    ],
)  # fmt: skip
def test_the_sidecar_file_takes_zero_only_where_it_turns_something_off(
    tmp_path: Path, text: str, retention: float | str, idle: float | str
) -> None:
    """retention.sessions_s 0 keeps everything; evaluation.idle_s must be above 0. From
    the file, whose numbers YAML reads (an int past a float's range, a float nan)."""
    for key, expected in (("retention.sessions_s", retention), ("evaluation.idle_s", idle)):
        section, _, name = key.partition(".")
        path = tmp_path / "collector.yaml"
        path.write_text(f"{section}: {{{name}: {text}}}\n")
        if isinstance(expected, float):
            assert getattr(load(path, env={}), key.replace(".", "_")) == expected
            continue
        with pytest.raises(ConfigError) as refused:
            load(path, env={})
        assert str(refused.value).startswith(f"{path}:1:{len(section) + 4}: {key}: {expected}"), refused.value
