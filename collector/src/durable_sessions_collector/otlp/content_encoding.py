"""Request bodies' ``Content-Encoding`` on the OTLP/HTTP receiver: gzip, zstd, deflate,
zlib, snappy, x-snappy-framed and lz4, every coding the OpenTelemetry Collector's ``otlphttp`` exporter
sends (its ``compression`` setting), and the ones the SDKs send.

The Collector's "snappy" has been the snappy framing format or a bare snappy block,
depending on its version and a feature gate (collector#10584, #12911): a body that starts
with the framing format's stream identifier is read as frames, any other as one block.
Its "x-snappy-framed" (since v0.125, the same feature gate) is the framing format alone.
Its "lz4" is the LZ4 frame format.

Each decoder stops at ``limit`` decoded bytes, so a small body that would inflate to
gigabytes (a "bomb") costs at most ``limit`` bytes of memory, and raises:
:class:`TooLarge` past the limit, :class:`~.decode.BadData` for data that is not valid in
its coding or ends early. Several gzip members or zstd frames one after the other are one
body, as RFC 9112 and the zstd format say.

A body is walked by position, and fed to its decoder in pieces that start small and
double: what a decoder hands back after the end of a member or frame (its
``unused_data``) is then at most one piece, not a copy of the rest of the body, which
made a body of many small members cost time in the square of its length (1.6 MB of
empty zstd frames took 17 s of CPU, 16 MB would have taken half an hour).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import cramjam
import lz4.frame
import zstandard

from durable_sessions_collector.otlp.decode import BadData

ZSTD_MAX_WINDOW = 8 * 1024 * 1024
"""Largest zstd window a body may ask for (its decoder's memory): the Collector's encoder
uses at most 8 MiB; a frame asking more is refused, not allocated."""

# A zstd RLE block is 4 bytes and decodes to 128 KiB: no input inflates more than this.
_ZSTD_MAX_RATIO = 32 * 1024
_ZSTD_MIN_STEP = 64

_FIRST_PIECE = 256
_MAX_PIECE = 1024 * 1024
"""The input fed to a decoder at once: the first piece of each member or frame, doubled
for each next one up to the last. A member's leftover input is at most one piece."""


class TooLarge(Exception):
    pass


def _too_large(limit: int, coding: str) -> TooLarge:
    return TooLarge(f"request body is over the {limit}-byte limit after {coding} decompression")


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decoded per ``encoding`` (a coding :func:`coding_of` gives: one of
    :data:`ENCODINGS`, or ``""``/``identity`` for none), never more than ``limit`` bytes."""
    if encoding in ("", "identity"):
        return body
    return DECODERS[encoding](body, limit)


def coding_of(header: str) -> str | None:
    """The coding a ``Content-Encoding`` header names, lower-cased, for :func:`decompress`:
    ``""`` for none; None when it names one this module does not decode, or several (a
    body coded twice is not decoded). ``identity``, no coding at all (RFC 9110 section
    18.6), is left out of the list, as are its empty elements (section 5.6.1)."""
    listed = (coding.strip() for coding in header.lower().split(","))
    codings = [coding for coding in listed if coding not in ("", "identity")]
    if not codings:
        return ""
    return codings[0] if len(codings) == 1 and codings[0] in DECODERS else None


class _Member:
    """The decoder of one gzip member, zstd frame or LZ4 frame, fed the body in pieces
    from where the member starts (see :func:`_members`). ``_decoder`` is the coding's
    own (zlib's, zstandard's, lz4's): each says ``eof`` and keeps the ``unused_data``
    fed after the member's end."""

    _decoder: Any

    @property
    def eof(self) -> bool:
        """Whether the member's end has been fed."""
        return bool(self._decoder.eof)

    def piece(self, step: int, room: int) -> int:
        """How much of the body to feed next: ``step``, or less where the decoder cannot
        be told how much to produce and a step could decode past ``room`` bytes."""
        return step

    def feed(self, data: memoryview, room: int) -> bytes:
        """The output of ``data``: all of it, or when that is over ``room`` bytes, more
        than ``room`` (the caller stops there)."""
        raise NotImplementedError

    def unused(self) -> int:
        """How many of the bytes fed come after the member's end."""
        return len(self._decoder.unused_data or b"")


def _members(
    body: bytes,
    limit: int,
    coding: str,
    member: Callable[[], _Member],
    errors: tuple[type[Exception], ...],
    *,
    first_only: bool = False,
) -> bytes:
    """``body`` as members one after the other, each decoded by a new ``member()`` (with
    ``first_only``, the first alone: what follows it is ignored); at most ``limit`` bytes.
    Raise :class:`TooLarge` past the limit, :class:`BadData` for a body that ends inside
    a member or that ``member`` raises one of ``errors`` for."""
    out = bytearray()
    view, at = memoryview(body), 0
    try:
        while at < len(view):
            decoder = member()
            step = _FIRST_PIECE
            while not decoder.eof:
                if at >= len(view):
                    raise BadData(f"request body is a truncated {coding} stream")
                data = view[at : at + decoder.piece(step, limit - len(out))]
                at, step = at + len(data), min(2 * step, _MAX_PIECE)
                out += decoder.feed(data, limit - len(out))
                if len(out) > limit:
                    raise _too_large(limit, coding)
            at -= decoder.unused()  # the next member starts there
            if first_only:
                break
    except errors as error:
        raise BadData(f"request body is not valid {coding} data: {error}") from None
    return bytes(out)


class _ZlibMember(_Member):
    """A gzip member, or a zlib or deflate stream."""

    def __init__(self, wbits: int) -> None:
        self._decoder = zlib.decompressobj(wbits)

    def feed(self, data: memoryview, room: int) -> bytes:
        out = self._decoder.decompress(data, room + 1)
        # Output held back by max_length: take it, up to the limit.
        while self._decoder.unconsumed_tail and len(out) <= room:
            out += self._decoder.decompress(self._decoder.unconsumed_tail, room + 1 - len(out))
        return out


def _zlib_stream(name: str, wbits: int) -> Callable[[bytes, int], bytes]:
    def decode(body: bytes, limit: int) -> bytes:
        bits = wbits
        if name == "deflate" and body[:1] and (body[0] & 0x0F) != 8:
            bits = -zlib.MAX_WBITS  # raw deflate, as some clients send it
        # One zlib or deflate stream: what follows it is ignored.
        return _members(
            body, limit, name, lambda: _ZlibMember(bits), (zlib.error,), first_only=name != "gzip"
        )

    return decode


class _ZstdFrame(_Member):
    """A zstd frame. zstandard's decompressobj cannot be told how much to produce, so the
    input is fed in pieces small enough that one cannot decode past the room left."""

    def __init__(self, decompressor: zstandard.ZstdDecompressor) -> None:
        self._decoder = decompressor.decompressobj()

    def piece(self, step: int, room: int) -> int:
        return min(step, max(_ZSTD_MIN_STEP, (room + 1) // _ZSTD_MAX_RATIO))

    def feed(self, data: memoryview, room: int) -> bytes:
        out: bytes = self._decoder.decompress(data)
        return out


def _zstd(body: bytes, limit: int) -> bytes:
    decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    return _members(body, limit, "zstd", lambda: _ZstdFrame(decompressor), (zstandard.ZstdError,))


SNAPPY_STREAM_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
SNAPPY_MAX_CHUNK = 65536
"""Most bytes one chunk of the snappy framing format decodes to (the format's own bound)."""


def _snappy(body: bytes, limit: int) -> bytes:
    if body.startswith(SNAPPY_STREAM_IDENTIFIER):
        return _snappy_frames(body, limit)
    if _snappy_length(body) > limit:  # a block says its decoded length first
        raise _too_large(limit, "snappy")
    try:
        return bytes(cramjam.snappy.decompress_raw(body))
    except cramjam.DecompressionError as error:
        raise BadData(f"request body is not valid snappy data: {error}") from None


def _snappy_framed(body: bytes, limit: int) -> bytes:
    """``x-snappy-framed``: the framing format only, as the Collector reads it (its
    reader refuses a stream that does not start with the stream identifier)."""
    if body and not body.startswith(SNAPPY_STREAM_IDENTIFIER):
        raise BadData(
            "request body is not the snappy framing format (x-snappy-framed): it does not start "
            "with the stream identifier; send a bare snappy block as Content-Encoding: snappy"
        )
    return _snappy_frames(body, limit)


def _snappy_frames(body: bytes, limit: int) -> bytes:
    """The framing format, a chunk at a time (each decodes to at most 64 KiB), its CRCs
    checked; stream identifiers again (streams one after the other) and skippable chunks
    pass."""
    out = bytearray()
    at = 0
    while at < len(body):
        kind, end = body[at], at + 4 + int.from_bytes(body[at + 1 : at + 4], "little")
        if at + 4 > len(body) or end > len(body):
            raise BadData("request body is a truncated snappy stream")
        chunk = body[at:end]
        if kind in (0x00, 0x01):  # compressed, uncompressed
            if kind == 0x00 and _snappy_length(chunk[8:]) > SNAPPY_MAX_CHUNK:
                raise BadData("request body is not valid snappy data: a chunk over 64 KiB")
            try:
                out += cramjam.snappy.decompress(SNAPPY_STREAM_IDENTIFIER + chunk)
            except cramjam.DecompressionError as error:
                raise BadData(f"request body is not valid snappy data: {error}") from None
            if len(out) > limit:
                raise _too_large(limit, "snappy")
        elif kind < 0x80 or (kind == 0xFF and chunk != SNAPPY_STREAM_IDENTIFIER):  # reserved, unskippable
            raise BadData(f"request body is not valid snappy data: chunk type {kind:#04x}")
        at = end  # 0x80-0xfe: skippable chunks and padding
    return bytes(out)


def _snappy_length(block: bytes) -> int:
    """The decoded length a snappy block starts with (a little-endian base-128 varint)."""
    length = 0
    for shift, byte in zip(range(0, 35, 7), block, strict=False):
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return length
    raise BadData("request body is not valid snappy data: no length")


_LZ4_MAGIC = b"\x04\x22\x4d\x18"


def _lz4_content_size(header: memoryview) -> int | None:
    """The decoded size an LZ4 frame's header declares (its FLG byte's bit 3 says whether
    it does), or None."""
    if header[:4] != _LZ4_MAGIC or len(header) < 14 or not header[4] & 0x08:
        return None
    return int.from_bytes(header[6:14], "little")


class _Lz4Frame(_Member):
    """An LZ4 frame, its output asked for in buffers of the frame's size.

    lz4 allocates each call's ``max_length`` whole: asked for a mebibyte each time, a
    body of many small frames cost one allocation of a mebibyte per frame. A call asks
    for what the frame's header declares it decodes to (lz4 checks the output against
    that), or, without one, for a piece that doubles while the frame fills it; never
    more than a piece, nor more than the room left (which keeps the limit exact)."""

    def __init__(self) -> None:
        self._decoder = lz4.frame.LZ4FrameDecompressor()
        self._size = 0

    def feed(self, data: memoryview, room: int) -> bytes:
        if not self._size:  # the frame's first piece: its header
            self._size = _lz4_content_size(data) or _FIRST_PIECE
        out = self._output(data, room + 1)
        # Output held back by max_length: take it, up to the limit.
        while len(out) <= room and not self._decoder.eof and not self._decoder.needs_input:
            out += self._output(b"", room + 1 - len(out))
        return out

    def _output(self, data: memoryview | bytes, most: int) -> bytes:
        asked = min(most, self._size, _MAX_PIECE)
        out: bytes = self._decoder.decompress(data, max_length=asked)
        if len(out) == asked:  # filled: ask for twice as much next
            self._size *= 2
        return out


def _lz4(body: bytes, limit: int) -> bytes:
    # What lz4.frame raises for data that is not a frame: RuntimeError.
    return _members(body, limit, "lz4", _Lz4Frame, (RuntimeError,))


DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "x-gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "zstd": _zstd,
    "deflate": _zlib_stream("deflate", zlib.MAX_WBITS),
    "zlib": _zlib_stream("zlib", zlib.MAX_WBITS),
    "snappy": _snappy,
    "x-snappy-framed": _snappy_framed,
    "lz4": _lz4,
}
ENCODINGS = ("gzip", "zstd", "deflate", "zlib", "snappy", "x-snappy-framed", "lz4")
"""The codings to name to a client (``x-gzip`` is gzip's old name)."""
