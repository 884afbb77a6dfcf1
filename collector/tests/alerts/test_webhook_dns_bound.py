"""``alerts.webhook.timeout_s`` bounds resolving the receiver's host name too.

A host name is resolved in a thread of its own, waited for until the attempt's deadline:
a resolver that has not answered by then makes the attempt a timeout to retry. Resolved
addresses are tried in order; TLS still checks the URL's host name. An IP literal is
connected to directly, with no resolver thread.

The system resolver cannot be made to hang for real, so ``socket.getaddrinfo`` is wrapped
(:func:`resolver`): it never answers for ``hung.invalid`` (until the test ends), answers
names of the test's choosing with addresses of its choosing, asks the real resolver for
the rest, and records who asked. Deliveries go to real local HTTP(S) servers.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from durable_sessions_collector.alerts.outbox import Attempt
from durable_sessions_collector.alerts.webhook import WebhookAlerts
from tls_certs import make_cert
from webhook_server import ALERT, QuietHandler, free_port, serve_in_background, stop_serving, webhook_channel

REAL_GETADDRINFO = socket.getaddrinfo
HUNG = "hung.invalid"


@dataclass
class Resolver:
    """What the wrapped ``socket.getaddrinfo`` was asked, and how it answers."""

    calls: list[tuple[str, threading.Thread]] = field(default_factory=list)  # (host, asking thread)
    answers: dict[str, list[Any]] = field(default_factory=dict)  # host -> its getaddrinfo answer
    release: threading.Event = field(default_factory=threading.Event)  # HUNG answers once set

    def threads(self, host: str) -> list[threading.Thread]:
        return [thread for name, thread in self.calls if name == host]


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Resolver]:
    resolver = Resolver()

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        resolver.calls.append((host, threading.current_thread()))
        if host == HUNG:
            resolver.release.wait()
            raise socket.gaierror(socket.EAI_NONAME, "released by the test")
        if host in resolver.answers:
            return resolver.answers[host]
        return REAL_GETADDRINFO(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):  # connect directly
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    yield resolver
    resolver.release.set()  # the abandoned resolver thread ends


class Receiver:
    """A real local HTTP server (``http.server`` in a thread, TLS when ``tls`` is given) that
    answers each POST 200 and keeps its Idempotency-Key, and over TLS the server name (SNI)
    each client sent."""

    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.keys: list[str | None] = []
        self.server_names: list[str | None] = []
        self.scheme = "https" if tls else "http"
        owner = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.keys.append(self.headers.get("Idempotency-Key"))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        if tls is not None:
            tls.sni_callback = lambda _sock, name, _context: self.server_names.append(name)
        self.httpd = serve_in_background(Handler, host, tls=tls)
        self.port = self.httpd.server_address[1]

    def url(self, host: str) -> str:
        return f"{self.scheme}://{host}:{self.port}/hook"

    def close(self) -> None:
        stop_serving(self.httpd)


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for receiver in made:
        receiver.close()


def timed_post(hook: WebhookAlerts) -> tuple[Attempt, float, threading.Thread]:
    """``hook.post(ALERT)`` in a thread of its own: the attempt, how long it took, and the
    thread. Fails (rather than hangs) if the POST is not over ``timeout_s`` + 3 s after."""
    result: list[Attempt] = []
    thread = threading.Thread(target=lambda: result.append(hook.post(ALERT)), daemon=True)
    begun = time.monotonic()
    thread.start()
    thread.join(hook.timeout_s + 3)
    assert result, f"the POST was still going {hook.timeout_s + 3:g} s after it began"
    return result[0], time.monotonic() - begun, thread


def stream_addresses(port: int) -> list[Any]:
    return REAL_GETADDRINFO("127.0.0.1", port, type=socket.SOCK_STREAM)


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context for a certificate of localhost and 127.0.0.1, its CA trusted."""
    ca, cert, key = make_cert(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    return context


def test_a_hung_resolver_is_cut_off_at_timeout_s_and_the_attempt_retried(resolver: Resolver) -> None:
    attempt, took, _ = timed_post(webhook_channel(f"http://{HUNG}:8080/hook", timeout_s=0.6))
    assert attempt.outcome == "retry", attempt
    assert attempt.error == f"timed out: host name {HUNG!r} not resolved within timeout_s = 0.6 s"
    assert 0.5 <= took < 1.1, f"the POST took {took:.2f} s with timeout_s = 0.6"
    # The resolver thread, left behind, ends once the resolver answers.
    [left_behind] = resolver.threads(HUNG)
    resolver.release.set()
    left_behind.join(2)
    assert not left_behind.is_alive()


def test_a_host_name_is_resolved_off_the_delivery_thread_and_delivered(
    resolver: Resolver, receivers: list[Receiver]
) -> None:
    receiver = Receiver()
    receivers.append(receiver)
    attempt, took, poster = timed_post(webhook_channel(receiver.url("localhost")))
    assert attempt.outcome == "delivered", attempt
    assert took < 1.5 and len(receiver.keys) == 1
    [resolving] = resolver.threads("localhost")
    assert resolving is not poster


def test_the_resolved_addresses_are_tried_in_order(resolver: Resolver, receivers: list[Receiver]) -> None:
    first, second = Receiver(), Receiver()
    receivers += [first, second]
    refused = stream_addresses(free_port())
    resolver.answers["two.test"] = refused + stream_addresses(first.port) + stream_addresses(second.port)
    attempt, _, _ = timed_post(webhook_channel("http://two.test:1/hook"))
    assert attempt.outcome == "delivered", attempt
    assert (len(first.keys), len(second.keys)) == (1, 0)
    # None accepts: a retry, with the last address's error.
    resolver.answers["none.test"] = refused + stream_addresses(free_port())
    attempt, _, _ = timed_post(webhook_channel("http://none.test:1/hook"))
    assert attempt.outcome == "retry" and "Connection refused" in (attempt.error or ""), attempt


def test_https_checks_the_certificate_and_sends_sni_for_the_urls_host_name(
    resolver: Resolver, receivers: list[Receiver], tls: ssl.SSLContext
) -> None:
    receiver = Receiver(tls=tls)
    receivers.append(receiver)
    attempt, _, poster = timed_post(webhook_channel(receiver.url("localhost")))
    assert attempt.outcome == "delivered", attempt
    assert receiver.server_names == ["localhost"]
    assert [thread is not poster for thread in resolver.threads("localhost")] == [True]
    # The certificate is for 127.0.0.1 as well, the address a name not in it resolves to
    # here: it is checked against the name, so no delivery.
    resolver.answers["other.test"] = stream_addresses(receiver.port)
    attempt, _, _ = timed_post(webhook_channel(receiver.url("other.test")))
    assert attempt.outcome == "retry" and "Hostname mismatch" in (attempt.error or ""), attempt
    assert receiver.server_names == ["localhost", "other.test"] and len(receiver.keys) == 1


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("bind", "host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        pytest.param(
            "::1", "[::1]", marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
        ),
    ],
)
def test_an_ip_literal_is_connected_to_without_a_resolver_thread(
    resolver: Resolver, receivers: list[Receiver], bind: str, host: str
) -> None:
    receiver = Receiver(bind)
    receivers.append(receiver)
    attempt, _, poster = timed_post(webhook_channel(receiver.url(host)))
    assert attempt.outcome == "delivered", attempt
    assert len(receiver.keys) == 1
    assert {thread for _, thread in resolver.calls} <= {poster}, resolver.calls


