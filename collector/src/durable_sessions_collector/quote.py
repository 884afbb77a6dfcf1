"""What a client sent, quoted back in an error message: shortened, so a message stays one.

A gRPC error message travels in the ``grpc-message`` trailer, and clients fail a call
whose metadata passes their limit (16 KiB in grpcio) with RESOURCE_EXHAUSTED instead of
the status the server chose; a log line or an HTTP error body has no use for 20,000
characters of an id either.
"""

from __future__ import annotations

LIMIT = 80


def quoted(value: str, limit: int = LIMIT) -> str:
    """``value``'s repr, cut to ``limit`` characters with an ellipsis when longer."""
    return repr(value if len(value) <= limit else value[:limit] + "…")
