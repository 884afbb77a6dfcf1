"""The durable store: the interface and its implementations."""

from __future__ import annotations

from durable_sessions_collector.store.base import (
    INDEX_BUILT,
    INDEX_FAILED,
    INDEX_LEFT_TO_ANOTHER,
    ActionRow,
    Alert,
    DeadAlert,
    Pruned,
    RecordRefused,
    SessionDetail,
    SessionSummary,
    Store,
    StoreError,
    Writer,
    action_row,
)
from durable_sessions_collector.store.sqlite import SqliteStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(url: str, *, exclusive: bool = True) -> Store:
    """The store a ``store:`` URL names: ``sqlite:///PATH`` or ``postgresql://…[?schema=NAME]``.

    ``exclusive=False`` is for administrative commands beside a running sidecar: the
    store must exist at this version (nothing is created or migrated), and a SQLite store
    is opened without the lock that keeps a second sidecar off it.
    """
    if url.startswith("sqlite:///"):
        return SqliteStore(url.removeprefix("sqlite:///"), exclusive=exclusive)
    if url.startswith(POSTGRES_SCHEMES):
        try:
            from durable_sessions_collector.store.postgres import PostgresStore
        except ImportError as error:
            raise StoreError(
                f"a PostgreSQL store needs psycopg 3 ({error}); "
                "pip install 'durable-sessions-collector[postgresql]'"
            ) from None
        return PostgresStore(url, existing=not exclusive)
    shown = url.split("://", 1)[0] + "://…" if "://" in url else url
    raise StoreError(f"unsupported URL {shown!r}; expected sqlite:///PATH or postgresql://…")


__all__ = [
    "INDEX_BUILT",
    "INDEX_FAILED",
    "INDEX_LEFT_TO_ANOTHER",
    "ActionRow",
    "Alert",
    "DeadAlert",
    "Pruned",
    "RecordRefused",
    "SessionDetail",
    "SessionSummary",
    "SqliteStore",
    "Store",
    "StoreError",
    "Writer",
    "action_row",
    "open_store",
]
