"""Snapshots of one session's state: bytes a store can keep, from which a checker holds
the session again exactly as it was (``Checker.snapshot`` and ``Checker.restore``).

The format, version 2 (all integers big-endian)::

    b"DSSN"  u16 version
    u32 length, document      orjson: the memory (rules/snapshot_memory.py) and
                              {"session": id, "settings": {"max_actions": n, "rules": digest}}
    u32 length, column  x 3   per remembered action: its shape's index, its outcome,
                              its position (:func:`_column`)
    u32 CRC-32 of everything before it

Restored, a session holds what it held: fed the same records, it finds the same. The
one thing a snapshot cannot carry is the restoring checker's symbol table: where that
table is full (16,777,214 kinds, statuses and files), an action the session held packed
is held as what it recalled of it, as a checker keeps any action it cannot pack.

Nothing in it is evaluated: JSON, integers and texts only. Bump :data:`FORMAT_VERSION`
with any change to what is written, or to what a session's state means (a field of
``SessionState`` added or read otherwise, the packed flags): a snapshot of another
version is refused, and the caller rebuilds the session as it did before snapshots.
Version 2 is written as version 1 was, but an action's attempt numbers mean more: they
hold its first attempt when a record without ``attempts`` was it, where version 1 kept
the numbers written down only (``{2}`` for an action seen at an unwritten first attempt
and at attempt 2, which version 2 keeps as ``{1, 2}``); read as version 2, such a
session would take a repeated attempt 1 for a new one.

A snapshot is refused too when it was taken by other code (:data:`ENGINE`: another
release, or any edit of the engine or the rules), or under settings that change what the
state holds: ``max_actions_per_session`` (what was forgotten), and the selected rules (the
rules that keep state of their own, such as ``retry-not-escalated``'s exhausted
retries, keep none when not selected: any difference in the selected ids refuses it,
rather than a list of those rules to keep in step). ``key_window_s`` does not: the
first use of each key is kept whatever the window, which is applied when a key is sent
again, so a restored session judges by the restoring checker's window, as the same
session re-fed to it would. ``max_sessions`` is no part of a session's state.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import struct
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from durable_sessions.rules.base import Rule
from durable_sessions.rules.exact_json import NotJson
from durable_sessions.rules.snapshot_memory import Columns, Malformed, memory_from, memory_of
from durable_sessions.rules.state import SessionState, Symbols

FORMAT_VERSION = 2
MAGIC = b"DSSN"
_PREAMBLE = struct.Struct(">4sH")
_LENGTH = struct.Struct(">I")
_CHECKSUM = struct.Struct(">I")
_COLUMNS = 3
_WIDTHS = {array.array(code).itemsize: code for code in "QLIHB"}
"""Array type codes by item size: an integer column is stored in the narrowest that fits."""
_DECIMAL = 0
"""A column's width byte for integers no array holds (negative, or beyond 64 bits)."""


class Refused(ValueError):
    """A snapshot this checker does not restore, and why (the message)."""


def _engine_digest() -> str:
    """A digest of the code that decides what a session's state holds and means: the
    engine and the rules, as installed. A rule whose memory changes between two releases
    could otherwise misread the other's snapshots with no change to the format; so
    another release, or any edit of that code, refuses the snapshots of this one (a
    store's sessions are then re-fed once). Where a source cannot be read (a build
    without them), its name stands in for it, with the package's version."""
    from durable_sessions import __version__

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted([*here.glob("*.py"), here.parent / "engine.py"]):
        digest.update(path.name.encode())
        with contextlib.suppress(OSError):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


ENGINE = _engine_digest()


@dataclass(frozen=True, slots=True)
class Settings:
    """What a snapshot's checker and the restoring one must agree on (see the module's
    docstring for why these and no others)."""

    max_actions: int
    rules: str
    """A digest of the selected rule ids (in any order)."""
    engine: str
    """:data:`ENGINE` of the checker's code."""

    @classmethod
    def of(cls, max_actions: int, rules: Iterable[Rule]) -> Settings:
        ids = "\n".join(sorted(rule.id for rule in rules))
        return cls(max_actions, hashlib.sha256(ids.encode()).hexdigest()[:16], ENGINE)

    def as_json(self) -> dict[str, Any]:
        return {"max_actions": self.max_actions, "rules": self.rules, "engine": self.engine}


