"""The durable store: the interface and its implementations."""

from __future__ import annotations

from durable_sessions_collector.store.base import (
    ActionRow,
    Alert,
    SessionDetail,
    SessionSummary,
    Store,
    StoreError,
    Writer,
)
from durable_sessions_collector.store.sqlite import SqliteStore


def open_store(url: str) -> SqliteStore:
    """The store a ``store:`` URL names (``sqlite:///PATH``)."""
    if url.startswith("sqlite:///"):
        return SqliteStore(url.removeprefix("sqlite:///"))
    raise StoreError(f"store: unsupported URL {url!r}; expected sqlite:///PATH")


__all__ = [
    "ActionRow",
    "Alert",
    "SessionDetail",
    "SessionSummary",
    "SqliteStore",
    "Store",
    "StoreError",
    "Writer",
    "open_store",
]
