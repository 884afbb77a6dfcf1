"""A small client of the sidecar's HTTP JSON API (used by ``durable-sessions-collector sessions``).

Errors are :class:`ApiError` with a message meant for a person: where it tried, what
went wrong, and what to change (the endpoint, the token, the CA file, the client
certificate). An :class:`ApiUsageError` is the caller's own mistake (a malformed
endpoint, an unreadable CA file or client certificate), found before any request.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, quote, urlencode, urlsplit

from durable_sessions.report import printable
from durable_sessions_collector.config import (
    EncryptedKeyError,
    is_loopback_host,
    redact_url,
    refuse_passphrase,
)
from durable_sessions_collector.quote import not_text
from durable_sessions_collector.store.base import MAX_DETAIL_PAGE
from durable_sessions_collector.store.stored import stored_text

DEFAULT_ENDPOINT = "http://127.0.0.1:4320"
ENDPOINT_ENV = "DURABLE_SESSIONS_API_ENDPOINT"
TOKEN_ENV = "DURABLE_SESSIONS_AUTH_TOKEN"
TOKEN_FILE_ENV = "DURABLE_SESSIONS_AUTH_TOKEN_FILE"
_UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")


DETAIL_PAGE = MAX_DETAIL_PAGE
"""Actions, and violations, asked for in one request of ``sessions show`` (the API's
largest page)."""

LONGEST_PATH = 65_536 - 1_024
"""The longest path asked for: the sidecar's HTTP port reads a request line of 64 KiB
(http.server's limit, a 414 past it), which also holds the method, the query (its page
tokens) and the version."""


class ApiError(Exception):
    """The API could not answer; ``str()`` says why and what to do."""


class ApiUsageError(ApiError):
    """The client's arguments cannot work (the endpoint, the CA file); ``str()`` says which."""


