"""Keyset paging, one scheme for the HTTP and the gRPC API: of the session list, and of a
session's actions.

A page of the list is the sessions most recently active first; its ``next_page_token`` (empty on the
last page) is opaque to clients and holds the position after the page's last session
(its ``last_seen`` and id) and the verdict asked, so that a token is refused with another
verdict. A session that becomes active again between two pages moves to the front: one
walk through the pages may miss it, or list it twice.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from durable_sessions_collector.store import Store
from durable_sessions_collector.store.base import (
    DEFAULT_ACTIONS_PAGE,
    MAX_ACTIONS_PAGE,
    ActionPosition,
    SessionDetail,
    SessionSummary,
)

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
    return _encode({"t": last.last_seen, "s": last.session_id, "v": verdict or ""})


def decode_page_token(token: str, verdict: str | None) -> tuple[float, str]:
    document = _decode(token)
    last_seen, session_id, asked = document.get("t"), document.get("s"), document.get("v")
    if not isinstance(last_seen, int | float) or not isinstance(session_id, str) or asked != (verdict or ""):
        raise ValueError("the token belongs to a listing with another verdict, or is damaged")
    return float(last_seen), session_id


def session_page(
    store: Store, session_id: str, size: int = DEFAULT_ACTIONS_PAGE, page_token: str = ""
) -> tuple[SessionDetail | None, str]:
    """The session with a page of at most ``size`` of its actions (None: no such session),
    and the token of the next page (empty: none). Raises ValueError for a ``page_token``
    this API did not give for this session, and StoreError."""
    after = decode_actions_token(page_token, session_id) if page_token else None
    detail = store.get_session(session_id, min(size, MAX_ACTIONS_PAGE), after)
    if detail is None or detail.next_actions is None:
        return detail, ""
    return detail, _encode({"s": session_id, "p": list(detail.next_actions)})


def decode_actions_token(token: str, session_id: str) -> ActionPosition:
    document = _decode(token)
    position = document.get("p")
    if (
        document.get("s") != session_id
        or not isinstance(position, list)
        or len(position) != 2
        or not all(type(number) is int and -(2**63) <= number < 2**63 for number in position)
    ):
        raise ValueError("the token belongs to another session's actions, or is damaged")
    return position[0], position[1]


def _encode(document: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(document, separators=(",", ":")).encode()).decode()


def _decode(token: str) -> dict[str, Any]:
    try:
        document = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, UnicodeError, binascii.Error):
        raise ValueError("not a page token of this API") from None
    if not isinstance(document, dict):
        raise ValueError("not a page token of this API")
    return document
