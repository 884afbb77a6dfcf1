"""``WatchAlerts`` cursors that name the store they are a position in.

A client's cursor is the store's position in its violation feed (``sqlite:V:C``,
``pg:XID:ID[:1]``, see the stores' ``violations_after``) followed by ``@`` and the
store's id (:data:`~durable_sessions_collector.store.base.STORE_ID`), e.g.
``sqlite:12:3@5f0c9a1e2b3d4c6f``. A cursor of another store (a SQLite file lost and made
anew, a PostgreSQL schema dropped and created again) resumes from the start of this
store's feed: every alert of this store was committed after that cursor was given. The
store's position alone would have been read as one of this store, and once the new
store's feed had grown past it, the alerts before it were never sent.

A cursor without ``@`` (as sidecars gave them before) is the store's position and is
read as before; so is every cursor of a store without an id. A position the store cannot
have given (past the end of a SQLite feed; on PostgreSQL, a transaction the server has
not begun, as after a restore into another server, which keeps the store's id) is read
from the start of the feed by the store itself.
"""

from __future__ import annotations

import re

from durable_sessions_collector.quote import quoted
from durable_sessions_collector.store import Store

_SEPARATOR = "@"
_POSITION = re.compile(r"[a-z]+(?::[0-9]{1,19}){1,3}")
_STORE_ID = re.compile(r"[0-9a-f]{16}")


class AlertCursors:
    """Translates between a client's cursors and ``store``'s feed positions. The store's
    id is read once, at the first use (:class:`~durable_sessions_collector.store.StoreError`
    when it cannot be read); a store's id never changes while it is open."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._store_id: str | None = None
        self._read = False

    def position(self, cursor: str) -> str:
        """The store's feed position for a client's ``cursor``: its own for one of this
        store (or of the earlier form), the feed's start for one of another store.
        ValueError when ``cursor`` is no cursor of this API; the position itself is checked
        by the store."""
        position, separator, store_id = cursor.rpartition(_SEPARATOR)
        if not separator:
            return cursor
        if not (_POSITION.fullmatch(position) and _STORE_ID.fullmatch(store_id)):
            raise ValueError(f"not a cursor of this API: {quoted(cursor)}")
        if store_id == self.store_id():
            return position
        return self.store.feed_start()

    def cursor(self, position: str) -> str:
        """The client's cursor of the store's feed ``position``."""
        store_id = self.store_id()
        return position if store_id is None else f"{position}{_SEPARATOR}{store_id}"

    def store_id(self) -> str | None:
        if not self._read:
            self._store_id, self._read = self.store.store_id(), True
        return self._store_id