def encode(session: SessionState, settings: Settings) -> bytes | None:
    """``session``'s state as a snapshot; None when it holds a record value that is not
    JSON (only records given by Python code hold one): no snapshot carries it exactly.
    Reads the session only."""
    try:
        document, columns = memory_of(session)
        document.update(session=session.session_id, settings=settings.as_json())
        parts = [orjson.dumps(document), *map(_column, columns)]
    except (NotJson, orjson.JSONEncodeError):
        return None
    body = b"".join([_PREAMBLE.pack(MAGIC, FORMAT_VERSION), *(_LENGTH.pack(len(p)) + p for p in parts)])
    return body + _CHECKSUM.pack(zlib.crc32(body))


def decode(
    data: Any, *, session_id: str, settings: Settings, symbols: Symbols, key_window_s: float
) -> SessionState:
    """The session ``data`` is a snapshot of, with the restoring checker's ``symbols`` and
    ``key_window_s``. Raises :class:`Refused` for data of another format version, of
    other settings or of another session, and for anything else :func:`encode` did not
    write (truncated, altered, not bytes at all); never anything else for bad data."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise Refused(f"snapshot: a {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) < _PREAMBLE.size + _CHECKSUM.size or data[:4] != MAGIC:
        raise Refused("snapshot: not a session snapshot (no DSSN magic)")
    (_, version) = _PREAMBLE.unpack_from(data)
    if version != FORMAT_VERSION:
        raise Refused(f"snapshot: format version {version}, this checker reads {FORMAT_VERSION}")
    body, (checksum,) = data[: -_CHECKSUM.size], _CHECKSUM.unpack(data[-_CHECKSUM.size :])
    if zlib.crc32(body) != checksum:
        raise Refused("snapshot: checksum mismatch (truncated or altered)")
    try:
        return _session_from(_frames(body, _PREAMBLE.size), session_id, settings, symbols, key_window_s)
    except Refused:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as error:
        raise Refused(f"snapshot: malformed ({error})") from error


def _session_from(
    parts: list[bytes], session_id: str, settings: Settings, symbols: Symbols, key_window_s: float
) -> SessionState:
    document = orjson.loads(parts[0])
    if type(document) is not dict:
        raise Malformed("snapshot: the document is not an object")
    if document.pop("settings", None) != settings.as_json():
        raise Refused(
            "snapshot: taken by other code, or with other max_actions_per_session or rules selected"
        )
    if document.pop("session", None) != session_id:
        raise Refused(f"snapshot: of another session than {session_id!r}")
    session = SessionState(
        session_id, key_window_s=key_window_s, max_actions=settings.max_actions, symbols=symbols
    )
    columns: Columns = (_read_column(parts[1]), _read_column(parts[2]), _read_column(parts[3]))
    memory_from(document, columns, session)
    return session


def _frames(body: bytes, start: int) -> list[bytes]:
    """The document and the columns: length-prefixed, filling ``body`` exactly."""
    parts, at = [], start
    for _ in range(1 + _COLUMNS):
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if at + length > len(body):
            raise Malformed("snapshot: a part runs past the end")
        parts.append(body[at : at + length])
        at += length
    if at != len(body):
        raise Malformed("snapshot: bytes after the last part")
    return parts


def _column(numbers: list[int]) -> bytes:
    """Integers as a width byte and the little-endian array of that width that holds
    them all, or, when none does, width 0 and their decimal texts in a JSON list."""
    if not numbers or min(numbers) >= 0:
        top = max(numbers, default=0)
        for width in sorted(_WIDTHS):
            if top < 1 << 8 * width:
                column = array.array(_WIDTHS[width], numbers)
                if sys.byteorder == "big":
                    column.byteswap()
                return bytes([width]) + column.tobytes()
    return bytes([_DECIMAL]) + orjson.dumps([str(number) for number in numbers])


def _read_column(part: bytes) -> list[int]:
    if not part:
        raise Malformed("snapshot: an empty column")
    width, data = part[0], part[1:]
    if width == _DECIMAL:
        texts = orjson.loads(data)
        if type(texts) is not list or not all(type(text) is str for text in texts):
            raise Malformed("snapshot: a decimal column is not a list of texts")
        return [int(text) for text in texts]
    if width not in _WIDTHS or len(data) % width:
        raise Malformed(f"snapshot: a column of width {width} and {len(data)} bytes")
    column = array.array(_WIDTHS[width])
    column.frombytes(data)
    if sys.byteorder == "big":
        column.byteswap()
    return column.tolist()
