"""``durable-sessions-collector sessions list|show`` over a real sidecar's HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from durable_sessions_collector.cli import main
from durable_sessions_collector.store.stored import stored_text
from sidecar_clients import Agent, grpc_exporter
from tls_certs import make_cert, mutual_tls_pki
from webhook_server import QuietHandler, free_port, serve_in_background, stop_serving

TOKEN = "cli-" + uuid.uuid4().hex


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "DURABLE_SESSIONS_API_ENDPOINT",
        "DURABLE_SESSIONS_AUTH_TOKEN",
        "DURABLE_SESSIONS_AUTH_TOKEN_FILE",
        "DURABLE_SESSIONS_CA_FILE",
        "DURABLE_SESSIONS_CLIENT_CERT_FILE",
        "DURABLE_SESSIONS_CLIENT_KEY_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def sidecar(start_sidecar):  # type: ignore[no-untyped-def]
    """A sidecar whose sessions stay active through a test, as the tables that say '(active)'
    expect: conftest's ends a session 0.3 s after its last span, which a loaded machine let
    pass before 'show' (it said '(ended)')."""
    return start_sidecar(evaluation__idle_s=60)


def run(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own (standard output and error as pipes unless told)."""
    return subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=30,
    )


def populate(sidecar) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("good-1", "a1", "payment", idempotency_key="k-good-1")
    agent.action("bad-1", "a1", "payment")  # unkeyed-side-effect
    agent.action("bad-1", "a2", "tool_call", retryable=True)  # unbounded-retry
    agent.shutdown()


