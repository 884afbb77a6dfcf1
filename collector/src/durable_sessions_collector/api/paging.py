"""Keyset paging, one scheme for the HTTP and the gRPC API: of the session list, and of a
session's actions and violations.

A page of the list is the sessions most recently active first (:data:`BY_ACTIVITY`), or
in the order of their ids (:data:`BY_ID`); its ``next_page_token`` (empty on the last
page) is opaque to clients and holds the position after the page's last session (its
``last_seen`` and id, or its id) and the verdict asked, so that a token is refused with
another verdict or the other order. By activity, a session that becomes active again
between two pages moves to the front: one walk through the pages may miss it, or list it
twice. By id, a walk lists every session that exists throughout it once (with a verdict:
unless its verdict changes meanwhile); ``sessions list --all`` walks so.

A session's detail has a page of its actions, in the session's order, and a page of its
violations, in the order they were found, each of at most ``MAX_DETAIL_PAGE`` (fewer
when they are large: :data:`~durable_sessions_collector.store.base.MAX_PAGE_BYTES`); each is
walked with its own token (``next_actions_page_token``, ``next_violations_page_token``),
which holds the position after the page's last item and a digest of the session's id
(the id itself may be kilobytes long, and is in the request already). Actions that
arrive meanwhile with an earlier start time are not shown to a walk already past them.

Every token also names the store it is a position in (its id,
:data:`~durable_sessions_collector.store.base.STORE_ID`), and a token of another store is
refused, naming it. Sidecars of their own stores behind one address (a Deployment's pods,
each with its SQLite file) read a walk's token from the other store as a position of
their own and went on from there: their sessions before that position were never
listed, and an action or violation id of one store is none of the other's. Replicas
sharing a PostgreSQL store share its id, so a walk goes on through any of them. A token
that names no store (an earlier sidecar's) is read as before.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

from durable_sessions_collector.store import Store
from durable_sessions_collector.store.base import (
    DEFAULT_DETAIL_PAGE,
    MAX_DETAIL_PAGE,
    ActionPosition,
    DetailPages,
    SessionDetail,
    SessionSummary,
    split_page,
    text_bytes,
)
from durable_sessions_collector.store.stored import stored_text

DEFAULT_PAGE = 100
MAX_PAGE = 1000
StoreId = Callable[[], str | None]
"""Reads the id of the store a token is a position in (:meth:`~durable_sessions_collector.store.Store.store_id`)."""
BY_ACTIVITY = "last_seen"
"""The list's order by default: most recently active first."""
BY_ID = "session_id"
"""The list's order by session id: a walk that sessions' activity does not move."""
ORDERS = (BY_ACTIVITY, BY_ID)


def list_page(
    store: Store, verdict: str | None, size: int, page_token: str = "", order: str = BY_ACTIVITY
) -> tuple[list[SessionSummary], str]:
    """One page of at most ``size`` sessions in ``order`` (one of :data:`ORDERS`) and the
    token of the next one (empty: none).

    Raises ValueError for a ``page_token`` this API did not give for ``verdict`` and
    ``order``, and :class:`~durable_sessions_collector.store.StoreError` when the store
    cannot be read.
    """
    store_id = functools.cache(store.store_id)  # read once, and only for a token
    if page_token:
        _check_store(page_token, store_id)
    if order == BY_ID:
        after_id = decode_id_page_token(page_token, verdict) if page_token else None
        found = store.list_sessions_by_id(verdict, size + 1, after_id)  # type: ignore[arg-type]
        encode = encode_id_page_token
    else:
        after = decode_page_token(page_token, verdict) if page_token else None
        found = store.list_sessions(verdict, size + 1, after)  # type: ignore[arg-type]
        encode = encode_page_token
    # One more than asked tells whether there is a next page.
    sessions, more = split_page(found, size, lambda summary: text_bytes(summary.session_id))
    return sessions, (encode(sessions[-1], verdict, store_id) if more else "")


def encode_page_token(last: SessionSummary, verdict: str | None, store_id: StoreId) -> str:
    return _encode({"t": last.last_seen, "s": last.session_id, "v": verdict or ""}, store_id)


def decode_page_token(token: str, verdict: str | None) -> tuple[float, str]:
    document = _decode(token)
    last_seen, session_id, asked = _finite(document.get("t")), _session_id(document), document.get("v")
    if last_seen is None or session_id is None or asked != (verdict or ""):
        raise ValueError("the token belongs to a listing with another verdict or order, or is damaged")
    return last_seen, session_id


def encode_id_page_token(last: SessionSummary, verdict: str | None, store_id: StoreId) -> str:
    return _encode({"o": BY_ID, "s": last.session_id, "v": verdict or ""}, store_id)


