"""The receivers' budget for the memory of the Export requests being decoded at once
(``receivers.max_decoding_bytes``), shared by the OTLP/gRPC and OTLP/HTTP ports.

Decoding takes several times a request's body in memory: ``orjson`` reads a whole
OTLP/JSON document into Python objects before anything is left out, and the protobuf
paths build the span parts (the reference path also upb's message). Each port serves
many requests at once (the HTTP port a thread per connection, up to
``receivers.http.max_connections``; the gRPC port a worker per call), so a burst of large
Exports could take more memory than the machine has. Every request is weighed before it
is decoded, and a request is decoded only if its weight fits in what the budget has left,
or if it is the only one being decoded (a request up to ``receivers.max_request_bytes``
always goes through, alone); the others are refused at once with the write queue's
retryable answer (503 + ``Retry-After``, ``UNAVAILABLE`` + ``RetryInfo``), as the
OpenTelemetry Collector's ``memory_limiter`` refuses data. The weight is held until the
decoding ends, however it ends.

A heavy request (over half the budget) that is refused is given a turn: for the next
:data:`TURN_RETRY_AFTERS` retry delays, lighter requests are decoded only while they
leave room for it, so when its client sends it again the budget has emptied enough
for it. Without the turn, under steady traffic, a request that fits only alone would be
refused until its client gave up. A turn ends when a request as heavy holds all the room
it needs (one ``_wire`` declines takes it in two steps: until its second, lighter
requests leave it the rest) or is decoded, or at the end of its window (a client that
gave up holds no room for long).

A request's weight is its body's size, after decompression, times the peak memory that
decoding it takes per body byte, the body itself included (``benchmarks/otlp_decode_memory.py``
measures them; the factors below are the largest it found for what SDKs send, rounded up).
What is not counted: a body while it is received and decompressed (at most the body, and
its compressed form, per connection) and while its spans wait to be committed (bounded by
the write queue), and grpcio's own copy of a gRPC message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from durable_sessions_collector.otlp import decode
from durable_sessions_collector.pipeline import Overloaded

JSON_FACTOR = 22
"""OTLP/JSON: the body and 21.0 times it (spans of many short attributes; SDK action
spans 14.4, spans of long foreign attributes and events 5.8)."""

WIRE_FACTOR = 5
"""Protobuf through ``_wire``: the body and 3.7 times it (SDK action spans; 1.1 with many
short foreign attributes, 0.2 with long ones). A request ``_wire`` declines (anything
unusual) goes on to the reference path weighed again, as :data:`REFERENCE_FACTOR`."""

REFERENCE_FACTOR = 9
"""Protobuf through the reference path (``_wire`` not built, or
``DURABLE_SESSIONS_NATIVE=false``): the body and 7.3 times it."""


TURN_RETRY_AFTERS = 4
"""How long a refused heavy request's turn lasts, in retry delays: its client is told to
retry after one to two of them (the answer's spread), and decoding what went in before
takes a moment."""


class DecodingRefused(Overloaded):
    """The request does not fit in the decoding budget now: the client should retry after
    ``retry_after_s`` or more (answered as a full write queue is)."""


class DecodingBudget:
    """Weighs the requests being decoded against ``limit`` bytes; thread-safe."""

    def __init__(
        self, limit: int, *, retry_after_s: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.protobuf_factor = WIRE_FACTOR if decode.wire_in_use() else REFERENCE_FACTOR
        self.in_use = 0
        """Bytes weighed by the requests being decoded (may pass ``limit`` for one request alone)."""
        self._decoding = 0
        self._lock = threading.Lock()
        self._clock = clock
        self._turn: tuple[int, int] = (0, 0)
        """The heavy request whose turn it is until ``_turn_ends``: the weight it asks for
        first (it is recognised by it; 0: no turn), and the room it needs (more, where
        ``_wire`` declined it)."""
        self._turn_ends = 0.0
        self._turn_holder: Reservation | None = None
        """The request whose turn it is, once it holds the first part of its room."""

    def weight(self, size: int, *, json: bool) -> int:
        """The memory a body of ``size`` bytes (decompressed) takes while it is decoded."""
        return size * (JSON_FACTOR if json else self.protobuf_factor)

    def reference_weight(self, size: int) -> int:
        """The memory a binary body of ``size`` bytes takes on the reference path."""
        return size * REFERENCE_FACTOR

    @contextmanager
    def reserved(self, size: int, *, json: bool) -> Iterator[Reservation]:
        """Hold the weight of a body of ``size`` bytes while the ``with`` block decodes it;
        raise :class:`DecodingRefused` when it fits neither in what is left nor alone."""
        reservation = Reservation(self)
        with self._lock:
            self._decoding += 1
        try:
            reservation.grow(self.weight(size, json=json))
            yield reservation
        finally:
            with self._lock:
                self.in_use -= reservation.weight
                self._decoding -= 1
                if self._turn_holder is reservation:  # decoded without its second step
                    self._end_turn()

    def _take(self, reservation: Reservation, weight: int) -> None:
        """Make what ``reservation`` holds ``weight`` in all, or refuse it."""
        held = reservation.weight
        total = weight
        with self._lock:
            now = self._clock()
            first, room = self._turn if now < self._turn_ends else (0, 0)
            lighter = total < first
            if lighter:  # than the request whose turn it is: leave it its room
                holding = self._turn_holder.weight if self._turn_holder is not None else 0
                fits = self.in_use + (weight - held) + room - holding <= self.limit
            else:
                fits = self._decoding == 1 or self.in_use + (weight - held) <= self.limit
            if not fits:
                if total > self.limit // 2 and not lighter:
                    self._turn = (held or total, total)
                    self._turn_ends = now + TURN_RETRY_AFTERS * self.retry_after_s
                    self._turn_holder = None
                raise self._refusal(total, held, room if lighter else 0)
            if first and not lighter:
                if total < room:  # its first step: the room it needs is taken in the second
                    self._turn_holder = reservation
                else:
                    self._end_turn()
            self.in_use += weight - held
            reservation.weight = weight

    def _end_turn(self) -> None:
        # Called with the lock held.
        self._turn = (0, 0)
        self._turn_holder = None

    def _refusal(self, total: int, held: int, waiting: int) -> DecodingRefused:
        turn = f"; a request of {waiting} bytes waits its turn" if waiting else ""
        return DecodingRefused(
            self.retry_after_s,
            f"decoding memory budget in use ({self._decoding - 1} other Export requests weighing "
            f"{self.in_use - held} of {self.limit} bytes, receivers.max_decoding_bytes; this one "
            f"{total}{turn}); retry after the delay given (RetryInfo, Retry-After)",
        )


class Reservation:
    """The weight one request holds in a :class:`DecodingBudget` while it is decoded."""

    def __init__(self, budget: DecodingBudget) -> None:
        self.budget = budget
        self.weight = 0

    def grow(self, weight: int) -> None:
        """Hold ``weight`` in all, where it is more than held now (a request ``_wire``
        declined, going on to the reference path); raise :class:`DecodingRefused` when
        the rest does not fit beside the other requests being decoded."""
        if weight > self.weight:
            self.budget._take(self, weight)