def test_a_name_that_does_not_resolve_is_a_retry_with_the_resolvers_error(resolver: Resolver) -> None:
    with pytest.raises(socket.gaierror) as failed:
        REAL_GETADDRINFO("nonexistent.invalid", 80, type=socket.SOCK_STREAM)
    attempt, took, poster = timed_post(webhook_channel("http://nonexistent.invalid/hook", timeout_s=5))
    assert attempt == Attempt("retry", f"cannot connect: {failed.value}", receiver_unavailable=True)
    assert took < 2, f"the POST took {took:.2f} s: the resolver's answer was not passed on at once"
    [resolving] = resolver.threads("nonexistent.invalid")
    assert resolving is not poster


@pytest.fixture
def unanswered() -> Iterator[list[Any]]:
    """``getaddrinfo`` answers for a loopback port where a connection is never answered (a
    host that drops the SYN): a listening socket whose one-connection backlog is filled."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=2)
    yield stream_addresses(listener.getsockname()[1])
    filler.close()
    listener.close()


def test_addresses_that_never_answer_are_tried_within_one_timeout_s(
    resolver: Resolver, unanswered: list[Any]
) -> None:
    """Each address had the whole ``timeout_s`` to connect in (the deadline watches a
    socket only once it is connected), so a name of three silent addresses held the
    attempt three times as long (15 s by default, where stop() waits 7 s for it)."""
    resolver.answers["silent.test"] = unanswered * 3
    attempt, took, _ = timed_post(webhook_channel("http://silent.test:1/hook", timeout_s=0.6))
    assert 0.5 <= took < 1.1, f"the POST took {took:.2f} s with timeout_s = 0.6"
    assert (attempt.outcome, attempt.receiver_unavailable) == ("retry", True), attempt
    assert attempt.error == "timed out: no connection to 'silent.test' within timeout_s = 0.6 s", attempt


def test_an_address_that_answers_after_a_silent_one_is_reached_within_timeout_s(
    resolver: Resolver, receivers: list[Receiver], unanswered: list[Any]
) -> None:
    """A name whose first address drops the SYN (an IPv6 route that black-holes, a pod that
    is gone) and whose second answers: the first had the whole timeout_s, so the second was
    never tried in time and every attempt failed until the alert was dead-lettered. The
    time is spread over the addresses, each given at least 2 s (as Go's dialer does)."""
    receiver = Receiver()
    receivers.append(receiver)
    resolver.answers["late.test"] = unanswered + stream_addresses(receiver.port)
    attempt, took, _ = timed_post(webhook_channel("http://late.test:1/hook", timeout_s=4))
    assert attempt.outcome == "delivered", attempt
    assert len(receiver.keys) == 1
    assert 1.8 <= took < 3.5, f"the POST took {took:.2f} s with timeout_s = 4"