class ApiRefusal(ApiError):
    """The API answered an HTTP error: ``status``, and ``reason``, the reason it gave (the
    sidecar's ``error``) on one line."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


_NOT_FOR_THIS_HOST = "ask the sidecar by an address or name the certificate holds (its subjectAltName)"
_VERIFY_HINTS = {
    # OpenSSL's X509_V_ERR_* codes of a certificate the CA given did sign, where passing the
    # CA again (the hint for any other failure) changes nothing.
    10: "renew the sidecar's tls.cert_file (it serves a renewal without a restart)",
    62: _NOT_FOR_THIS_HOST,  # a host name
    64: _NOT_FOR_THIS_HOST,  # an IP address
}


class ApiClient:
    """The API at ``endpoint``. For ``https://``: ``ca_file`` verifies the sidecar's
    certificate (else the system's CAs do), and ``cert_file`` with ``key_file`` (or a
    ``cert_file`` holding both) is the client certificate a sidecar with
    ``tls.client_ca_file`` requires. An endpoint without a scheme is ``https://`` when
    either file is given. Raises :class:`ApiUsageError` for arguments that cannot work,
    a CA file, client certificate or key with an ``http://`` endpoint included."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        endpoint = endpoint.strip().rstrip("/")
        if "://" not in endpoint:
            endpoint = ("https://" if ca_file or cert_file else "http://") + endpoint
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
        except ValueError:
            parts = None
        # http.client refuses a space or control character in a URL only once it sends it.
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or _UNSENDABLE.search(endpoint)
        ):
            raise ApiUsageError(
                f"--endpoint must be an http(s) URL such as {DEFAULT_ENDPOINT} (host, and a port from 0 "
                f"to 65535, no spaces), got {redact_url(endpoint) if parts is not None else endpoint!r}"
            )
        _refuse_endpoint_parts(endpoint, parts)
        if key_file and not cert_file:
            raise ApiUsageError("--key-file needs --cert-file (the client certificate it is the key of)")
        if parts.scheme == "http":
            _refuse_tls_options(endpoint, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
        self.endpoint = endpoint
        self.token = token
        self.cert_file = cert_file
        self.timeout_s = timeout_s
        self._context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as error:
                raise ApiUsageError(f"cannot load the CA file {ca_file!r}: {error}") from None
            self._context.sslsocket_class = _HandshakeNoted
            if cert_file:
                _load_client_certificate(self._context, cert_file, key_file)
        self._opener = _opener(is_loopback_host(parts.hostname or ""), self._context)

    def get(self, path: str, query: dict[str, Any] | None = None) -> Any:
        url = self.endpoint + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        body = self._fetch(url)
        try:
            return _json(body)
        except _TooDeep:
            raise self._wrong_shape("JSON nested too deeply to read") from None
        except ValueError:
            raise ApiError(
                f"{redact_url(self.endpoint)} did not answer with JSON; is it the sidecar's HTTP port "
                f"(not the gRPC one)?"
            ) from None

    def _fetch(self, url: str) -> bytes:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers)
        if self._context is not None:  # each request has a connection, and a handshake, of its own
            self._context.handshake_done = False  # type: ignore[attr-defined]
        try:
            response = self._opener.open(request, timeout=self.timeout_s)
        # ValueError: http.client refuses a header value with a line break in a message that
        # repeats the value, here the token.
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise self._failure(error) from None
        with response:
            try:
                return _body(response)
            except _BrokenOff as error:
                raise ApiError(
                    f"{redact_url(self.endpoint)} broke off its answer ({error}); try again"
                ) from None

    def _failure(self, error: Exception) -> ApiError:
        """The :class:`ApiError` that says what a failed request means and what to change."""
        shown = redact_url(self.endpoint)
        if isinstance(error, urllib.error.HTTPError):
            return _refusal(shown, error)
        # urllib wraps in a URLError what failed before the request was sent: connecting, TLS.
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(reason, ssl.SSLCertVerificationError):
            why = str(reason.verify_message).rstrip(".")
            hint = _VERIFY_HINTS.get(reason.verify_code, "pass the CA that signed it with --ca-file")
            return ApiError(f"cannot verify the TLS certificate of {shown}: {why}; {hint}")
        if isinstance(reason, ssl.SSLError):
            return self._tls_failure(shown, reason)
        if isinstance(reason, ValueError):
            return ApiUsageError(
                f"cannot send a request to {shown}: the token holds a character that HTTP does not "
                f"allow in a header (value not shown)"
            )
        # A TLS port resets a plain-HTTP connection (or closes it) rather than answering.
        plain = urlsplit(self.endpoint).scheme == "http"
        if isinstance(reason, http.client.HTTPException) or (
            plain and isinstance(reason, ConnectionResetError)
        ):
            return _not_http(shown, reason)
        if isinstance(error, urllib.error.URLError):
            text = getattr(reason, "strerror", None) or str(reason)
            return ApiError(
                f"cannot reach the sidecar at {shown}: {text}; is it running? "
                f"Set the HTTP endpoint with --endpoint or $DURABLE_SESSIONS_API_ENDPOINT"
            )
        return ApiError(f"no answer from the sidecar at {shown}: {error}")

    def _tls_failure(self, shown: str, error: ssl.SSLError) -> ApiError:
        """What a failed TLS handshake means: the endpoint does not speak TLS (it closed the
        connection before the handshake was over), the sidecar asked for a client
        certificate and got none, or refused the one sent.

        In TLS 1.3 the client's handshake is over before the sidecar has checked its
        certificate: the sidecar's alert (``CERTIFICATE_REQUIRED``, ``UNKNOWN_CA``) comes
        with the request, or is lost as the connection closes (an EOF), so both mean that
        the sidecar ended the handshake."""
        why = error.reason or str(error)
        hint = (
            "pass one with --cert-file and --key-file "
            "(or $DURABLE_SESSIONS_CLIENT_CERT_FILE and $DURABLE_SESSIONS_CLIENT_KEY_FILE)"
        )
        if isinstance(error, ssl.SSLEOFError) and not getattr(self._context, "handshake_done", False):
            # Closed before the handshake was over: not a sidecar's refusal of a client
            # certificate (it comes after), but a port that does not speak TLS.
            return ApiError(
                f"{shown} closed the connection during the TLS handshake ({why}); does it serve TLS? "
                f"A sidecar without tls.cert_file is asked with http://"
            )
        if "CERTIFICATE_REQUIRED" in why:
            return ApiError(
                f"{shown} requires a client certificate (mutual TLS: the sidecar has tls.client_ca_file) "
                f"({why}); {hint}"
            )
        if "_ALERT_" in why or isinstance(error, ssl.SSLEOFError):
            if self.cert_file:
                return ApiError(
                    f"{shown} ended the TLS handshake ({why}): the client certificate {self.cert_file!r} "
                    f"must be signed by a CA of the sidecar's tls.client_ca_file, and valid"
                )
            return ApiError(
                f"{shown} ended the TLS handshake ({why}); if it requires a client certificate "
                f"(mutual TLS: the sidecar has tls.client_ca_file), {hint}"
            )
        return ApiError(
            f"TLS failed with {shown}: {why}; is the endpoint's scheme right "
            f"(https:// for a sidecar with tls.cert_file, http:// otherwise)?"
        )

    def _document(
        self, path: str, query: dict[str, Any], lists: tuple[str, ...], tokens: tuple[str, ...]
    ) -> dict[str, Any]:
        """The JSON object at ``path`` with ``lists`` of objects and ``tokens`` (strings, null or
        absent): another shape is not the sidecar's API, and would end in a traceback."""
        document = self.get(path, query)
        if not isinstance(document, dict):
            raise self._wrong_shape("not a JSON object")
        for name in lists:
            items = document.get(name)
            if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
                raise self._wrong_shape(f"no list of objects {name!r}")
        for name in tokens:
            if not isinstance(document.get(name), str | None):
                raise self._wrong_shape(f"{name!r} is not a string")
        return document

    def _session_head(self, session: dict[str, Any]) -> None:
        """Raise :class:`ApiError` unless ``session`` has what every session has in the API."""
        for name in ("session_id", "verdict"):
            if not isinstance(session.get(name), str):
                raise self._wrong_shape(f"a session without a string {name!r}")

    def _wrong_shape(self, problem: str) -> ApiError:
        return ApiError(
            f"{redact_url(self.endpoint)} did not answer like the sidecar's API ({problem}); "
            f"is it the sidecar's HTTP port?"
        )

    def list_sessions(
        self,
        verdict: str | None = None,
        limit: int | None = None,
        *,
        every_page: bool = False,
        warn: Callable[[str], None] = lambda message: None,
    ) -> tuple[list[dict[str, Any]], str]:
        """The first page of at most ``limit`` sessions, most recently active first, or with
        ``every_page`` all of them, asked ``limit`` at a time; and the token of the page
        after them: empty when there is none, as after ``every_page``.

        ``every_page`` walks the pages in the order of session ids, which activity does not
        change, and then puts the sessions most recently active first (as each was when its
        page was read): every session that exists throughout the walk is listed once. Walked
        most recently active first, a session that became active during the walk moved
        ahead of it and was never listed. A sidecar older than that order (it refuses the
        argument) is walked so all the same, and ``warn`` is told what that may cost."""
        try:
            sessions, token = self._walk(verdict, limit, every_page, "session_id" if every_page else None)
        except ApiRefusal as error:
            if not (every_page and _refuses_argument(error, "order")):
                raise
            warn(
                f"{redact_url(self.endpoint)} is an older sidecar, which cannot list sessions by id "
                f"(it answered {error.status}: {error.reason}); walked most recently active first "
                f"instead: a session that receives spans during the walk may be listed twice or missed"
            )
            sessions, token = self._walk(verdict, limit, every_page, None)
        if every_page:
            sessions.sort(key=_by_activity, reverse=True)
        return sessions, token

    def _walk(
        self, verdict: str | None, limit: int | None, every_page: bool, order: str | None
    ) -> tuple[list[dict[str, Any]], str]:
        """The sessions of the first page, or of every page, in ``order``; and the next token."""
        sessions: list[dict[str, Any]] = []
        token = None
        seen: set[str] = set()
        while True:
            query = {"verdict": verdict, "limit": limit, "page_token": token, "order": order}
            page = self._document("/api/sessions", query, ("sessions",), ("next_page_token",))
            for session in page["sessions"]:
                self._session_head(session)
            sessions.extend(page["sessions"])
            token = self._next(page.get("next_page_token"), seen)
            if not (every_page and token):
                return sessions, token

    def session(self, session_id: str) -> dict[str, Any]:
        """The session with all of its actions and violations, asked a page at a time.
        :class:`ApiUsageError` for an id that is not UTF-8 text (bytes of argv that UTF-8
        does not decode), which no session has."""
        if (shown := not_text(session_id)) is not None:
            raise ApiUsageError(f"SESSION_ID {shown!r} is not UTF-8 text, as every session id is")
        path = "/api/sessions/" + quote(session_id, safe="")
        if len(path) > LONGEST_PATH:
            # An id this long is stored, listed, and found, by its digest form.
            path = "/api/sessions/" + quote(stored_text(session_id), safe="")
        names = ("actions", "violations")
        next_names = tuple(f"next_{name}_page_token" for name in names)
        query = {"actions_limit": DETAIL_PAGE, "violations_limit": DETAIL_PAGE}
        detail = self._document(path, query, names, next_names)
        self._session_head(detail)
        tokens = {name: detail.pop(f"next_{name}_page_token", None) or "" for name in names}
        seen: set[str] = set()
        while any(tokens.values()):
            query = {}
            for name, token in tokens.items():
                # A list walked to its end is asked for one item (its first page again).
                query |= {f"{name}_limit": DETAIL_PAGE if token else 1, f"{name}_page_token": token or None}
            page = self._document(path, query, names, next_names)
            for name, token in tokens.items():
                if token:
                    detail[name].extend(page[name])
                    tokens[name] = self._next(page.get(f"next_{name}_page_token"), seen)
        return detail

    def _next(self, token: str | None, seen: set[str]) -> str:
        """``token``, the next page's, unless the walk had it already: an endpoint that gives
        one token again would be walked for ever."""
        if token and token in seen:
            raise self._wrong_shape("the same page token twice")
        if token:
            seen.add(token)
        return token or ""


