"""Keyset paging of the session list, one scheme for the HTTP and the gRPC API.

A page is the sessions most recently active first; its ``next_page_token`` (empty on the
last page) is opaque to clients and holds the position after the page's last session
(its ``last_seen`` and id) and the verdict asked, so that a token is refused with another
verdict. A session that becomes active again between two pages moves to the front: one
walk through the pages may miss it, or list it twice.
"""

from __future__ import annotations

import base64
import binascii
import json

from durable_sessions_collector.store import Store
from durable_sessions_collector.store.base import SessionSummary

DEFAULT_PAGE = 100
MAX_PAGE = 1000


def list_page(
    store: Store, verdict: str | None, size: int, page_token: str = ""
) -> tuple[list[SessionSummary], str]:
    """One page of at most ``size`` sessions and the token of the next one (empty: none).

    Raises ValueError for a ``page_token`` this API did not give for ``verdict``, and
    :class:`~durable_sessions_collector.store.StoreError` when the store cannot be read.
    """
    after = decode_page_token(page_token, verdict) if page_token else None
    # One more than asked tells whether there is a next page.
    sessions = store.list_sessions(verdict, size + 1, after)  # type: ignore[arg-type]
    if len(sessions) <= size:
        return sessions, ""
    sessions = sessions[:size]
    return sessions, encode_page_token(sessions[-1], verdict)


def encode_page_token(last: SessionSummary, verdict: str | None) -> str:
    document = {"t": last.last_seen, "s": last.session_id, "v": verdict or ""}
    return base64.urlsafe_b64encode(json.dumps(document, separators=(",", ":")).encode()).decode()


def decode_page_token(token: str, verdict: str | None) -> tuple[float, str]:
    try:
        document = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
        last_seen, session_id, asked = document["t"], document["s"], document["v"]
    except (ValueError, UnicodeError, binascii.Error, KeyError, TypeError):
        raise ValueError("not a page token of this API") from None
    if not isinstance(last_seen, int | float) or not isinstance(session_id, str) or asked != (verdict or ""):
        raise ValueError("the token belongs to a listing with another verdict, or is damaged")
    return float(last_seen), session_id
