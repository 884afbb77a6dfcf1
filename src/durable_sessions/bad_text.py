"""OTLP/JSON strings that are not UTF-8 text, found and marked so that the rest of the
body can still be read: the OTLP/JSON counterpart of the sidecar's protobuf text that is
not UTF-8 (``durable_sessions_collector.otlp.envelope``). The sidecar's OTLP/JSON
receiver and ``durable-sessions check``'s OTLP/JSON reader both use it, so that they
reject the same spans in the same words.

orjson refuses a whole body for one string holding bytes that are not UTF-8, or a lone
UTF-16 surrogate escape (``"\\udc80"``, which no UTF-8 text holds). So one span's bad
text made the whole request a 400, its valid spans with it, where protobuf rejects that
span alone. :func:`marked` is asked only once orjson has refused a body: it replaces each
such string of the body with a mark (a string that cannot be in the body otherwise) and
keeps why it is bad. orjson then reads the marked body, or refuses it for something
else, and the reader rejects the span (or the resource or scope) that holds a mark,
naming the field as :meth:`Marked.first` finds it.

The strings are marked in one pass in C (``durable_sessions._native.mark_bad_strings``)
where the extension was built: a body of millions of small bad strings (or of strings of
text that is not ASCII, each looked at) held the GIL for seconds a MiB in the Python loop,
which stalled the whole sidecar. :func:`reference_mark_bad_strings`, that loop, stays the
reference (same marks, same words; a differential test holds the C to it) and is what
``DURABLE_SESSIONS_NATIVE=false`` selects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

from durable_sessions.json_text import exact_integers
from durable_sessions.native import native_module


def not_utf8(where: str, detail: str | None = None) -> str:
    """Why a span (or a resource or scope) is rejected for the text at ``where``, in either
    encoding; ``detail``: what is wrong with it, where known."""
    return f"{where} is not valid UTF-8" if detail is None else f"{where} is not valid UTF-8 ({detail})"


_NEXT_STRING = re.compile(
    rb'(?:[^"]*+"[\x20\x21\x23-\x5b\x5d-\x7e]*+")*+[^"]*+("[^"\\]*+(?:\\.[^"\\]*+)*+")', re.DOTALL
)
"""The next JSON string, as written, that may not be UTF-8 text (group 1): the strings
before it, of printable ASCII without escapes, are passed over by the regular expression
itself, not one by one in Python. Outside strings valid JSON holds no quotation mark, so
the strings of a body are these from its start (where the body is not JSON for another
reason, orjson refuses the marked body as well).

Every quantifier is possessive: each run stops at a character it cannot hold, so giving
characters back finds no other match, only costs time. Backtracking made a 64 MiB line
ending in an unterminated string cost tens of seconds (the failing match gave back its
last run one byte at a time, then again with one string fewer). Where the printable
strings end in one that is unterminated, the match now fails at once; it gave back the
last printable string, which is never marked, then failed the same way from there: the
same marks either way."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
"""Where a lone surrogate escape may be: any ``\\uD800`` to ``\\uDFFF``, paired or not
(or after an escaped backslash, which is no escape: only looked at more closely)."""

_MARKS = [chr(code) for code in range(0xFDD0, 0xFDF0)]
"""Unicode noncharacters, one of which starts every mark: valid UTF-8 that no exporter
writes, and checked absent from the body, so no string of the body is taken for a mark."""


@dataclass(frozen=True, slots=True)
class Marked:
    """A body whose bad strings are marks (``mark`` and the string's number), and what
    is wrong with each of them, by number (``byte 0xc3``)."""

    body: bytes
    mark: str
    details: list[str]

    def holds(self, node: Any) -> bool:
        """Whether the JSON value ``node`` (as orjson read the marked body) holds a mark."""
        try:
            return self.mark.encode() in orjson.dumps(node)
        except orjson.JSONEncodeError:  # an integer beyond 64 bits: walk it
            return self.first(node, "") is not None

    def first(self, node: Any, path: str) -> str | None:
        """Why the first mark in ``node`` (at ``path``) is bad, naming where it is below
        ``path`` (``attributes[3].value.stringValue is not valid UTF-8 (byte 0xc3)``); None
        when ``node`` holds none. Walked without recursion: a value may nest deeply."""
        stack = [(node, path)]
        while stack:
            value, where = stack.pop()
            if isinstance(value, str):
                if detail := self._detail(value):
                    return not_utf8(where or "the string", detail)
            elif isinstance(value, dict):
                for key in value:
                    if detail := self._detail(key):
                        return not_utf8(f"a key of {where}" if where else "a key", detail)
                stack.extend(
                    (item, f"{where}.{_shown(key)}" if where else _shown(key))
                    for key, item in reversed(value.items())
                )
            elif isinstance(value, list):
                stack.extend((item, f"{where}[{index}]") for index, item in reversed(list(enumerate(value))))
        return None

    def _detail(self, text: str) -> str | None:
        if not text.startswith(self.mark):
            return None
        return self.details[int(text[len(self.mark) :])]


