"""Request bodies' ``Content-Encoding`` on the OTLP/HTTP receiver: gzip, zstd, deflate,
zlib, snappy and lz4, every coding the OpenTelemetry Collector's ``otlphttp`` exporter
sends (its ``compression`` setting), and the ones the SDKs send.

The Collector's "snappy" has been the snappy framing format or a bare snappy block,
depending on its version and a feature gate (collector#10584, #12911): a body that starts
with the framing format's stream identifier is read as frames, any other as one block.
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
    """``body`` decoded per ``encoding`` (a lower-case ``Content-Encoding`` value, one of
    :data:`ENCODINGS` or ``""``/``identity``), never more than ``limit`` bytes."""
    if encoding in ("", "identity"):
        return body
    return DECODERS[encoding](body, limit)


def _zlib_stream(name: str, wbits: int) -> Callable[[bytes, int], bytes]:
    def decode(body: bytes, limit: int) -> bytes:
        bits = wbits
        if name == "deflate" and body[:1] and (body[0] & 0x0F) != 8:
            bits = -zlib.MAX_WBITS  # raw deflate, as some clients send it
        out = bytearray()
        view, at = memoryview(body), 0
        try:
            while at < len(view):
                decompressor = zlib.decompressobj(bits)
                step = _FIRST_PIECE
                while not decompressor.eof:
                    if at >= len(view):
                        raise BadData(f"request body is a truncated {name} stream")
                    data = view[at : at + step]
                    at, step = at + len(data), min(2 * step, _MAX_PIECE)
                    while data:  # output held back by max_length: take it, up to the limit
                        out += decompressor.decompress(data, limit + 1 - len(out))
                        if len(out) > limit:
                            raise _too_large(limit, name)
                        data = decompressor.unconsumed_tail
                at -= len(decompressor.unused_data)  # the next member starts there
                if name != "gzip":
                    break  # one stream: what follows it is ignored
        except zlib.error as error:
            raise BadData(f"request body is not valid {name} data: {error}") from None
        return bytes(out)

    return decode


def _zstd(body: bytes, limit: int) -> bytes:
    # zstandard's decompressobj cannot be told how much to produce, so the input is fed
    # in steps small enough that one step cannot decode past the remaining budget.
    decoder = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    out = bytearray()
    view, at = memoryview(body), 0
    try:
        while at < len(view):
            frame = decoder.decompressobj()
            step = _ZSTD_MIN_STEP
            while not frame.eof:
                if at >= len(view):
                    raise BadData("request body is a truncated zstd stream")
                room = max(_ZSTD_MIN_STEP, (limit + 1 - len(out)) // _ZSTD_MAX_RATIO)
                data = view[at : at + min(step, room)]
                at, step = at + len(data), min(2 * step, _MAX_PIECE)
                out += frame.decompress(data)
                if len(out) > limit:
                    raise _too_large(limit, "zstd")
            at -= len(frame.unused_data)  # the next frame starts there
    except zstandard.ZstdError as error:
        raise BadData(f"request body is not valid zstd data: {error}") from None
    return bytes(out)


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


def _lz4(body: bytes, limit: int) -> bytes:
    out = bytearray()
    view, at = memoryview(body), 0
    try:
        while at < len(view):
            frame = lz4.frame.LZ4FrameDecompressor()
            step = _FIRST_PIECE
            while not frame.eof:
                if at >= len(view):
                    raise BadData("request body is a truncated lz4 stream")
                data = view[at : at + step]
                at, step = at + len(data), min(2 * step, _MAX_PIECE)
                # At most a piece of output at once: lz4 allocates max_length for each call,
                # which made a frame cost 30 µs with the whole limit (64 MiB) as max_length.
                out += frame.decompress(data, max_length=min(limit + 1 - len(out), _MAX_PIECE))
                # Output held back by max_length: take it, up to the limit.
                while len(out) <= limit and not frame.eof and not frame.needs_input:
                    out += frame.decompress(b"", max_length=min(limit + 1 - len(out), _MAX_PIECE))
                if len(out) > limit:
                    raise _too_large(limit, "lz4")
            at -= len(frame.unused_data or b"")  # the next frame starts there
    except RuntimeError as error:  # what lz4.frame raises for data that is not a frame
        raise BadData(f"request body is not valid lz4 data: {error}") from None
    return bytes(out)


DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "x-gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "zstd": _zstd,
    "deflate": _zlib_stream("deflate", zlib.MAX_WBITS),
    "zlib": _zlib_stream("zlib", zlib.MAX_WBITS),
    "snappy": _snappy,
    "lz4": _lz4,
}
ENCODINGS = ("gzip", "zstd", "deflate", "zlib", "snappy", "lz4")
"""The codings to name to a client (``x-gzip`` is gzip's old name)."""