def _refuses_argument(error: ApiRefusal, name: str) -> bool:
    """Whether ``error`` is a sidecar's refusal of the query argument ``name``, as one that
    does not take it answers (400 "unknown argument 'order'; this path takes …")."""
    return error.status == 400 and error.reason.startswith(f"unknown argument {name!r}")


def _by_activity(session: dict[str, Any]) -> tuple[float, str]:
    """The API's default order of the list, as a key of an ascending sort to reverse: last
    activity, then id (a session without a numeric ``last_seen`` last)."""
    last_seen = session.get("last_seen")
    number = (
        last_seen if isinstance(last_seen, int | float) and not isinstance(last_seen, bool) else -math.inf
    )
    return number, session["session_id"]


class _HandshakeNoted(ssl.SSLSocket):
    """A TLS socket that notes on its context (``handshake_done``) that its handshake is
    over. A connection then closed without a word is the sidecar refusing the client's
    certificate (TLS 1.3 checks it after the client's side of the handshake ends); closed
    before, it is a port that does not speak TLS, such as a sidecar's plain HTTP port."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        self.context.handshake_done = True  # type: ignore[attr-defined]


def _opener(loopback: bool, context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """What requests go through: ``https_proxy``/``http_proxy``/``no_proxy`` apply, except
    to a loopback sidecar, which is reached directly, as Go's ``ProxyFromEnvironment`` (and
    so the Collector and its tools) does: a proxy would reach its own loopback, not this
    host's, and be handed the bearer token on the way."""
    handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    if loopback:
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: the sidecar's API never sends one, and urllib repeats
    every header of the request to the new location, the bearer token included, to
    another host and over plain HTTP as well. The 3xx is the answer (:func:`_refusal`)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _refuse_endpoint_parts(endpoint: str, parts: SplitResult) -> None:
    """Raise :class:`ApiUsageError` for an endpoint with a part the API's paths cannot
    follow: a query or fragment (the paths would be added to it: ``?tenant=a`` asked
    ``/?tenant=a/api/sessions``, ``#top`` asked ``/``), or a user and password, which
    urllib takes for part of the host name, and which the sidecar would not read."""
    why = ""
    if "?" in endpoint or "#" in endpoint:
        why = "a query (?…) or fragment (#…): the API's paths are added to it"
    elif "@" in parts.netloc:
        why = (
            "user or password: the sidecar takes a bearer token "
            "(--token, --token-file or $DURABLE_SESSIONS_AUTH_TOKEN)"
        )
    if why:
        raise ApiUsageError(f"--endpoint takes no {why}, got {redact_url(endpoint)!r}")


