"""``durable-sessions-collector sessions`` with a token as a Kubernetes Secret leaves it, an
endpoint that answers JSON unlike the sidecar's API, and a plain-HTTP endpoint on a TLS port:
one line and the documented exit code, never a traceback (which showed the token)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import urllib.error
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from durable_sessions_collector.cli import main
from durable_sessions_collector.client import ApiClient, ApiUsageError
from tls_certs import make_cert, make_client_cert
from webhook_server import QuietHandler, serve_in_background, stop_serving

TOKEN = "cli-" + uuid.uuid4().hex
ENV_NAMES = (
    "DURABLE_SESSIONS_API_ENDPOINT",
    "DURABLE_SESSIONS_AUTH_TOKEN",
    "DURABLE_SESSIONS_AUTH_TOKEN_FILE",
    "DURABLE_SESSIONS_CA_FILE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, with $DURABLE_SESSIONS_AUTH_TOKEN set to ``token``:
    what a traceback would print is in its standard error."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    if token is not None:
        env["DURABLE_SESSIONS_AUTH_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


# --- the token ----------------------------------------------------------------------------------


def test_a_token_ending_in_a_newline_works_as_it_does_for_the_sidecar(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """A Secret created --from-file keeps the file's newline; the sidecar strips it, and so
    must the CLI, from the variable and from --token (http.client refused the header in a
    traceback that printed the token)."""
    sidecar = start_sidecar(auth__token=TOKEN)
    result = run_process("sessions", "--endpoint", sidecar.http_url, "list", token=TOKEN + "\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "no sessions\n", "")
    result = run_process("sessions", "--endpoint", sidecar.http_url, "--token", f" {TOKEN}\r\n", "list")
    assert (result.returncode, result.stdout, result.stderr) == (0, "no sessions\n", "")


@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        (False, f"{TOKEN}\n{TOKEN}"),  # two lines: a header cannot hold it
        (False, f"{TOKEN} {TOKEN}"),
        (True, f"{TOKEN}\r{TOKEN}"),
        (True, "short\n"),
    ],
)
def test_a_token_that_cannot_be_sent_is_a_usage_error_that_does_not_show_it(
    start_sidecar, flag: bool, bad: str
) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(auth__token=TOKEN)
    if flag:
        result = run_process("sessions", "--endpoint", sidecar.http_url, "--token", bad, "list")
        source = "--token"
    else:
        result = run_process("sessions", "--endpoint", sidecar.http_url, "list", token=bad)
        source = "$DURABLE_SESSIONS_AUTH_TOKEN"
    assert result.returncode == 2, result.stderr[-300:]
    assert result.stderr.startswith(f"durable-sessions-collector: {source}: expected a bearer token")
    assert result.stderr.endswith("(value not shown)\n") and len(result.stderr.splitlines()) == 1
    assert TOKEN not in result.stderr and "short" not in result.stderr


def test_a_token_file_with_a_token_that_cannot_be_sent_is_a_usage_error(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "token").write_text(f"{TOKEN}\n{TOKEN}\n")
    code, _, err = run(capsys, "sessions", "--token-file", str(tmp_path / "token"), "list")
    assert code == 2 and err.startswith(
        f"durable-sessions-collector: the token file {str(tmp_path / 'token')!r}: "
    )
    assert TOKEN not in err
    (tmp_path / "token").write_bytes(b"\xff" + TOKEN.encode())
    code, _, err = run(capsys, "sessions", "--token-file", str(tmp_path / "token"), "list")
    assert code == 2 and err.endswith("is not UTF-8 text (value not shown)\n")


def test_the_client_never_shows_a_header_that_http_refuses(sidecar) -> None:  # type: ignore[no-untyped-def]
    """For the client's other callers, who may not check the token: http.client's ValueError
    repeats the header's value."""
    client = ApiClient(sidecar.http_url, token=f"{TOKEN}\n")
    with pytest.raises(ApiUsageError) as raised:
        client.list_sessions()
    assert "(value not shown)" in str(raised.value) and TOKEN not in str(raised.value)
    assert raised.value.__suppress_context__  # a traceback of it does not show the ValueError


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9/a b", "http://127.0.0.1:9/a\x01b"])
def test_an_endpoint_with_a_space_is_a_usage_error(endpoint: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """http.client refused it only when sending, as if the sidecar had not answered HTTP."""
    code, _, err = run(capsys, "sessions", "--endpoint", endpoint, "list")
    assert code == 2 and err.startswith("durable-sessions-collector: --endpoint must be an http(s) URL")


@pytest.mark.parametrize(
    ("suffix", "shown", "why"),
    [
        ("?tenant=a", "?tenant=***", "a query (?…) or fragment (#…)"),
        ("/?", "/", "a query (?…) or fragment (#…)"),
        ("/#top", "/", "a query (?…) or fragment (#…)"),
    ],
)
def test_an_endpoint_with_a_query_or_fragment_is_a_usage_error(
    sidecar, suffix: str, shown: str, why: str, capsys
) -> None:  # type: ignore[no-untyped-def]
    """The API's paths were added after the query or fragment: '?tenant=a' asked
    '/?tenant=a/api/sessions', and '#top' asked '/' (the rest was the fragment, never sent),
    answered 404 as if the sidecar had no such path."""
    endpoint = sidecar.http_url + suffix
    code, out, err = run(capsys, "sessions", "--endpoint", endpoint, "list")
    assert (code, out) == (2, "")
    assert err == (
        f"durable-sessions-collector: --endpoint takes no {why}: the API's paths are added to it, "
        f"got {sidecar.http_url + shown!r}\n"
    )


def test_an_endpoint_with_a_user_and_password_is_a_usage_error_that_hides_them(sidecar, capsys) -> None:  # type: ignore[no-untyped-def]
    """urllib took 'user:pass@host' for the host name: 'cannot reach the sidecar …: Name or
    service not known; is it running?'. The sidecar takes a bearer token, not a password."""
    endpoint = sidecar.http_url.replace("//", "//alice:s3cret@")
    code, out, err = run(capsys, "sessions", "--endpoint", endpoint, "list")
    assert (code, out) == (2, "")
    assert err == (
        "durable-sessions-collector: --endpoint takes no user or password: the sidecar takes a bearer "
        "token (--token, --token-file or $DURABLE_SESSIONS_AUTH_TOKEN), got "
        f"{sidecar.http_url.replace('//', '//***@')!r}\n"
    )


# --- answers unlike the sidecar's API -------------------------------------------------------------


class JsonServer:
    """A real HTTP server that answers every GET with ``status`` and ``body`` (as JSON unless
    told); ``length``: the Content-Length it claims, when not the body's (it then closes
    the connection, which ends the answer early)."""

    def __init__(
        self,
        body: bytes,
        status: int = 200,
        content_type: str = "application/json",
        length: int | None = None,
    ) -> None:
        class Handler(QuietHandler):
            def do_GET(self) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = serve_in_background(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        stop_serving(self.httpd)


@contextmanager
def serving(
    body: bytes, status: int = 200, content_type: str = "application/json", length: int | None = None
) -> Iterator[str]:
    server = JsonServer(body, status, content_type, length)
    try:
        yield server.url
    finally:
        server.stop()


WRONG_SHAPES = [
    b'{"hello": 1}',
    b"[]",
    b'"hello"',
    b"null",
    b'{"sessions": null}',
    b'{"sessions": [1]}',
    b'{"sessions": [{"id": "x"}], "next_page_token": ""}',
    b'{"sessions": [{"session_id": "x", "verdict": 1}]}',
    b'{"session_id": "x"}',
    b'{"session_id": "x", "verdict": "ok", "actions": null, "violations": []}',
    b'{"session_id": "x", "verdict": "ok", "actions": [], "violations": [1]}',
]


@pytest.mark.parametrize("body", WRONG_SHAPES)
@pytest.mark.parametrize("command", [("list",), ("show", "x")])
def test_json_unlike_the_api_is_a_one_line_error(body: bytes, command: tuple[str, ...], capsys) -> None:  # type: ignore[no-untyped-def]
    with serving(body) as url:
        code, out, err = run(capsys, "sessions", "--endpoint", url, *command)
        assert (code, out) == (1, "")
        assert err.startswith(f"durable-sessions-collector: {url} did not answer like the sidecar's API (")
        assert err.endswith("is it the sidecar's HTTP port?\n") and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", [("list",), ("show", "x")])
def test_an_error_page_unlike_the_apis_is_quoted_on_one_line(command: tuple[str, ...], capsys) -> None:  # type: ignore[no-untyped-def]
    # A proxy's or another server's page: its lines (and any escape sequence) were written
    # as they came, where the reason is one line.
    page = b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n\x1b[2J</html>\r\n"
    with serving(page, 502, "text/html") as url:
        code, out, err = run(capsys, "sessions", "--endpoint", url, *command)
    assert (code, out) == (1, "")
    assert err == (
        f"durable-sessions-collector: {url} answered 502: <html>\\r\\n<head><title>502 Bad Gateway</title>"
        "</head>\\r\\n\\x1b[2J</html>\\r\\n\n"
    )


@pytest.mark.parametrize(
    ("body", "command"),
    [
        (b'{"sessions": [], "next_page_token": "same"}', ("list", "--all")),
        (b'{"session_id": "x", "verdict": "ok", "actions": [], "violations": [], '
         b'"next_actions_page_token": "same"}', ("show", "x")),
    ],
)  # fmt: skip
def test_a_page_token_given_again_ends_the_walk(body: bytes, command: tuple[str, ...], capsys) -> None:  # type: ignore[no-untyped-def]
    # The walk followed it for ever.
    with serving(body) as url:
        code, _, err = run(capsys, "sessions", "--endpoint", url, *command)
    assert code == 1 and "did not answer like the sidecar's API (the same page token twice)" in err


def test_fields_past_the_id_and_verdict_may_be_missing_or_odd(capsys) -> None:  # type: ignore[no-untyped-def]
    """Another version of the API may lack a column, or have a time out of range: a dash."""
    with serving(b'{"sessions": [{"session_id": "x", "verdict": "ok", "last_seen": 1e300}]}') as url:
        code, out, _ = run(capsys, "sessions", "--endpoint", url, "list")
        assert code == 0 and out.splitlines()[1].split() == ["x", "ok", "-", "-", "-", "-", "-"]
    detail = b'{"session_id": "x", "verdict": "ok", "actions": [{}], "violations": [{}], "first_seen": 1e300}'
    with serving(detail) as url:
        code, out, _ = run(capsys, "sessions", "--endpoint", url, "show", "x")
        assert code == 0 and out.splitlines()[:2] == [
            "session x: ok (-)",
            "  - action(s), - error(s), - warning(s); first seen -, last seen -",
        ]


BROKEN_OFF = "broke off its answer (the connection closed after 14 of 1000 bytes); try again"
TOO_DEEP = (
    "did not answer like the sidecar's API (JSON nested too deeply to read); is it the sidecar's HTTP port?"
)


@pytest.mark.parametrize(
    ("body", "length", "status", "told"),
    [
        # The connection closes 14 bytes into an answer of 1000 (a sidecar or proxy that stops
        # meanwhile): a 200 was called not HTTP/1.1, which sent the user looking for the gRPC
        # port, and an error answer ended in http.client's traceback.
        (b'{"sessions": [', 1000, 200, BROKEN_OFF),
        (b'{"sessions": [', 1000, 500, "answered 500: no details (the answer was broken off)"),
        # Python's json reads by recursion: its RecursionError ended in a traceback.
        (b"[" * 100_000, None, 200, TOO_DEEP),
        (b"[" * 100_000, None, 500, "answered 500: " + "[" * 200),
    ],
)
@pytest.mark.parametrize("command", [("list",), ("--json", "show", "x")])
def test_an_answer_the_client_cannot_read_whole_is_a_one_line_error(  # type: ignore[no-untyped-def]
    body: bytes, length: int | None, status: int, told: str, command: tuple[str, ...], capsys
) -> None:
    with serving(body, status, length=length) as url:
        code, out, err = run(capsys, "sessions", "--endpoint", url, *command)
    assert (code, out, err) == (1, "", f"durable-sessions-collector: {url} {told}\n")


# --- http:// to a TLS port ----------------------------------------------------------------------

SCHEME_HINT = "with the right scheme (https:// for a sidecar with tls.cert_file)?"


def test_plain_http_to_a_tls_sidecar_hints_at_the_scheme(start_sidecar, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    _, cert, key = make_cert(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key))
    for _ in range(3):  # the TLS port resets the connection, or closes it
        code, _, err = run(capsys, "sessions", "--endpoint", sidecar.http_url, "list")
        assert code == 1 and err.endswith(SCHEME_HINT + "\n"), err


def test_https_to_a_plain_sidecar_hints_at_the_scheme(sidecar, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # The plain port closes a TLS handshake at once. Read as the end of a finished
    # handshake, that sent the user after a client certificate the sidecar never asked for.
    ca, _, _ = make_cert(tmp_path)
    client_cert, client_key = make_client_cert(tmp_path, tmp_path / "client")
    endpoint = f"https://127.0.0.1:{sidecar.service.http_port}"
    for certificate in ((), ("--cert-file", str(client_cert), "--key-file", str(client_key))):
        code, _, err = run(
            capsys, "sessions", "--endpoint", endpoint, "--ca-file", str(ca), *certificate, "list"
        )
        assert code == 1
        assert err.startswith(
            f"durable-sessions-collector: {endpoint} closed the connection during the TLS handshake ("
        )
        assert err.endswith("); does it serve TLS? A sidecar without tls.cert_file is asked with http://\n")


def test_a_reset_connection_hints_at_the_scheme(capsys) -> None:  # type: ignore[no-untyped-def]
    """A server that resets every connection once it has the request (linger 0: a RST)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # the listener closed: the test is over
                return
            connection.recv(65536)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()

    thread = threading.Thread(target=reset_each)
    thread.start()
    try:
        code, _, err = run(capsys, "sessions", "--endpoint", f"http://127.0.0.1:{port}", "list")
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join()
    assert code == 1
    assert err == (
        f"durable-sessions-collector: http://127.0.0.1:{port} reset the connection without answering; "
        f"is it the sidecar's HTTP port (not the gRPC one), {SCHEME_HINT}\n"
    )


def test_a_reset_while_sending_hints_at_the_scheme_too() -> None:
    """urllib wraps a reset met while sending the request in a URLError."""
    client = ApiClient("http://127.0.0.1:9")
    reset = urllib.error.URLError(ConnectionResetError(104, "Connection reset by peer"))
    assert str(client._failure(reset)).endswith(SCHEME_HINT)
    # Over https:// the scheme is not the likely mistake.
    client = ApiClient("https://127.0.0.1:9")
    assert "cannot reach the sidecar" in str(client._failure(reset))


class Redirector:
    """A real HTTP server that answers every GET 302 to ``location``, and one that notes
    the Authorization header of every request it gets."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []
        seen = self.seen

        class Elsewhere(QuietHandler):
            def do_GET(self) -> None:
                seen.append(self.headers.get("Authorization"))
                self.send_error(404)

        self.elsewhere = serve_in_background(Elsewhere)
        location = f"http://127.0.0.1:{self.elsewhere.server_address[1]}/stolen"

        class Redirecting(QuietHandler):
            def do_GET(self) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.redirecting = serve_in_background(Redirecting)
        self.url = f"http://127.0.0.1:{self.redirecting.server_address[1]}"

    def close(self) -> None:
        for server in (self.elsewhere, self.redirecting):
            stop_serving(server)


@pytest.mark.parametrize("command", [("list",), ("show", "s-1")])
def test_a_redirect_is_not_followed_with_the_token(command: tuple[str, ...], capsys) -> None:  # type: ignore[no-untyped-def]
    """urllib followed a redirect with every header of the request: the bearer token went to
    wherever the endpoint pointed, another host or plain HTTP. The sidecar never redirects:
    the 3xx is an error (exit 1) that says so, and nothing is sent elsewhere."""
    redirector = Redirector()
    try:
        code, out, err = run(
            capsys, "sessions", "--endpoint", redirector.url, "--token", "secret-token-0123456789", *command
        )
    finally:
        redirector.close()
    assert redirector.seen == []
    assert (code, out) == (1, "")
    assert err.startswith(f"durable-sessions-collector: {redirector.url} answered 302, a redirect"), err
    assert "secret-token" not in err
