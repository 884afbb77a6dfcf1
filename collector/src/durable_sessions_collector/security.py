"""Security on both ports: TLS, the bearer token, and keeping secrets out of the log.

- **TLS** (``tls.cert_file`` + ``tls.key_file``): the gRPC port uses grpcio's server
  credentials, the HTTP port wraps each accepted connection in its own thread (a client
  that never finishes its handshake cannot stall the accept loop). Both follow the files
  when they change (:mod:`.credentials`).
- **Bearer token** (``auth.token`` or ``auth.token_file``): every request must carry
  ``Authorization: Bearer <token>`` — on gRPC the ``authorization`` metadata — exactly
  as the OpenTelemetry Collector's ``bearertokenauth`` extension sends it (scheme
  ``Bearer``, one space, the token). Missing or wrong: HTTP 401 with
  ``WWW-Authenticate: Bearer``, gRPC ``UNAUTHENTICATED``. Only ``GET /healthz`` and, on
  the gRPC port, ``grpc.health.v1.Health/Check`` stay open, so that load balancers and
  orchestrators (a kubelet probe sends no token) can probe the sidecar; without the token
  they say nothing but ok/unhealthy (the reason is for authenticated callers). Tokens are
  compared in constant time; ``auth.token_file`` is followed when it changes
  (:mod:`.credentials`).
- **Secrets never logged**: :class:`~.redaction.RedactingStream` sits under the JSON log
  and replaces every configured secret (the token, the webhook URL's credentials and
  query values) by ``***`` in each line, whatever component wrote it.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc

from durable_sessions_collector.config import EncryptedKeyError, refuse_passphrase
from durable_sessions_collector.grpchandlers import answered_by
from durable_sessions_collector.httpserver import Request, Response
from durable_sessions_collector.otlp.http_receiver import answer_media_type, status_body

# Re-exported: RedactingStream lived here before the command line needed it without grpc.
from durable_sessions_collector.redaction import RedactingStream as RedactingStream

if TYPE_CHECKING:
    from durable_sessions_collector.credentials import BearerToken

OPEN_PATHS = frozenset({"/healthz"})
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
"""The gRPC port's counterpart of ``GET /healthz``: one answer, the status alone (see
:mod:`.api.health`). ``Watch`` is not open: a stream holds one of few slots, and a worker
thread, for as long as its client likes; ``List`` answers nothing a probe needs."""
STREAM_RECHECK_S = 1.0
"""How often an open stream looks again at the token it was opened with (:class:`StreamToken`)."""
REALM = "durable-sessions"
HANDSHAKE_TIMEOUT_S = 10.0


def token_matches(header: str | None, token: BearerToken) -> bool:
    """True when ``header`` is ``Bearer <credentials>`` and ``token`` accepts the credentials
    (the scheme is case-insensitive, RFC 7235)."""
    if not header:
        return False
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return token.accepts(credentials.strip())


# --- HTTP ---------------------------------------------------------------------------------


def _why(header: str | None) -> str:
    if not header:
        return "missing Authorization header; send Authorization: Bearer <token>"
    return "invalid bearer token"


class HttpAuth:
    """The HTTP port's gate: ``check(request)`` is None to go on, else the 401 to send."""

    def __init__(self, token: BearerToken, *, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self._token = token
        self.open_paths = frozenset(open_paths)

    def check(self, request: Request) -> Response | None:
        """Also sets ``request.authenticated``: an open path lets everyone in, but only a
        caller with the token may be told more than ok/unhealthy."""
        header = request.header("Authorization") or None
        request.authenticated = token_matches(header, self._token)
        if request.authenticated or (request.path in self.open_paths and request.method in ("GET", "HEAD")):
            return None
        message = _why(header)
        challenge = f'Bearer realm="{REALM}"' + ("" if header is None else ', error="invalid_token"')
        if request.path == "/v1/traces":
            # OTLP/HTTP: the error body is a google.rpc.Status in the request's encoding.
            response = status_body(401, message, answer_media_type(request))
        else:
            response = Response.json(401, {"error": message})
        response.headers["WWW-Authenticate"] = challenge
        return response


# --- gRPC ---------------------------------------------------------------------------------


class GrpcAuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata on every RPC of the gRPC port
    but those of ``open_methods`` (``/package.Service/Method``), which everyone may call,
    with a wrong token too, as anyone may ``GET /healthz``."""

    def __init__(self, token: BearerToken, *, open_methods: Iterable[str] = OPEN_METHODS) -> None:
        self._token = token
        self.open_methods = frozenset(open_methods)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        header = authorization(handler_call_details.invocation_metadata)
        handler = continuation(handler_call_details)
        open_method = handler_call_details.method in self.open_methods  # tells only ok/unhealthy
        if handler is None or open_method or token_matches(header, self._token):
            return handler
        message = _why(header)

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return answered_by(handler, deny)


def authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The first ``authorization`` value of a call's metadata (None if none, or binary)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class StreamToken:
    """The token a server stream was opened with, looked at again as the stream goes on:
    the interceptor checks a call once, at its start, and a stream opened with a token
    later rotated out (a leaked one, say) went on being served. :meth:`check`, called
    from the stream's loop, ends it ``UNAUTHENTICATED`` once the token is no longer
    accepted, looking at most every ``recheck_s``. Without a configured token it does
    nothing."""

    def __init__(
        self, token: BearerToken | None, context: grpc.ServicerContext, recheck_s: float = STREAM_RECHECK_S
    ) -> None:
        self._token = token
        self._header = authorization(context.invocation_metadata()) if token is not None else None
        self._recheck_s = recheck_s
        self._next = time.monotonic() + recheck_s

    def check(self, context: grpc.ServicerContext) -> None:
        if self._token is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._recheck_s
        if not token_matches(self._header, self._token):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the token this stream was opened with is no longer accepted; open it again with the current one",
            )


# --- TLS ----------------------------------------------------------------------------------


def read_pem(path: str, what: str, key: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise OSError(f"{key}: cannot read the {what} {path!r}: {error.strerror or error}") from None


def server_ssl_context(
    cert_file: str, key_file: str, client_ca: bytes | None = None, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """A TLS 1.2+ server context for the HTTP port; with ``client_ca`` (PEM, read from
    ``client_ca_file``, which errors name), one that requires a client certificate signed by it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file, password=refuse_passphrase)
    except EncryptedKeyError as error:
        raise OSError(f"tls.key_file: {key_file!r}: {error}") from None
    except (ssl.SSLError, OSError) as error:
        raise OSError(_why_not_loaded(cert_file, key_file, error)) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as error:
            raise OSError(
                f"tls.client_ca_file: cannot load a CA certificate"
                f"{f' from {client_ca_file!r}' if client_ca_file else ''}: "
                f"{getattr(error, 'reason', None) or error}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["http/1.1"])
    return context


def _why_not_loaded(cert_file: str, key_file: str, error: Exception) -> str:
    """Why OpenSSL refused the pair, naming the file at fault where its words do not
    ("[SSL] PEM lib (_ssl.c:3905)", "KEY_VALUES_MISMATCH"): files swapped or one given
    twice, as a Secret's keys are easily mixed up, or a key that is not the certificate's."""
    reason = getattr(error, "reason", None)
    if reason == "KEY_VALUES_MISMATCH":
        return f"tls.key_file: {key_file!r} is not the private key of the certificate {cert_file!r}"
    if isinstance(error, ssl.SSLError):
        if not _holds(cert_file, b"-----BEGIN CERTIFICATE-----"):
            return f"tls.cert_file: {cert_file!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        if not _holds(key_file, b"PRIVATE KEY-----"):
            return f"tls.key_file: {key_file!r} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
    return (
        f"tls.cert_file/tls.key_file: cannot load the certificate {cert_file!r} with key {key_file!r}: "
        f"{reason or error}"
    )


def _holds(path: str, marker: bytes) -> bool:
    """Whether the file at ``path`` holds ``marker`` (True when it cannot be read: OpenSSL's
    words are then the better ones)."""
    try:
        with open(path, "rb") as handle:
            return marker in handle.read()
    except OSError:
        return True


def wrap_accepted(context: ssl.SSLContext, connection: socket.socket) -> ssl.SSLSocket:
    """TLS handshake of one accepted connection (in its own thread), bounded in time."""
    connection.settimeout(HANDSHAKE_TIMEOUT_S)
    wrapped = context.wrap_socket(connection, server_side=True)
    wrapped.settimeout(None)
    return wrapped