def decode_id_page_token(token: str, verdict: str | None) -> str:
    document = _decode(token)
    session_id = _session_id(document)
    if document.get("o") != BY_ID or session_id is None or document.get("v") != (verdict or ""):
        raise ValueError("the token belongs to a listing with another verdict or order, or is damaged")
    return session_id


def _session_id(document: dict[str, Any]) -> str | None:
    """The token's session id, or None when it holds none a store can compare with: not a
    string, or one with a lone surrogate (JSON's ``"\ud800"``), which no stored id holds and
    the stores cannot encode (the codec's error was answered as the token's fault)."""
    session_id = document.get("s")
    if not isinstance(session_id, str):
        return None
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return session_id


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (a bool, NaN, or an integer past a float's range)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def session_page(
    store: Store,
    session_id: str,
    *,
    actions_size: int = DEFAULT_DETAIL_PAGE,
    actions_token: str = "",
    violations_size: int = DEFAULT_DETAIL_PAGE,
    violations_token: str = "",
) -> tuple[SessionDetail | None, str, str]:
    """The session (None: no such session) with a page of at most ``actions_size`` of its
    actions and one of at most ``violations_size`` of its violations, each from its token
    on (empty: the first page), and the tokens of the next pages (empty: none).

    Raises ValueError, naming the token, for one this API did not give for this session;
    StoreError when the store cannot be read.
    """
    pages = DetailPages(
        min(actions_size, MAX_DETAIL_PAGE),
        _position(actions_token, session_id, "actions_page_token", _action_position),
        min(violations_size, MAX_DETAIL_PAGE),
        _position(violations_token, session_id, "violations_page_token", _violation_position),
    )
    store_id = functools.cache(store.store_id)  # read once, and only for a token
    for name, token in (("actions_page_token", actions_token), ("violations_page_token", violations_token)):
        if token:
            try:
                _check_store(token, store_id)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
    # A long id is stored as its digest; a session stored before that (by an older
    # sidecar) keeps its own id, so it is looked up by that too.
    stored_id = stored_text(session_id)
    detail = store.get_session(stored_id, pages)
    if detail is None and stored_id != session_id:
        detail = store.get_session(session_id, pages)
    if detail is None:
        return None, "", ""
    session = _session_digest(session_id)
    actions = (
        ""
        if detail.next_actions is None
        else _encode({"s": session, "a": list(detail.next_actions)}, store_id)
    )
    violations = (
        ""
        if detail.next_violations is None
        else _encode({"s": session, "v": detail.next_violations}, store_id)
    )
    return detail, actions, violations


def _session_digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _position(token: str, session_id: str, name: str, read: Callable[[dict[str, Any]], Any]) -> Any:
    if not token:
        return None
    try:
        document = _decode(token)
        position = read(document)
        if document.get("s") != _session_digest(session_id) or position is None:
            raise ValueError("the token belongs to another session, or is damaged")
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    return position


def _action_position(document: dict[str, Any]) -> ActionPosition | None:
    position = document.get("a")
    if isinstance(position, list) and len(position) == 2 and all(_int64(n) for n in position):
        return position[0], position[1]
    return None


def _violation_position(document: dict[str, Any]) -> int | None:
    position = document.get("v")
    return position if _int64(position) else None


def _int64(value: Any) -> bool:
    return type(value) is int and -(2**63) <= value < 2**63


def _encode(document: dict[str, Any], store_id: StoreId) -> str:
    """The token of ``document``, naming its store (``store_id()``) when that has an id."""
    named = document if store_id() is None else {**document, _STORE: store_id()}
    return base64.urlsafe_b64encode(json.dumps(named, separators=(",", ":")).encode()).decode()


_STORE = "d"
"""The key of a token's store id."""


def _check_store(token: str, store_id: StoreId) -> None:
    """Raise ValueError when ``token`` is none of this API's, or names a store other than
    the one of ``store_id()`` (one that names none, an earlier sidecar's, passes)."""
    document = _decode(token)
    if _STORE in document and document[_STORE] != store_id():
        raise ValueError(
            "the token is of another store, whose positions are not this one's; start again from the first page"
        )


def _decode(token: str) -> dict[str, Any]:
    """The token's document. Its length is bounded by what carries it (the HTTP port's
    request line, the gRPC port's request size), not here: a list token holds the last
    session's id, and a page of sessions of 60 kB ids must lead to the next one."""
    try:
        document = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, UnicodeError, binascii.Error, RecursionError):  # RecursionError: "[[[[…"
        raise ValueError("not a page token of this API") from None
    if not isinstance(document, dict):
        raise ValueError("not a page token of this API")
    return document
