"""Write-ahead intent records: a side effect's ``started`` record, on disk before it runs.

A span is exported when it ends. A process killed while a payment span is open leaves
no trace of the payment at all, although the charge may have gone through. With an
intent log, :class:`~durable_sessions.processor.DurabilitySpanProcessor` writes, when a
side-effecting action span *starts*, its action record with ``status: started`` as one
JSON line, flushed and ``fsync``-ed before ``span start`` returns, so before your code
runs the effect; the log's directory is synced when the log is opened, so that the file
itself survives a power loss too (:mod:`durable_sessions.disk`). Each line is the action
record in the seed's JSONL format, with the span's ``trace_id`` and ``span_id``. Check
it with the traces of the same processes (``durable-sessions check traces.jsonl
--intents intents.jsonl``): an intent whose span is in the traces adds nothing, and a
side effect whose span never ended, with nothing making a retry safe, is reported
(``unresolved-side-effect``).

Only side effects are written (a kind in :data:`durable_sessions.kinds.SIDE_EFFECTING`,
or ``agent.action.side_effects: true`` among the span's start attributes): each costs one
``fsync``. The record is what the mapping makes of the attributes given at span start.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from durable_sessions import disk, forking, kinds
from durable_sessions import semconv as sc
from durable_sessions.json_text import json_line
from durable_sessions.mapping import map_attributes
from durable_sessions.otlp_json import encoded_value

_OUTCOME_FIELDS = ("result", "result_ref", "result_digest", "result_length", "value_limit", "redacted")


def intent_record(
    attributes: Mapping[str, Any],
    resource: Mapping[str, Any],
    start_time_ns: int,
    trace_id: int,
    span_id: int,
) -> dict[str, Any] | None:
    """The ``started`` record of a side-effecting action span at its start, else None."""
    kind = attributes.get(sc.ACTION_KIND)
    side_effecting = isinstance(kind, str) and kind in kinds.SIDE_EFFECTING  # a mapping is no key of a set
    if not side_effecting and attributes.get(sc.attribute("side_effects")) is not True:
        return None
    if attributes.get(sc.ACTION_REPLAYED) is True or sc.ACTION_STATUS in attributes:
        return None  # a replay, or a span that says its own status (a skipped action): no effect runs
    mapped = map_attributes(attributes, resource, False, start_time_ns, trace_id, span_id, None, False)
    if mapped is None:
        return None
    record = {field: value for field, value in mapped[0].items() if field not in _OUTCOME_FIELDS}
    record["status"] = sc.STATUS_STARTED
    # The span's ids pair the intent with the span when it ends (its action id may come later).
    record["trace_id"], record["span_id"] = f"{trace_id:032x}", f"{span_id:016x}"
    return record


class IntentLog:
    """An append-only JSONL file of intent records, each durable when :meth:`write` returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # Where the file is, whatever the working directory later (a daemon's chdir).
        self._where = os.path.abspath(self.path)
        self._lock = threading.Lock()
        self._fd = -1
        self._open()
        forking.after_fork(self, _fresh_lock)

    def _open(self) -> None:
        """Open (or make) the file at the log's path; ``OSError`` if it cannot be."""
        fd = os.open(self._where, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        # Closed when the log is collected unclosed too (a processor dropped without its
        # shutdown): a raw descriptor has no finaliser of its own, and each one leaked.
        closer = weakref.finalize(self, os.close, fd)
        # Once per file, not per record: each record's fsync keeps its data, and this the
        # file's name. Also when the file was there: whoever made it may not have synced
        # it yet (another process starting beside this one).
        try:
            disk.sync_entry(self._where)
        except OSError:
            closer()
            raise
        if self._fd >= 0:
            self._closer()
        self._fd, self._closer = fd, closer
        # A line an earlier process was killed writing (its span start never returned, so
        # its effect never ran) or a full disk cut short is ended before the next record.
        self._lines = disk.LineAppender(fd, self._where)

    def _moved(self) -> bool:
        """Whether the file at the log's path is no longer the one this log writes to:
        renamed away (a rotation without copytruncate) or removed (a temporary-file
        cleaner), where every later intent would be lost to the check."""
        try:
            there = os.stat(self._where)
        except FileNotFoundError:
            return True
        here = os.fstat(self._fd)
        return (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino)

    def write(self, record: Mapping[str, Any]) -> bool:
        """Append ``record`` as one line, durable when this returns True; an ``OSError`` (a
        full disk) leaves at most a part of it, which the next line does not run into.

        False, writing nothing, once the log is closed: a span may start on another thread
        while the processor shuts down, and its write then meets the closed log. Checked
        under the lock that :meth:`close` takes, so a write either lands whole before the
        close or not at all."""
        line = json_line(record, default=_bytes_value)
        with self._lock:
            if self._fd < 0:
                return False
            if self._moved():  # a stat and an fstat, beside the fsync
                self._open()
            self._lines.append(line)
            os.fsync(self._fd)
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._closer()  # os.close, once
                self._fd = -1


def _bytes_value(value: object) -> object:
    """A bytes value (the SDK takes them as attribute values), which JSON has no type
    for, as OTLP/JSON writes it (``{"bytesValue": base64}``): an object, which the check
    judges as the inline check judges bytes, as no text."""
    if isinstance(value, bytes):
        return encoded_value(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _fresh_lock(log: IntentLog) -> None:
    log._lock = threading.Lock()
