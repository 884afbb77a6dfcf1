"""The C marking of OTLP/JSON strings that are not UTF-8 text
(``durable_sessions._native.mark_bad_strings``) against its reference,
``bad_text.reference_mark_bad_strings``: for any body, the same marked body and the same
details, in the same words. ``bad_text.marked`` takes the C path wherever it was built."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from durable_sessions import bad_text
from durable_sessions.bad_text import reference_mark_bad_strings
from tests.support.senders import require_native

QUOTED_MARK = b'"' + bad_text._MARKS[0].encode()

DIFFERENTIAL = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "500")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def _native_built() -> None:
    require_native("_native")


def c_marked(body: bytes) -> tuple[bytes, list[str]] | None:
    from durable_sessions import _native  # type: ignore[attr-defined]

    return _native.mark_bad_strings(body, QUOTED_MARK)  # type: ignore[no-any-return]


def agrees(body: bytes) -> tuple[bytes, list[str]] | None:
    """The C answer for ``body``, having checked it equals the reference's."""
    expected = reference_mark_bad_strings(body, QUOTED_MARK)
    found = c_marked(body)
    assert found == expected
    return found


# -- generated bodies -------------------------------------------------------------------

HEX = "0123456789abcdefABCDEF"
SURROGATE_ESCAPES = st.builds(
    lambda lead, rest, digits: f"\\u{lead}{rest}{digits}".encode(),
    st.sampled_from("dD"),
    st.sampled_from("89abcdefABCDEF"),
    st.text(HEX, min_size=2, max_size=2),
)
ESCAPES = st.one_of(
    st.sampled_from([b'\\"', b"\\\\", b"\\/", b"\\b", b"\\f", b"\\n", b"\\r", b"\\t"]),
    SURROGATE_ESCAPES,
    st.builds(lambda digits: f"\\u{digits}".encode(), st.text(HEX, min_size=4, max_size=4)),
    st.sampled_from([b"\\ud83d\\ude00", b"\\uD800\\uDC00", b"\\udbff\\udfff", b"\\ud800\\ud800\\udc00"]),
    # refused by json.loads: bad escapes, short or bad \u digits, an escaped byte past ASCII
    st.sampled_from([b"\\x", b"\\u12", b"\\u", b"\\uZZZZ", b"\\ud800\\uZZZZ", b"\\ud800\\u12", b"\\U0041"]),
    st.sampled_from([b"\\\xc3\xa9", b"\\\xff", b"\\\x00", b"\\\\u", b"\\\\ud800"]),
)
NOT_UTF8 = st.one_of(
    st.binary(min_size=1, max_size=4).filter(lambda raw: not _is_utf8(raw)),
    st.sampled_from(
        [
            *(
                b"\x80",
                b"\xbf",
                b"\xc0\x80",
                b"\xc1\xbf",
                b"\xe0\x80\x80",
                b"\xe0\x9f\xbf",
                b"\xf0\x80\x80\x80",
            ),
            *(
                b"\xf0\x8f\xbf\xbf",
                b"\xed\xa0\x80",
                b"\xed\xbf\xbf",
                b"\xf4\x90\x80\x80",
                b"\xf5\x80\x80\x80",
            ),
            *(b"\xff", b"\xfe", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc"),
        ]
    ),
)
CONTENT = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=8).map(
        str.encode
    ),
    st.text(st.characters(min_codepoint=0x80, exclude_categories=["Cs"]), min_size=1, max_size=4).map(
        str.encode
    ),
    ESCAPES,
    NOT_UTF8,
    st.binary(max_size=1).map(lambda raw: bytes([raw[0] % 0x20]) if raw else b"\x7f"),  # control characters
)
STRINGS = st.lists(CONTENT, max_size=6).map(lambda parts: b'"' + b"".join(parts) + b'"')
STRUCTURE = st.sampled_from([b"{", b"}", b"[", b"]", b":", b",", b" ", b"\n", b"1", b"null", b"\xff", b"\\"])
BODIES = st.builds(
    lambda parts, tail: b"".join(parts) + tail,
    st.lists(STRINGS | STRUCTURE, max_size=30),
    # an unterminated last string, or one whose closing quote is escaped
    st.sampled_from([b"", b'"', b'"\\'])
    | st.lists(CONTENT, max_size=3).map(lambda parts: b'"' + b"".join(parts)),
)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@DIFFERENTIAL
@example(b'["\xff\xfe","x","\\ud800"]')
@example(b'["\xff", "unterminated \xff')
@example(b'["\\ud800\\ud800\\udc00"]')
@example(b'["\xf4\x90\x80\x80", "\xed\xa0\x80", "\xe0\x9f\xbf"]')
@given(BODIES | st.binary(max_size=200))
def test_c_marks_what_the_reference_marks(body: bytes) -> None:
    """Any body, assembled from JSON strings of every kind (escapes, surrogate escapes
    paired and lone, bad escapes, control characters, bytes that are not UTF-8) and other
    JSON text, or any bytes: the C marks are the reference's, in the same words."""
    agrees(body)