def test_list_and_show(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    populate(sidecar)
    endpoint = ("--endpoint", sidecar.http_url)
    code, out, _ = run(capsys, "sessions", *endpoint, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["SESSION", "VERDICT", "STATE"]
    assert sorted(line.split()[0] for line in lines[1:]) == ["bad-1", "good-1"]

    code, out, _ = run(capsys, "sessions", *endpoint, "list", "--verdict", "unrecoverable")
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [["bad-1", "unrecoverable"]]

    code, out, _ = run(capsys, "sessions", *endpoint, "show", "bad-1")
    assert code == 0
    assert out.startswith("session bad-1: unrecoverable (active)")
    assert "  error  unkeyed-side-effect  action a1: " in out
    assert "  error  unbounded-retry  action a2: " in out

    code, out, _ = run(capsys, "sessions", *endpoint, "--json", "show", "good-1")
    assert code == 0 and json.loads(out)["verdict"] == "ok"
    # The client's options after the subcommand too, as `alerts dead --json` takes them
    # (`sessions list --json` was an "unrecognized arguments" error).
    code, out, _ = run(capsys, "sessions", "show", "good-1", "--json", *endpoint)
    assert code == 0 and json.loads(out)["verdict"] == "ok"
    code, out, _ = run(capsys, "sessions", "--endpoint", "http://127.0.0.1:9", "list", "--json", *endpoint)
    assert code == 0 and sorted(s["session_id"] for s in json.loads(out)["sessions"]) == ["bad-1", "good-1"]

    code, _, err = run(capsys, "sessions", *endpoint, "show", "nope")
    assert code == 1 and "answered 404: no session 'nope'" in err


def test_list_all_follows_the_pages(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(5):
        agent.action(f"s-{n}", "u1", "user_prompt", result='{"x": 1}')
    agent.shutdown()
    endpoint = ("--endpoint", sidecar.http_url)
    code, out, err = run(capsys, "sessions", *endpoint, "list", "--limit", "2")
    assert code == 0 and len(out.splitlines()) == 1 + 2  # the first page
    # It says there are more: the table alone read as every session there is.
    assert err == "durable-sessions-collector: more sessions than the 2 shown; --all lists every one\n"
    code, out, _ = run(capsys, "sessions", *endpoint, "--json", "list", "--limit", "2")
    document = json.loads(out)
    assert code == 0 and len(document["sessions"]) == 2 and document["next_page_token"]
    listed = [s["session_id"] for s in document["sessions"]]
    code, out, err = run(capsys, "sessions", *endpoint, "list", "--limit", "5")
    assert code == 0 and len(out.splitlines()) == 1 + 5 and err == ""  # all of them: nothing to say
    code, out, _ = run(capsys, "sessions", *endpoint, "list", "--limit", "2", "--all")
    assert code == 0 and sorted(line.split()[0] for line in out.splitlines()[1:]) == [
        f"s-{n}" for n in range(5)
    ]
    code, out, err = run(capsys, "sessions", *endpoint, "--json", "list", "--limit", "2", "--all")
    document = json.loads(out)
    assert code == 0 and len(document["sessions"]) == 5 and document["next_page_token"] == "" and err == ""
    assert [s["session_id"] for s in document["sessions"][:2]] == listed


def test_show_asks_for_every_page_of_actions_and_violations(sidecar, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from durable_sessions_collector import client

    monkeypatch.setattr(client, "DETAIL_PAGE", 2)  # three pages of five actions, two of three violations
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(5):
        agent.action("long", f"a{n}", "tool_call", retryable=n < 3)  # unbounded-retry for a0-a2
    agent.shutdown()
    code, out, _ = run(capsys, "sessions", "--endpoint", sidecar.http_url, "show", "long")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[3:8]] == [f"a{n}" for n in range(5)]
    code, out, _ = run(capsys, "sessions", "--endpoint", sidecar.http_url, "--json", "show", "long")
    document = json.loads(out)
    assert [a["action_id"] for a in document["actions"]] == [f"a{n}" for n in range(5)]
    assert [v["action_id"] for v in document["violations"]] == ["a0", "a1", "a2"]
    assert "next_actions_page_token" not in document and "next_violations_page_token" not in document


def test_token_and_tls_ca_options(start_sidecar, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ca, cert, key = make_cert(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key), auth__token=TOKEN)
    endpoint = f"https://127.0.0.1:{sidecar.service.http_port}"

    code, _, err = run(capsys, "sessions", "--endpoint", endpoint, "--ca-file", str(ca), "list")
    assert code == 1 and "refused the request (401" in err and "--token" in err

    code, _, err = run(capsys, "sessions", "--endpoint", endpoint, "--token", TOKEN, "list")
    assert code == 1 and "cannot verify the TLS certificate" in err and "--ca-file" in err

    code, out, _ = run(
        capsys, "sessions", "--endpoint", endpoint, "--token", TOKEN, "--ca-file", str(ca), "list"
    )
    assert code == 0 and out == "no sessions\n"

    # Endpoint, token (from a file) and CA from the environment.
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("DURABLE_SESSIONS_API_ENDPOINT", endpoint)
    monkeypatch.setenv("DURABLE_SESSIONS_AUTH_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("DURABLE_SESSIONS_CA_FILE", str(ca))
    code, out, err = run(capsys, "sessions", "--json", "list")
    assert code == 0, err
    assert json.loads(out) == {"sessions": [], "next_page_token": ""}
    assert TOKEN not in out + err


@pytest.mark.parametrize(
    ("expired", "host", "why", "hint"),
    [
        # The CA given is the right one: passing it again, as the message said, changed nothing.
        (True, "127.0.0.1", "certificate has expired",
         "renew the sidecar's tls.cert_file (it serves a renewal without a restart)"),
        (False, "127.0.0.2", "IP address mismatch, certificate is not valid for '127.0.0.2'",
         "ask the sidecar by an address or name the certificate holds (its subjectAltName)"),
    ],
)  # fmt: skip
def test_a_certificate_that_its_ca_signed_but_does_not_verify_is_said_why(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path, capsys, expired: bool, host: str, why: str, hint: str
) -> None:
    ca, cert, key = make_cert(tmp_path, expired=expired)  # for localhost and 127.0.0.1
    sidecar = start_sidecar(
        tls__cert_file=str(cert), tls__key_file=str(key), receivers__http__endpoint=f"{host}:0"
    )
    endpoint = f"https://{host}:{sidecar.service.http_port}"
    code, _, err = run(capsys, "sessions", "--endpoint", endpoint, "--ca-file", str(ca), "list")
    assert (code, err) == (
        1,
        f"durable-sessions-collector: cannot verify the TLS certificate of {endpoint}: {why}; {hint}\n",
    )


def test_a_token_file_with_a_byte_order_mark_is_bad_usage_saying_so(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # The sidecar's own check (config.check_token): the generic "no spaces or quotes" left
    # the invisible character to be found by hand.
    (tmp_path / "token").write_bytes(("\ufeff" + TOKEN + "\n").encode())
    code, _, err = run(capsys, "sessions", "--token-file", str(tmp_path / "token"), "list")
    assert code == 2 and TOKEN not in err
    assert "starts with a byte order mark (U+FEFF)" in err and str(tmp_path / "token") in err


def test_client_certificate_options_for_mutual_tls(start_sidecar, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A sidecar with tls.client_ca_file lets in only clients with a certificate its CA
    signed: ``sessions`` sends one with --cert-file/--key-file (or the variables), and
    says what failed when it has none or one the sidecar refuses."""
    pki = mutual_tls_pki(tmp_path)
    ca, cert, key, client_cert, client_key, stranger_cert, stranger_key = (
        pki[name]
        for name in ("ca", "cert", "key", "client_cert", "client_key", "stranger_cert", "stranger_key")
    )
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key), tls__client_ca_file=str(ca))
    base = ("sessions", "--endpoint", f"127.0.0.1:{sidecar.service.http_port}", "--ca-file", str(ca))

    code, _, err = run(capsys, *base, "list")
    # TLS 1.3: the sidecar's CERTIFICATE_REQUIRED alert, or an EOF when it is lost
    assert code == 1 and "client certificate" in err and "--cert-file and --key-file" in err, err
    assert "scheme" not in err

    code, _, err = run(
        capsys, *base, "list", "--cert-file", str(stranger_cert), "--key-file", str(stranger_key)
    )
    assert code == 1 and f"the client certificate {str(stranger_cert)!r} must be signed by a CA" in err, err

    code, out, err = run(
        capsys, *base, "list", "--cert-file", str(client_cert), "--key-file", str(client_key)
    )
    assert (code, out) == (0, "no sessions\n"), err

    code, _, err = run(capsys, *base, "list", "--key-file", str(client_key))
    assert code == 2 and "--key-file needs --cert-file" in err

    combined = tmp_path / "client" / "both.pem"  # certificate and key in one file, as curl takes them
    combined.write_bytes(client_cert.read_bytes() + client_key.read_bytes())
    assert run(capsys, *base, "list", "--cert-file", str(combined))[:2] == (0, "no sessions\n")

    monkeypatch.setenv("DURABLE_SESSIONS_CLIENT_CERT_FILE", str(client_cert))
    monkeypatch.setenv("DURABLE_SESSIONS_CLIENT_KEY_FILE", str(client_key))
    code, out, err = run(capsys, *base, "list")
    assert (code, out) == (0, "no sessions\n"), err


def test_tls_options_with_an_http_endpoint_are_bad_usage(sidecar, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """--ca-file, --cert-file and --key-file only mean something over TLS: with an http://
    endpoint they are a usage error naming them and the scheme, not silently ignored (the
    token would go out in the clear to a port the user thought was verified)."""
    ca, cert, key = make_cert(tmp_path)
    endpoint = sidecar.http_url
    assert endpoint.startswith("http://")

    code, out, err = run(capsys, "sessions", "--endpoint", endpoint, "--ca-file", str(ca), "list")
    assert (code, out) == (2, ""), err
    assert "--ca-file (or $DURABLE_SESSIONS_CA_FILE) is for TLS" in err, err
    assert f"--endpoint {endpoint} is http://" in err and "use https://" in err, err

    code, _, err = run(
        capsys, "sessions", "--endpoint", endpoint, "list", "--cert-file", str(cert), "--key-file", str(key)
    )
    assert code == 2 and "--cert-file (or $DURABLE_SESSIONS_CLIENT_CERT_FILE) and --key-file" in err, err
    assert "are for TLS" in err, err

    monkeypatch.setenv("DURABLE_SESSIONS_CA_FILE", str(ca))  # from the environment too
    code, _, err = run(capsys, "sessions", "--endpoint", endpoint, "show", "s-1")
    assert code == 2 and "$DURABLE_SESSIONS_CA_FILE" in err and "http://" in err, err


def test_a_token_option_after_the_subcommand_wins_over_either_before_it(
    start_sidecar, tmp_path, capsys
) -> None:  # type: ignore[no-untyped-def]
    """--token and --token-file are one setting: given after the subcommand, either one
    wins over either one before it (a wrapper that adds --token, a script that appends
    --token-file), as the README says of every option. Given twice at one level, they
    are refused."""
    sidecar = start_sidecar(auth__token=TOKEN)
    good, wrong = tmp_path / "good.token", tmp_path / "wrong.token"
    good.write_text(TOKEN + "\n")
    wrong.write_text("wrong-token-0123456789\n")
    base = ("sessions", "--endpoint", sidecar.http_url)
    for before, after in (
        (("--token", "wrong-token-0123456789"), ("--token-file", str(good))),
        (("--token-file", str(wrong)), ("--token", TOKEN)),
        (("--token", "wrong-token-0123456789"), ("--token", TOKEN)),
    ):
        code, out, err = run(capsys, *base, *before, "list", *after)
        assert (code, out) == (0, "no sessions\n"), (before, after, err)
    code, _, err = run(capsys, *base, "--token-file", str(good), "list")  # before alone still counts
    assert code == 0, err
    with pytest.raises(SystemExit) as refused:
        main([*base, "list", "--token", TOKEN, "--token-file", str(good)])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


class Proxy:
    """A forward proxy that records each request (its target and Authorization header)
    and answers 502."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_error(502)

        self.server = serve_in_background(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def use(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Name this proxy in ``http_proxy`` (both spellings), with no ``no_proxy``."""
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, self.url)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    proxy = Proxy()
    yield proxy
    stop_serving(proxy.server)


def test_a_loopback_sidecar_is_asked_directly_not_through_the_proxy(
    sidecar, capsys, proxy, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # A shell's http_proxy is for the outside world: through it, 127.0.0.1 is the proxy's
    # own host, and a token went to the proxy in the clear.
    populate(sidecar)
    proxy.use(monkeypatch)
    code, out, err = run(capsys, "sessions", "--endpoint", sidecar.http_url, "list")
    assert (code, proxy.seen) == (0, []), err
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == ["bad-1", "good-1"]


def test_a_sidecar_on_another_host_is_asked_through_the_proxy(capsys, proxy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    proxy.use(monkeypatch)
    code, _, err = run(
        capsys, "sessions", "--endpoint", "http://sidecar.invalid:4320", "--token", TOKEN, "list"
    )
    assert code == 1 and "502" in err, err
    assert proxy.seen == [("http://sidecar.invalid:4320/api/sessions?limit=100", f"Bearer {TOKEN}")]


def test_an_unreachable_sidecar_is_a_clear_error() -> None:
    port = free_port()  # nothing listens there
    result = run_process("sessions", "--endpoint", f"127.0.0.1:{port}", "list")
    assert result.returncode == 1
    assert f"cannot reach the sidecar at http://127.0.0.1:{port}: Connection refused; is it running?" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "command", [("sessions", "list"), ("sessions", "--json", "show", "bad-1"), ("config",)]
)
def test_a_reader_gone_away_ends_the_command_quietly_with_141(sidecar, command) -> None:  # type: ignore[no-untyped-def]
    populate(sidecar)
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` does once it has its lines
    args = (
        (*command[:1], "--endpoint", sidecar.http_url, *command[1:]) if command[0] == "sessions" else command
    )
    with os.fdopen(write_end, "wb") as stdout:
        result = run_process(*args, stdout=stdout)
    assert (result.returncode, result.stderr) == (141, "")


def test_an_unwritable_output_is_one_line_and_exit_code_2(sidecar) -> None:  # type: ignore[no-untyped-def]
    populate(sidecar)
    with open("/dev/full", "wb") as full:
        result = run_process("sessions", "--endpoint", sidecar.http_url, "list", stdout=full)
    assert result.returncode == 2
    assert result.stderr == (
        "durable-sessions-collector sessions: cannot write to standard output: No space left on device\n"
    )


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["sessions", "list", "--help"]])
def test_help_and_version_to_unwritable_output_exit_2(argv: list[str]) -> None:
    # --version was an OSError traceback (exit 1); --help exited 0 having written nothing.
    with open("/dev/full", "wb") as full:
        result = run_process(*argv, stdout=full)
    assert result.returncode == 2
    prog = " ".join(["durable-sessions-collector", *argv[:-1]])
    assert result.stderr == f"{prog}: cannot write to standard output: No space left on device\n"


def test_ids_and_messages_from_spans_are_printed_escaped(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # A span's attributes are anyone's text: raw, a newline in a session id forged a row of
    # its own and an escape sequence drove the terminal of whoever ran the command.
    session, action = "evil\nforged  ok\x1b[2J", "a\x1b]0;title\x07"
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "run\x1b[8m1")
    agent.action(session, action, "tool_call", retryable=True)  # unbounded-retry, quoting the id
    agent.shutdown()
    endpoint = ("--endpoint", sidecar.http_url)

    code, out, _ = run(capsys, "sessions", *endpoint, "list")
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert out.splitlines()[1].split()[:2] == ["evil\\nforged", "ok\\x1b[2J"]
    assert len(out.splitlines()) == 2  # the header and one session

    code, out, _ = run(capsys, "sessions", *endpoint, "show", session)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    lines = out.splitlines()
    assert lines[0] == "session evil\\nforged  ok\\x1b[2J: unrecoverable (active)"
    assert lines[3] == "  a\\x1b]0;title\\x07  tool_call  ok (incarnation run\\x1b[8m1, retryable)"
    assert lines[5].startswith("  error  unbounded-retry  action a\\x1b]0;title\\x07: ")
    assert len(lines) == 6


def test_list_aligns_ids_of_wide_and_combining_characters(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # A terminal shows a CJK character two columns wide and a combining accent in none:
    # padded by their count of characters, the columns after such an id were shifted.
    wide, combining, plain = "旅行-42", "cafe\u0301-1", "plain-1"  # each 7 columns but the accent's 6
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for session in (wide, combining, plain):
        agent.action(session, "a1", "tool_call")
    agent.shutdown()

    code, out, _ = run(capsys, "sessions", "--endpoint", sidecar.http_url, "list")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.startswith("SESSION  VERDICT")
    by_id = {row.split()[0]: row for row in rows}
    assert by_id[wide].startswith(wide + "  ok  ")
    assert by_id[combining].startswith(combining + "   ok  ")
    assert by_id[plain].startswith(plain + "  ok  ")


def test_show_of_an_empty_id_is_bad_usage(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # No session has an empty id (a span whose session.id is empty starts none); asked, the
    # path was /api/sessions/, answered 404 'no such path' with the exit code of a session not found.
    code, out, err = run(capsys, "sessions", "--endpoint", sidecar.http_url, "show", "")
    assert (code, out, err) == (2, "", "durable-sessions-collector: SESSION_ID must not be empty\n")


def test_show_of_an_id_that_is_not_utf8_is_bad_usage_not_a_traceback(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # Bytes of an argument that are not UTF-8 (a Latin-1 'café' pasted in a terminal) are
    # lone surrogates in argv: quote() raised UnicodeEncodeError, and the command ended in a
    # traceback. No session's id is other than UTF-8 text.
    code, out, err = run(capsys, "sessions", "--endpoint", sidecar.http_url, "show", "caf\udce9")
    assert (code, out) == (2, "")
    assert (
        err == "durable-sessions-collector: SESSION_ID 'caf%E9' is not UTF-8 text, as every session id is\n"
    )
    result = run_process("sessions", "--endpoint", sidecar.http_url, "show", os.fsdecode(b"caf\xe9"))
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert "Traceback" not in result.stderr and "not UTF-8" in result.stderr


def test_show_finds_a_session_whose_id_is_too_long_for_a_url(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    # 12,000 'é' are 108,000 characters percent-encoded, past the 64 KiB request line the
    # HTTP port reads: asked by the form it is stored and listed under instead.
    session = "é" * 12_000
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action(session, "a1", "payment")  # unkeyed-side-effect
    agent.shutdown()
    code, out, err = run(capsys, "sessions", "--endpoint", sidecar.http_url, "show", session)
    assert code == 0, err
    assert out.startswith(f"session {stored_text(session)}: unrecoverable (active)")
    assert "  error  unkeyed-side-effect  action a1: " in out


class PageRelay:
    """An HTTP relay in front of a sidecar's API that runs ``between`` once, after relaying
    the first page of the session list and before answering it: what a walk through the
    pages sees when spans arrive while it is under way. ``older``: it answers a request
    with ``order`` as a sidecar from before that argument did, 400 ``unknown argument``."""

    def __init__(self, target: str, between: Any = lambda: None, *, older: bool = False) -> None:
        self.paths: list[str] = []
        relay = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                relay.paths.append(self.path)
                if older and "order" in parse_qs(urlsplit(self.path).query):
                    refusal = "unknown argument 'order'; this path takes verdict, limit, page_token"
                    self.answer(400, json.dumps({"error": refusal}).encode())
                    return
                with urllib.request.urlopen(target + self.path, timeout=10) as answer:
                    body = answer.read()
                if len(relay.paths) == 1:
                    between()
                self.answer(200, body)

            def answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = serve_in_background(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        stop_serving(self.server)


@pytest.mark.parametrize("as_json", [False, True])
def test_list_all_lists_once_every_session_that_receives_spans_during_the_walk(  # type: ignore[no-untyped-def]
    sidecar, capsys, as_json: bool
) -> None:
    """Five sessions, listed two a page; after the first page s-2, which a later page
    would list either way, receives a span. Walked most recently active first, it moved
    ahead of the walk and was never listed; walked by id, every session is listed once,
    and shown most recently active first, as a single page shows them."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    names = [f"s-{n}" for n in range(5)]
    for name in names:
        agent.action(name, "u1", "user_prompt")
    relay = PageRelay(sidecar.http_url, lambda: agent.action("s-2", "u2", "user_prompt"))
    try:
        flags = ["--json"] if as_json else []
        code, out, err = run(
            capsys, "sessions", "--endpoint", relay.url, *flags, "list", "--limit", "2", "--all"
        )
    finally:
        relay.close()
        agent.shutdown()
    assert (code, err) == (0, "")
    listed = (
        [s["session_id"] for s in json.loads(out)["sessions"]]
        if as_json
        else [line.split()[0] for line in out.splitlines()[1:]]
    )
    assert sorted(listed) == names  # each once
    assert len(relay.paths) == 3 and all("order=session_id" in path for path in relay.paths)
    # Most recently active first: s-2's new span made it the most recent.
    assert listed == ["s-2", "s-4", "s-3", "s-1", "s-0"]
    _, single, _ = run(capsys, "sessions", "--endpoint", sidecar.http_url, "--json", "list")
    assert [s["session_id"] for s in json.loads(single)["sessions"]] == listed


@pytest.mark.parametrize("as_json", [False, True])
def test_list_all_on_an_older_sidecar_walks_by_activity_and_warns_once(
    sidecar, capsys, as_json: bool
) -> None:  # type: ignore[no-untyped-def]
    """A sidecar from before order=session_id refuses it (400 unknown argument 'order'),
    which ended --all with that error. It is walked as it was before, most recently active
    first, with one warning that a session active meanwhile may be listed twice or missed."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    names = [f"s-{n}" for n in range(5)]
    for name in names:
        agent.action(name, "u1", "user_prompt")
    agent.shutdown()
    relay = PageRelay(sidecar.http_url, older=True)
    try:
        flags = ["--json"] if as_json else []
        code, out, err = run(
            capsys, "sessions", "--endpoint", relay.url, *flags, "list", "--limit", "2", "--all"
        )
        single = run(capsys, "sessions", "--endpoint", relay.url, "list", "--limit", "2")
    finally:
        relay.close()
    assert code == 0, err
    listed = (
        [s["session_id"] for s in json.loads(out)["sessions"]]
        if as_json
        else [line.split()[0] for line in out.splitlines()[1:]]
    )
    assert listed == names[::-1]
    assert err == (
        f"durable-sessions-collector: {relay.url} is an older sidecar, which cannot list sessions by id "
        "(it answered 400: unknown argument 'order'; this path takes verdict, limit, page_token); walked "
        "most recently active first instead: a session that receives spans during the walk may be "
        "listed twice or missed\n"
    )
    # Refused once, then three pages without the argument.
    assert ["order=" in path for path in relay.paths] == [True, False, False, False, False]
    # A single page never asks for an order: no warning.
    assert (
        single[0] == 0
        and single[2] == "durable-sessions-collector: more sessions than the 2 shown; --all lists every one\n"
    )