# The TLS-only options, as the CLI names them: the flag and the variable it falls back to.
_TLS_OPTIONS = (
    ("ca_file", "--ca-file", "DURABLE_SESSIONS_CA_FILE"),
    ("cert_file", "--cert-file", "DURABLE_SESSIONS_CLIENT_CERT_FILE"),
    ("key_file", "--key-file", "DURABLE_SESSIONS_CLIENT_KEY_FILE"),
)
TLS_VARIABLES = {name: variable for name, _, variable in _TLS_OPTIONS}
CLIENT_VARIABLES = (ENDPOINT_ENV, TOKEN_ENV, TOKEN_FILE_ENV, *TLS_VARIABLES.values())
"""Every variable the ``sessions`` commands read."""


def _refuse_tls_options(endpoint: str, **given: str | None) -> None:
    """Raise :class:`ApiUsageError` naming the TLS options in ``given`` that are set, for
    an ``http://`` endpoint: plain HTTP would ignore them, so a user who meant the sidecar's
    TLS port would send the token in the clear and never learn why the CA went unused."""
    named = [f"{flag} (or ${variable})" for name, flag, variable in _TLS_OPTIONS if given.get(name)]
    if named:
        raise ApiUsageError(
            f"{' and '.join(named)} {'is' if len(named) == 1 else 'are'} for TLS, but --endpoint "
            f"{redact_url(endpoint)} is http://, plain HTTP: use https:// for a sidecar with "
            f"tls.cert_file, or leave {'it' if len(named) == 1 else 'them'} out"
        )