# -- explicit cases -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("string", "detail"),
    [
        (b"\xff\xfe", "byte 0xff"),
        (b"ok\x80", "byte 0x80"),
        (b"\xc0\x80", "byte 0xc0"),  # an overlong NUL
        (b"\xe0\x80\x80", "byte 0xe0"),  # overlong
        (b"\xf0\x8f\xbf\xbf", "byte 0xf0"),  # overlong
        (b"\xed\xa0\x80", "byte 0xed"),  # an encoded surrogate
        (b"\xf4\x90\x80\x80", "byte 0xf4"),  # beyond U+10FFFF
        (b"\xf5\x80\x80\x80", "byte 0xf5"),
        (b"caf\xc3\xa9 \xe2\x82", "byte 0xe2"),  # cut short by the closing quote
        (b"\xe2\x82\xac\xf0\x9f\x98", "byte 0xf0"),  # valid text, then a cut sequence
        (b"\\\xff", "byte 0xff"),  # an escaped byte is still a byte
        (b"\\u0041\xff\\ud800", "byte 0xff"),  # bytes are looked at before escapes
        (b"\\ud800", "a lone surrogate escape \\ud800"),
        (b"\\uDC80", "a lone surrogate escape \\udc80"),  # lowercase hex
        (b"\\udc00\\ud800", "a lone surrogate escape \\udc00"),
        (b"\\ud800\\ud800\\udc00", "a lone surrogate escape \\ud800"),  # the second pairs
        (b"\\ud83d\\ude00 \\udfff", "a lone surrogate escape \\udfff"),
        (b"\\ud800\\n", "a lone surrogate escape \\ud800"),
        (b"\xe6\x97\xa5\\ud800", "a lone surrogate escape \\ud800"),
        (b"\\ud83d\\ude00", None),  # a pair
        (b"\\ud800\\udc00", None),  # the pairs at either end of the ranges
        (b"\\udbff\\udfff", None),
        (b"\\uD83D\\uDE00", None),
        (b"\\\\ud800", None),  # an escaped backslash: no escape
        (b"\\ud800\\uZZZZ", None),  # json.loads refuses it: orjson words it
        (b"\\ud800\\u12", None),
        (b"\\ud800\\x", None),
        (b"\\ud800\x01", None),  # a raw control character
        (b"\\ud800\\\xc3\xa9", None),  # an escaped byte past ASCII
        (b"\xe6\x97\xa5\xe6\x9c\xac", None),
        (b"", None),
    ],
)
def test_a_string_s_detail(string: bytes, detail: str | None) -> None:
    """Each kind of bad byte sequence and surrogate escape, by the byte or escape named."""
    body = b'{"a":"' + string + b'","b":"x"}'
    found = agrees(body)
    if detail is None:
        assert found is None
    else:
        assert found == (b'{"a":' + QUOTED_MARK + b'0","b":"x"}', [detail])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # an escaped quote does not end the string
        (b'["a\\"\xff", "b"]', (b"[" + QUOTED_MARK + b'0", "b"]', ["byte 0xff"])),
        # an unterminated last string ends the search: it is kept as it is
        (b'["\xff", "open \xff', (b"[" + QUOTED_MARK + b'0", "open \xff', ["byte 0xff"])),
        (b'["\xff", "open \\"]', (b"[" + QUOTED_MARK + b'0", "open \\"]', ["byte 0xff"])),
        (b'["\xff", "\\', (b"[" + QUOTED_MARK + b'0", "\\', ["byte 0xff"])),
        (b'["open \xff', None),
        # bytes outside strings are no string's
        (b'[\xff, "\\udfff"]', (b"[\xff, " + QUOTED_MARK + b'0"]', ["a lone surrogate escape \\udfff"])),
    ],
)
def test_the_strings_of_a_body(body: bytes, expected: tuple[bytes, list[str]] | None) -> None:
    assert agrees(body) == expected


def test_marks_are_numbered_and_details_kept_once() -> None:
    """Marks number the bad strings in order, past one digit; each detail's text is one
    object however many strings it is given for."""
    body = b"[" + b",".join([b'"\xff"', b'"\\ud800"', b'"ok"'] * 6) + b"]"
    found = agrees(body)
    assert found is not None
    marked_body, details = found
    assert marked_body.count(QUOTED_MARK) == 12
    assert QUOTED_MARK + b'11"' in marked_body
    assert details == ["byte 0xff", "a lone surrogate escape \\ud800"] * 6
    assert len({id(detail) for detail in details}) == 2


def bad_strings(count: int) -> bytes:
    """The body of the measurement that found the stall: ``count`` tiny bad strings."""
    return b'{"a":[' + b'"\xff\xfe",' * count + b'"x"]}'


def test_marked_takes_the_c_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body of a million small bad strings took the Python loop about 5.5 s (13.5 s for
    16 MiB), holding the GIL: the sidecar stalled. ``marked`` takes the C path, so the
    reference loop is never run (``benchmarks/bad_text.py`` measures the two)."""

    def refused(body: bytes, quoted_mark: bytes) -> None:
        raise AssertionError("marked() ran the Python loop where the C extension is built")

    monkeypatch.delenv("DURABLE_SESSIONS_NATIVE", raising=False)
    monkeypatch.setattr(bad_text, "reference_mark_bad_strings", refused)
    found = bad_text.marked(bad_strings(1_000_000))
    assert found is not None and len(found.details) == 1_000_000
    assert found.details[-1] == "byte 0xff"


def test_the_switch_selects_the_reference_for_the_same_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    body = bad_strings(1_000) + b'"\\udc80"'
    calls: list[bytes] = []

    def reference(body: bytes, quoted_mark: bytes) -> tuple[bytes, list[str]] | None:
        calls.append(body)
        return reference_mark_bad_strings(body, quoted_mark)

    monkeypatch.setattr(bad_text, "reference_mark_bad_strings", reference)
    monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", "false")
    by_reference = bad_text.marked(body)
    assert calls == [body]
    monkeypatch.delenv("DURABLE_SESSIONS_NATIVE")
    assert by_reference is not None and bad_text.marked(body) == by_reference
    assert calls == [body]
