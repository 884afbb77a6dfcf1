"""Request bodies' ``Content-Encoding`` on the OTLP/HTTP receiver: gzip, zstd, deflate and
zlib, the codings the OpenTelemetry Collector's ``otlphttp`` exporter sends (its
``compression`` setting) besides snappy and lz4, and the ones the SDKs send.

Each decoder stops at ``limit`` decoded bytes, so a small body that would inflate to
gigabytes (a "bomb") costs at most ``limit`` bytes of memory, and raises:
:class:`TooLarge` past the limit, :class:`~.decode.BadData` for data that is not valid in
its coding or ends early. Several gzip members or zstd frames one after the other are one
body, as RFC 9112 and the zstd format say.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import zstandard

from durable_sessions_collector.otlp.decode import BadData

ZSTD_MAX_WINDOW = 8 * 1024 * 1024
"""Largest zstd window a body may ask for (its decoder's memory): the Collector's encoder
uses at most 8 MiB; a frame asking more is refused, not allocated."""

# A zstd RLE block is 4 bytes and decodes to 128 KiB: no input inflates more than this.
_ZSTD_MAX_RATIO = 32 * 1024
_ZSTD_MIN_STEP = 64


class TooLarge(Exception):
    pass


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
        data = body
        try:
            while data:
                decompressor = zlib.decompressobj(bits)
                while data:
                    out += decompressor.decompress(data, limit + 1 - len(out))
                    if len(out) > limit:
                        raise TooLarge(
                            f"request body is over the {limit}-byte limit after {name} decompression"
                        )
                    data = decompressor.unconsumed_tail
                if not decompressor.eof:
                    raise BadData(f"request body is a truncated {name} stream")
                data = decompressor.unused_data if name == "gzip" else b""
        except zlib.error as error:
            raise BadData(f"request body is not valid {name} data: {error}") from None
        return bytes(out)

    return decode


def _zstd(body: bytes, limit: int) -> bytes:
    # zstandard's decompressobj cannot be told how much to produce, so the input is fed
    # in steps small enough that one step cannot decode past the remaining budget.
    decoder = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    out = bytearray()
    data = memoryview(body)
    try:
        while data:
            frame = decoder.decompressobj()
            fed = 0
            while not frame.eof and fed < len(data):
                step = max(_ZSTD_MIN_STEP, (limit + 1 - len(out)) // _ZSTD_MAX_RATIO)
                out += frame.decompress(data[fed : fed + step])
                fed += step
                if len(out) > limit:
                    raise TooLarge(f"request body is over the {limit}-byte limit after zstd decompression")
            if not frame.eof:
                raise BadData("request body is a truncated zstd stream")
            data = memoryview(frame.unused_data + bytes(data[fed:]))
    except zstandard.ZstdError as error:
        raise BadData(f"request body is not valid zstd data: {error}") from None
    return bytes(out)


DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "x-gzip": _zlib_stream("gzip", 16 + zlib.MAX_WBITS),
    "zstd": _zstd,
    "deflate": _zlib_stream("deflate", zlib.MAX_WBITS),
    "zlib": _zlib_stream("zlib", zlib.MAX_WBITS),
}
ENCODINGS = ("gzip", "zstd", "deflate", "zlib")
"""The codings to name to a client (``x-gzip`` is gzip's old name)."""
