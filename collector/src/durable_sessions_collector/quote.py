"""What a client sent, quoted back in an error message: shortened, so a message stays one.

A gRPC error message travels in the ``grpc-message`` trailer, and clients fail a call
whose metadata passes their limit (16 KiB in grpcio) with RESOURCE_EXHAUSTED instead of
the status the server chose; a log line or an HTTP error body has no use for 20,000
characters of an id either.
"""

from __future__ import annotations

from urllib.parse import quote

LIMIT = 80


def quoted(value: str, limit: int = LIMIT) -> str:
    """``value``'s repr, cut to ``limit`` characters with an ellipsis when longer."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def not_text(value: str) -> str | None:
    """None when ``value`` is text; else, when it holds bytes that UTF-8 could not decode
    (lone surrogates, as ``surrogateescape`` and argv leave them), ``value`` with its
    non-ASCII bytes percent-encoded (``caf%E9``), for a message that can show it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return quote(value.encode("utf-8", "surrogateescape"), safe="/")
    return None
