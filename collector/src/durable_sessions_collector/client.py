"""A small client of the sidecar's HTTP JSON API (used by ``durable-sessions-collector sessions``).

Errors are :class:`ApiError` with a message meant for a person: where it tried, what
went wrong, and what to change (the endpoint, the token, the CA file). An
:class:`ApiUsageError` is the caller's own mistake (a malformed endpoint, an unreadable
CA file), found before any request.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from durable_sessions_collector.config import redact_url
from durable_sessions_collector.store.base import MAX_DETAIL_PAGE

DEFAULT_ENDPOINT = "http://127.0.0.1:4320"


DETAIL_PAGE = MAX_DETAIL_PAGE
"""Actions, and violations, asked for in one request of ``sessions show`` (the API's
largest page)."""


class ApiError(Exception):
    """The API could not answer; ``str()`` says why and what to do."""


class ApiUsageError(ApiError):
    """The client's arguments cannot work (the endpoint, the CA file); ``str()`` says which."""


class ApiClient:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        token: str | None = None,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        endpoint = endpoint.strip().rstrip("/")
        if "://" not in endpoint:
            endpoint = ("https://" if ca_file else "http://") + endpoint
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiUsageError(
                f"--endpoint must be an http(s) URL such as {DEFAULT_ENDPOINT} (host, and a port from 0 "
                f"to 65535), got {redact_url(endpoint) if parts is not None else endpoint!r}"
            )
        self.endpoint = endpoint
        self.token = token
        self.timeout_s = timeout_s
        self._context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as error:
                raise ApiUsageError(f"cannot load the CA file {ca_file!r}: {error}") from None

    def get(self, path: str, query: dict[str, Any] | None = None) -> Any:
        url = self.endpoint + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None})
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers)
        shown = redact_url(self.endpoint)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = _error_text(error.read())
            if error.code == 401:
                hint = "pass the sidecar's token with --token, --token-file or $DURABLE_SESSIONS_AUTH_TOKEN"
                raise ApiError(f"{shown} refused the request (401 {detail}); {hint}") from None
            raise ApiError(f"{shown} answered {error.code}: {detail}") from None
        except urllib.error.URLError as error:
            reason = error.reason
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise ApiError(
                    f"cannot verify the TLS certificate of {shown}: {reason.verify_message}; "
                    f"pass the CA that signed it with --ca-file"
                ) from None
            if isinstance(reason, ssl.SSLError):
                raise ApiError(
                    f"TLS failed with {shown}: {reason.reason or reason}; is the endpoint's scheme right "
                    f"(https:// for a sidecar with tls.cert_file, http:// otherwise)?"
                ) from None
            text = getattr(reason, "strerror", None) or str(reason)
            raise ApiError(
                f"cannot reach the sidecar at {shown}: {text}; is it running? "
                f"Set the HTTP endpoint with --endpoint or $DURABLE_SESSIONS_API_ENDPOINT"
            ) from None
        except http.client.HTTPException as error:
            # No HTTP/1.1 answer (BadStatusLine…): most likely the gRPC port, which speaks HTTP/2 only.
            what = (
                "closed the connection without answering"
                if isinstance(error, http.client.RemoteDisconnected)
                else f"did not answer with HTTP/1.1 ({type(error).__name__})"
            )
            raise ApiError(
                f"{shown} {what}; is it the sidecar's HTTP port (not the gRPC one), with the right scheme "
                f"(https:// for a sidecar with tls.cert_file)?"
            ) from None
        except (TimeoutError, OSError) as error:
            raise ApiError(f"no answer from the sidecar at {shown}: {error}") from None
        try:
            return json.loads(body)
        except ValueError:
            raise ApiError(
                f"{shown} did not answer with JSON; is it the sidecar's HTTP port (not the gRPC one)?"
            ) from None

    def list_sessions(
        self, verdict: str | None = None, limit: int | None = None, *, every_page: bool = False
    ) -> list[dict[str, Any]]:
        """The first page of at most ``limit`` sessions, or with ``every_page`` all of them,
        asked ``limit`` at a time."""
        sessions: list[dict[str, Any]] = []
        token = None
        while True:
            page = self.get("/api/sessions", {"verdict": verdict, "limit": limit, "page_token": token})
            sessions.extend(page["sessions"])
            token = page.get("next_page_token")
            if not (every_page and token):
                return sessions

    def session(self, session_id: str) -> dict[str, Any]:
        """The session with all of its actions and violations, asked a page at a time."""
        path = "/api/sessions/" + quote(session_id, safe="")
        detail = dict(self.get(path, {"actions_limit": DETAIL_PAGE, "violations_limit": DETAIL_PAGE}))
        tokens = {name: detail.pop(f"next_{name}_page_token", "") for name in ("actions", "violations")}
        while any(tokens.values()):
            query = {}
            for name, token in tokens.items():
                # A list walked to its end is asked for one item (its first page again).
                query |= {f"{name}_limit": DETAIL_PAGE if token else 1, f"{name}_page_token": token or None}
            page = self.get(path, query)
            for name, token in tokens.items():
                if token:
                    detail[name].extend(page[name])
                    tokens[name] = page.get(f"next_{name}_page_token", "")
        return detail


def _error_text(body: bytes) -> str:
    try:
        document = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace") or "no details"
    if isinstance(document, dict) and isinstance(document.get("error"), str):
        return document["error"]
    return str(document)[:200]