def _shown(key: str) -> str:
    """``key`` as a path names it: cut short, so that an error message stays short."""
    return key if len(key) <= _KEY_CHARS else key[:_KEY_CHARS] + "…"


_KEY_CHARS = 40


def marked(body: bytes) -> Marked | None:
    """``body`` with each string that is not UTF-8 text replaced by a mark, or None when it
    holds none (or every mark is in it already). The strings are marked in C
    (``durable_sessions._native.mark_bad_strings``) where the extension was built, else by
    :func:`reference_mark_bad_strings`: the same marks in the same words."""
    if not _may_hold_bad_text(body):  # most bodies orjson refuses: no string to pass over
        return None
    mark = absent_mark(body)
    if mark is None:
        return None
    native = native_module(warn=False)  # each front end warns of a bad switch itself
    mark_bad_strings = reference_mark_bad_strings if native is None else native.mark_bad_strings
    found = mark_bad_strings(body, b'"' + mark.encode())
    return None if found is None else Marked(found[0], mark, found[1])


def reference_mark_bad_strings(body: bytes, quoted_mark: bytes) -> tuple[bytes, list[str]] | None:
    """``body`` with each string that is not UTF-8 text replaced by ``quoted_mark`` (a
    quotation mark and the mark), its number and a quotation mark, and what is wrong with
    each by number (:func:`_not_text`); None when it holds none. The strings are those
    :data:`_NEXT_STRING` finds from the start; an unterminated one ends the search, and
    the rest of the body is kept as it is. The reference the C version must agree with."""
    details: list[str] = []
    # A body may hold millions of bad strings, each a turn of this loop: the marked body
    # grows in one buffer (a list of pieces held two objects a string, over a GB for a
    # line of 64 MiB), each detail's text is kept once, and a mark is formatted as orjson
    # writes the string (a noncharacter is written as it is).
    marked_body = bytearray()
    view = memoryview(body)
    texts: dict[str, str] = {}
    start = 0
    # Each match starts where the last ended (finditer would try again from every byte
    # after a failure: a body ending in a long unterminated string took quadratic time).
    while (string := _NEXT_STRING.match(body, start)) is not None:
        begin, end = string.span(1)
        detail = _not_text(body[begin:end])
        if detail is not None:
            marked_body += view[start:begin]
            marked_body += b'%s%d"' % (quoted_mark, len(details))
            details.append(texts.setdefault(detail, detail))
        else:
            marked_body += view[start:end]
        start = end
    if not details:
        return None
    marked_body += view[start:]
    return bytes(marked_body), details


def read(body: bytes) -> tuple[Any, Marked] | None:
    """The JSON document of ``body`` read with its strings that are not UTF-8 text marked
    (integers beyond 64 bits exact, as every reader reads them), and the marks; None when
    ``body`` holds no such string, or orjson refuses it for more than its text. Ask only
    once orjson has refused ``body`` itself."""
    found = marked(body)
    if found is None:
        return None
    try:
        return exact_integers(found.body, orjson.loads(found.body)), found
    except orjson.JSONDecodeError:
        return None


def _may_hold_bad_text(body: bytes) -> bool:
    """Whether ``body`` may hold a string that is not UTF-8 text: it is not all UTF-8, or
    it holds what may be a surrogate escape. Two passes in C over the body, where the
    regular expression costs hundreds of nanoseconds a byte: a line of 64 MiB refused for
    another reason (cut short, unterminated) is passed over in a fraction of a second."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return True
    return b"\\u" in body and _SURROGATE_ESCAPE.search(body) is not None


def absent_mark(body: bytes) -> str | None:
    """The first of :data:`_MARKS` that ``body`` holds neither as UTF-8 nor as an escape of
    either case, or None. The body is lowered once, and only when it holds an escape: a
    body of 64 MiB that held the first marks was copied once for each of them."""
    escapes = body.lower() if b"\\u" in body or b"\\U" in body else b""
    return next(
        (
            mark
            for mark in _MARKS
            if mark.encode() not in body and f"\\u{ord(mark):04x}".encode() not in escapes
        ),
        None,
    )


def _not_text(string: bytes) -> str | None:
    """What makes the JSON string ``string`` (as written) not UTF-8 text (its first byte
    that is not UTF-8, or its first lone surrogate escape), or None when it is (or is not
    a valid string, which orjson words)."""
    if string.isascii() and b"\\u" not in string:
        return None
    try:
        text = string.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"byte 0x{string[error.start]:02x}"
    try:
        value = json.loads(text)
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # before ValueError, which it is
        return f"a lone surrogate escape \\u{ord(value[error.start]):04x}"
    except ValueError:  # not a valid string
        return None
    return None