def _load_client_certificate(context: ssl.SSLContext, cert_file: str, key_file: str | None) -> None:
    """Have ``context`` present ``cert_file`` (with ``key_file``, or the key in the same
    file); an encrypted key is refused rather than prompted for."""
    try:
        context.load_cert_chain(cert_file, key_file, password=refuse_passphrase)
    except EncryptedKeyError as error:
        raise ApiUsageError(f"the client key {key_file or cert_file!r}: {error}") from None
    except (OSError, ssl.SSLError) as error:
        why = getattr(error, "strerror", None) or getattr(error, "reason", None) or error
        key = f" with the key {key_file!r}" if key_file else " (no --key-file: the key must be in it)"
        raise ApiUsageError(f"cannot load the client certificate {cert_file!r}{key}: {why}") from None


def _refusal(shown: str, error: urllib.error.HTTPError) -> ApiRefusal:
    try:
        detail = _error_text(_body(error))
    except _BrokenOff:
        detail = "no details (the answer was broken off)"
    if error.code == 401:
        hint = "pass the sidecar's token with --token, --token-file or $DURABLE_SESSIONS_AUTH_TOKEN"
        return ApiRefusal(f"{shown} refused the request (401 {detail}); {hint}", error.code, detail)
    if 300 <= error.code < 400:
        return ApiRefusal(
            f"{shown} answered {error.code}, a redirect, which the sidecar's API never sends (not followed: "
            f"the request carries the token); is it the sidecar's HTTP port, with the right scheme?",
            error.code,
            detail,
        )
    return ApiRefusal(f"{shown} answered {error.code}: {detail}", error.code, detail)


def _not_http(shown: str, reason: Exception) -> ApiError:
    """No HTTP/1.1 answer: most likely the gRPC port (HTTP/2 only), or a TLS port asked
    without TLS, which resets or closes the connection."""
    if isinstance(reason, http.client.RemoteDisconnected):
        what = "closed the connection without answering"
    elif isinstance(reason, ConnectionResetError):
        what = "reset the connection without answering"
    else:
        what = f"did not answer with HTTP/1.1 ({type(reason).__name__})"
    return ApiError(
        f"{shown} {what}; is it the sidecar's HTTP port (not the gRPC one), with the right scheme "
        f"(https:// for a sidecar with tls.cert_file)?"
    )


class _BrokenOff(Exception):
    """The answer ended before its end (``str()``: how); its status and headers came."""


def _body(response: Any) -> bytes:
    """The whole body of ``response``, an answer or an :class:`urllib.error.HTTPError`;
    :class:`_BrokenOff` when the connection closes, resets or times out before its end. The
    status line came, so it is the server, not the port, that failed: not the gRPC port nor
    TLS, which fail before."""
    try:
        return bytes(response.read())
    except http.client.IncompleteRead as error:
        expected = f" of {len(error.partial) + error.expected}" if error.expected else ""
        raise _BrokenOff(f"the connection closed after {len(error.partial)}{expected} bytes") from None
    except (OSError, http.client.HTTPException) as error:
        raise _BrokenOff(getattr(error, "strerror", None) or str(error) or type(error).__name__) from None


class _TooDeep(ValueError):
    """JSON nested more deeply than :func:`json.loads`, which reads by recursion, can read."""


def _json(body: bytes) -> Any:
    """``body`` read as JSON: :class:`ValueError` when it is not, :class:`_TooDeep` when it
    is nested too deeply to read (a RecursionError, which ended the command in a traceback)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise _TooDeep from None


def _error_text(body: bytes) -> str:
    """The reason an error answer gives, on one line (:func:`printable`): the sidecar's
    ``error``, or the start of another server's page (a proxy's HTML)."""
    try:
        document = _json(body)
    except ValueError:
        return printable(body[:200].decode("utf-8", "replace")) or "no details"
    if isinstance(document, dict) and isinstance(document.get("error"), str):
        return printable(document["error"])
    return printable(str(document)[:200])
