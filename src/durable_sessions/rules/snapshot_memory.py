"""A session's memory (:class:`~durable_sessions.rules.state.SessionState`) as a JSON
document and three integer columns, and back: what each part becomes in a snapshot.
The container around them (version, settings, checksum) is :mod:`.snapshot`'s.

The document's fields, each map in the session's order (the oldest first: the order
decides what is forgotten past ``max_actions``):

- ``actions``: the remembered action ids; the columns give each one's *shape* (an index
  into ``shapes``), outcome fingerprint and position (a line, or a span id read as hex),
  the three parts of its packed integer (``state.split_packed``);
- ``shapes``: ``[flags, kind, status, incarnation, file]`` per distinct shape, the kind,
  status and file as indexes into ``symbols`` (the file + 1, 0 for none), the
  incarnation into ``incarnations`` (+ 1, 0 for none). The checker's symbol numbers are
  its own, shared by its sessions: a snapshot carries the texts, and a restoring checker
  numbers them in its own table. ``null`` marks an action its session kept unpacked (an
  :class:`ActionMemory`, where a symbol table was full): those are ``unpacked``, in order,
  as rows of its fields;
- ``details``, ``keys``, ``answered_prompts``, ``exhausted_retries``,
  ``unfinished_effects``: the other maps, each a *table*: an object of equally long
  lists, one per field (the map's keys first), rather than a list per entry, which would
  cost an object per entry to write and read; ``failure_runs`` (a few) as rows;
- ``incarnations``: the session's incarnation table; ``incarnation``: the last one it
  packed (the cache ``SessionState.incarnation``);
- ``oldest``: per memory, how many of its oldest keys ``SessionState._forget_oldest``
  had looked up and not yet forgotten: those are always the memory's first keys (each
  memory adds a key once, at its end, and only that method removes one), so the count
  gives them back.

Locations are a table of ``file``, ``line``, ``trace_id`` and ``span_id``; the files and
traces, few and long, as ``{"values": [...], "index": [...]}``. Values a record gave as
they were (a line, an attempt number, the incarnation beside an answered prompt) go
through :mod:`.exact_json`, so an integer beyond 64 bits or a tuple comes back as it
was. :func:`memory_from` checks every field's type and range and raises
:class:`Malformed` for anything :func:`memory_of` does not write, so that a restored
session never holds a value the rules cannot read.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any

from durable_sessions.digest import Fingerprint
from durable_sessions.record import Location
from durable_sessions.rules.exact_json import from_json, to_json
from durable_sessions.rules.state import (
    FLAG_LIMIT,
    ActionDetails,
    ActionMemory,
    FailureRun,
    KeyUse,
    Pending,
    SessionState,
    Symbols,
    join_packed,
    join_shape,
    shape_parts,
    split_packed,
)

Document = dict[str, Any]
Columns = tuple[list[int], list[int], list[int]]
"""Per remembered action: its shape's index, its outcome, its position."""
FIELDS = frozenset(
    {
        "actions",
        "shapes",
        "symbols",
        "unpacked",
        "details",
        "keys",
        "answered_prompts",
        "exhausted_retries",
        "unfinished_effects",
        "failure_runs",
        "incarnations",
        "incarnation",
        "oldest",
    }
)
OLDEST_MEMORIES = ("actions", "keys", "answered_prompts")
"""The memories ``SessionState._forget_oldest`` trims."""
_intern = sys.intern
_new_tuple = tuple.__new__


class Malformed(ValueError):
    """A document or columns that :func:`memory_of` did not write."""


# -- writing --------------------------------------------------------------------------------


def memory_of(session: SessionState) -> tuple[Document, Columns]:
    """``session``'s memory as a document and columns. Raises
    :class:`~durable_sessions.rules.exact_json.NotJson` for a record value that is not
    JSON (given by Python code): no snapshot would carry it exactly."""
    document, columns = _actions_of(session)
    uses, answers = list(session.keys.values()), list(session.answered_prompts.values())
    document.update(
        details=_details_of(session.details),
        keys={
            "key": list(session.keys),
            "action_id": [use.action_id for use in uses],
            "where": _locations_of([use.where for use in uses]),
            "ts": [to_json(use.ts) for use in uses],
        },
        answered_prompts={
            "digest": list(session.answered_prompts),
            "action_id": [action_id for action_id, _ in answers],
            "incarnation": [to_json(incarnation) for _, incarnation in answers],
        },
        exhausted_retries=_pending_of(session.exhausted_retries),
        unfinished_effects=_pending_of(session.unfinished_effects),
        failure_runs=[
            [kind, name, sorted(run.action_ids), run.reported]
            for (kind, name), run in session.failure_runs.items()
        ],
        incarnations=session.incarnations,
        incarnation=session.incarnation[0],
        oldest=None if session.oldest is None else {name: len(keys) for name, keys in session.oldest.items()},
    )
    return document, columns


def _actions_of(session: SessionState) -> tuple[Document, Columns]:
    """The action ids, shapes, symbols and unpacked memories, and the columns."""
    values = list(session.actions.values())
    unpacked = [_memory_of(value) for value in values if isinstance(value, ActionMemory)]
    shapes, outcomes, positions = split_packed([value if type(value) is int else 0 for value in values])
    keys: Sequence[int | None] = shapes
    if unpacked:  # an unpacked action's shape is null
        keys = [
            None if isinstance(v, ActionMemory) else shape for shape, v in zip(shapes, values, strict=True)
        ]
    numbered: dict[int | None, int] = {}
    indexes = [numbered.setdefault(key, len(numbered)) for key in keys]
    texts: dict[str, int] = {}  # the snapshot's own numbering of the kinds, statuses and files
    table = [None if key is None else _shape_of(key, session.symbols.texts, texts) for key in numbered]
    document = {
        "actions": list(session.actions),
        "shapes": table,
        "symbols": list(texts),
        "unpacked": unpacked,
    }
    return document, (indexes, outcomes, positions)


def _shape_of(shape: int, theirs: list[str], ours: dict[str, int]) -> list[int]:
    """``[flags, kind, status, incarnation, file]``, the kind, status and file numbered
    in ``ours`` (the snapshot's table, filled as they come) rather than ``theirs``."""
    flags, kind, status, incarnation, file = shape_parts(shape)
    kind, status = (ours.setdefault(theirs[number], len(ours)) for number in (kind, status))
    file = ours.setdefault(theirs[file - 1], len(ours)) + 1 if file else 0
    return [flags, kind, status, incarnation, file]


def _memory_of(memory: ActionMemory) -> list[Any]:
    return [
        memory.kind,
        [memory.where.file, to_json(memory.where.line), memory.where.trace_id, memory.where.span_id],
        memory.status,
        memory.incarnation,
        _attempts_of(memory.attempts),
        memory.retryable,
        memory.key,
        memory.recorded,
        to_json(memory.outcome),
        memory.effect_done,
    ]


def _details_of(details: dict[str, ActionDetails | Fingerprint]) -> Document:
    """Columns of the details; a bare outcome (a given digest that is not SHA-256) has
    null attempts, which ActionDetails never has."""
    rows = [
        detail if isinstance(detail, ActionDetails) else (detail, None, None) for detail in details.values()
    ]
    return {
        "action_id": list(details),
        "outcome": [row[0] for row in rows],
        "key": [row[1] for row in rows],
        "attempts": [_packed_attempts_of(row[2]) for row in rows],
    }


def _packed_attempts_of(attempts: int | frozenset[int] | None) -> Any:
    return attempts if attempts is None or isinstance(attempts, int) else _attempts_of(attempts)


def _attempts_of(attempts: frozenset[int]) -> list[Any]:
    return [to_json(attempt) for attempt in sorted(attempts)]


def _locations_of(wheres: list[Location]) -> Document:
    return {
        "file": _repeated_of([where[0] for where in wheres]),
        "line": [to_json(where[1]) for where in wheres],
        "trace_id": _repeated_of([where[2] for where in wheres]),
        "span_id": [where[3] for where in wheres],
    }


def _repeated_of(texts: list[str | None]) -> Document:
    """A column of few distinct values (a log's files, a session's traces), each written
    once: ``{"values": [...], "index": [...]}``."""
    numbered: dict[str | None, int] = {}
    index = [numbered.setdefault(text, len(numbered)) for text in texts]
    return {"values": list(numbered), "index": index}


def _pending_of(pending: dict[str, Pending]) -> Document:
    watched = list(pending.values())
    return {
        "key": list(pending),
        "action_id": [p.action_id for p in watched],
        "kind": [p.kind for p in watched],
        "where": _locations_of([p.where for p in watched]),
        "detail": [p.detail for p in watched],
    }


# -- reading --------------------------------------------------------------------------------


def memory_from(document: Any, columns: Columns, session: SessionState) -> None:
    """Fill ``session`` (new, empty, of the restoring checker's settings and symbol
    table) with the memory ``document`` and ``columns`` describe. Raises
    :class:`Malformed` (or another ``ValueError``, ``TypeError``, ``IndexError``) for
    anything :func:`memory_of` does not write. The one effect beyond ``session``, even
    for a document refused after it: the document's kinds, statuses and files are
    numbered in the checker's symbol table, which changes what no session means."""
    _expect(type(document) is dict and document.keys() == FIELDS, "the document's fields")
    limit = session.max_actions
    session.incarnations = _strings(document["incarnations"])
    session.incarnation_numbers = {text: index for index, text in enumerate(session.incarnations)}
    _expect(len(session.incarnation_numbers) == len(session.incarnations) <= limit, "incarnations")
    session.incarnation = _incarnation_from(document["incarnation"], session)
    session.details = _details_from(document["details"])
    session.keys = _keys_from(document["keys"])
    session.answered_prompts = _answers_from(document["answered_prompts"])
    session.exhausted_retries = _pending_from(document["exhausted_retries"])
    session.unfinished_effects = _pending_from(document["unfinished_effects"])
    runs = [_failure_run_from(_row(row, 4)) for row in _list(document["failure_runs"])]
    session.failure_runs = _unique([signature for signature, _ in runs], [run for _, run in runs])
    _expect(len(session.keys) <= limit and len(session.answered_prompts) <= limit, "the keys' count")
    session.actions = _actions_from(document, columns, session)
    _expect(len(session.actions) <= limit, "the actions' count")
    session.oldest = _oldest_from(document["oldest"], session)


def _actions_from(document: Document, columns: Columns, session: SessionState) -> dict[str, Any]:
    """The actions map, packed with the checker's symbol numbers."""
    ids = _action_ids(document["actions"])
    indexes, outcomes, positions = columns
    _expect(len(indexes) == len(outcomes) == len(positions) == len(ids), "the columns' length")
    texts = _strings(document["symbols"])
    ours, theirs = _shapes_from(_list(document["shapes"]), texts, session)
    _expect(not indexes or (min(indexes) >= 0 and max(indexes) < len(ours)), "the shape indexes")
    values: list[Any] = join_packed([ours[i] or 0 for i in indexes], outcomes, positions)
    unpacked = iter([_memory_from(row) for row in _list(document["unpacked"])])
    if None in ours:
        reader = _reader(
            session, texts, ids, join_packed([theirs[i] or 0 for i in indexes], outcomes, positions)
        )
        for position, index in enumerate(indexes):
            if ours[index] is None:
                memory = next(unpacked, None) if theirs[index] is None else reader.recall(ids[position])
                _expect(memory is not None, "the unpacked actions' count")
                values[position] = memory
    _expect(next(unpacked, None) is None, "the unpacked actions' count")
    return _unique(ids, values)


def _reader(session: SessionState, texts: list[str], ids: list[str], packed: list[int]) -> SessionState:
    """A session that recalls the actions as the snapshot packed them (its own symbols)."""
    reader = SessionState(session.session_id, symbols=Symbols())
    reader.symbols.texts, reader.details, reader.incarnations = texts, session.details, session.incarnations
    reader.actions = dict(zip(ids, packed, strict=True))
    return reader


def _shapes_from(
    rows: list[Any], texts: list[str], session: SessionState
) -> tuple[list[int | None], list[int | None]]:
    """Each shape in the checker's symbol numbers, and in the snapshot's (the index of each
    text in ``texts``). None in both for an action kept unpacked; None in the first for
    one whose kind, status or file the checker's full table cannot number: that action
    is kept as what the session recalled of it (``SessionState.recall``), as the fold
    keeps an action it cannot pack."""
    numbering = Symbols()
    for text in texts:
        numbering.number(text)
    ours: list[int | None] = []
    theirs: list[int | None] = []
    for row in rows:
        if row is None:
            ours.append(None)
            theirs.append(None)
            continue
        flags, kind, status, incarnation, file = _shape_from(row, texts, session)
        prefix = session.symbols.prefix(kind, status, file)
        ours.append(None if prefix is None else join_shape(flags, prefix, incarnation))
        theirs.append(join_shape(flags, numbering.prefix(kind, status, file) or 0, incarnation))
    return ours, theirs


def _shape_from(shape: Any, texts: list[str], session: SessionState) -> tuple[int, str, str, int, str | None]:
    flags, kind, status, incarnation, file = _row(shape, 5)
    _expect(_is_int(flags, 0, FLAG_LIMIT - 1), "a shape's flags")
    _expect(_is_int(incarnation, 0, len(session.incarnations)), "a shape's incarnation")
    _expect(_is_int(kind, 0, len(texts) - 1) and _is_int(status, 0, len(texts) - 1), "a shape's symbols")
    _expect(_is_int(file, 0, len(texts)), "a shape's file")
    return flags, texts[kind], texts[status], incarnation, texts[file - 1] if file else None


def _memory_from(row: Any) -> ActionMemory:
    kind, where, status, incarnation, attempts, retryable, key, recorded, outcome, effect_done = _row(row, 10)
    outcome = from_json(outcome)
    _expect(outcome is None or type(outcome) in (int, str), "an outcome")
    _expect(all(type(flag) is bool for flag in (retryable, recorded, effect_done)), "an action's flags")
    file, line, trace_id, span_id = _row(where, 4)
    return ActionMemory(
        _str(kind),
        Location(_optional_str(file), _lines([line])[0], _optional_str(trace_id), _optional_str(span_id)),
        _str(status),
        _optional_str(incarnation),
        _attempts_from(attempts),
        retryable,
        _optional_str(key),
        recorded,
        outcome,
        effect_done,
    )


def _details_from(table: Any) -> dict[str, ActionDetails | Fingerprint]:
    action_ids, outcomes, keys, attempts = _columns(table, ("action_id", "outcome", "key", "attempts"))
    _optional_strings(outcomes)
    _optional_strings(keys)
    details = [
        _str(outcome)
        if packed is None
        else _new_tuple(ActionDetails, (outcome, key, _packed_attempts(packed)))
        for outcome, key, packed in zip(outcomes, keys, attempts, strict=True)
    ]
    return _unique(_action_ids(action_ids), details)


def _packed_attempts(packed: Any) -> int | frozenset[int]:
    return packed if _is_int(packed, 0, None) else _attempts_from(packed)


def _attempts_from(attempts: Any) -> frozenset[int]:
    numbers = frozenset(from_json(attempt) for attempt in _list(attempts))
    _expect(all(type(number) is int for number in numbers), "attempt numbers")
    return numbers


def _keys_from(table: Any) -> dict[str, KeyUse]:
    keys, action_ids, wheres, times = _columns(table, ("key", "action_id", "where", "ts"))
    times = [from_json(ts) if type(ts) is dict else ts for ts in times]
    _expect(all(ts is None or type(ts) is float for ts in times), "a key's time")
    return _unique(_strings(keys), map(KeyUse, _action_ids(action_ids), wheres, times))


def _answers_from(table: Any) -> dict[str, tuple[str, Any]]:
    digests, action_ids, incarnations = _columns(table, ("digest", "action_id", "incarnation"))
    answers = zip(_action_ids(action_ids), map(from_json, incarnations), strict=True)
    return _unique(_strings(digests), answers)


def _pending_from(table: Any) -> dict[str, Pending]:
    keys, action_ids, kinds, wheres, details = _columns(
        table, ("key", "action_id", "kind", "where", "detail")
    )
    pending = map(Pending, _action_ids(action_ids), _strings(kinds), wheres, _strings(details))
    return _unique(_strings(keys), pending)


def _failure_run_from(row: list[Any]) -> tuple[tuple[str, str | None], FailureRun]:
    kind, name, action_ids, reported = row
    _expect(type(reported) is bool, "a failure run's flag")
    return (_str(kind), _optional_str(name)), FailureRun(set(_strings(action_ids)), reported)


def _locations_from(table: Any) -> list[Location]:
    files, lines, trace_ids, span_ids = _columns(table, ("file", "line", "trace_id", "span_id"))
    _optional_strings(span_ids)
    return [
        _new_tuple(Location, where) for where in zip(files, _lines(lines), trace_ids, span_ids, strict=True)
    ]


def _lines(lines: list[Any]) -> list[int | None]:
    lines = [from_json(line) if type(line) is dict else line for line in lines]
    _expect(all(line is None or type(line) in (int, bool) for line in lines), "a line")
    return lines


def _repeated_from(table: Any) -> list[str | None]:
    values, index = _columns(table, ("values", "index"), same_length=False)
    _optional_strings(values)
    _expect(all(type(i) is int and 0 <= i < len(values) for i in index), "a repeated column's index")
    return [values[i] for i in index]


def _incarnation_from(last: Any, session: SessionState) -> tuple[str | None, int]:
    if last is None:
        return (None, 0)
    number = session.incarnation_numbers.get(_str(last))
    _expect(number is not None, "the last incarnation")
    return (last, join_shape(0, 0, number + 1))  # type: ignore[operator]  # the packed incarnation


def _oldest_from(oldest: Any, session: SessionState) -> dict[str, deque[Any]] | None:
    if oldest is None:
        return None
    _expect(type(oldest) is dict and oldest.keys() <= set(OLDEST_MEMORIES), "the oldest keys' memories")
    batches = {}
    for name, count in oldest.items():
        memory = getattr(session, name)
        _expect(_is_int(count, 0, len(memory)), "an oldest keys' count")
        batches[name] = deque(itertools.islice(memory, count))
    return batches


# -- checks ---------------------------------------------------------------------------------


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise Malformed(f"snapshot: {what} malformed")


def _is_int(value: Any, low: int, high: int | None) -> bool:
    return type(value) is int and low <= value and (high is None or value <= high)


def _list(value: Any) -> list[Any]:
    _expect(type(value) is list, "a list")
    return value


def _row(value: Any, length: int) -> list[Any]:
    _expect(type(value) is list and len(value) == length, f"a row of {length}")
    return value


def _columns(table: Any, names: tuple[str, ...], *, same_length: bool = True) -> list[list[Any]]:
    """A table's columns, in the order of ``names``: an object of as many lists, all as
    long; a column that is a table itself is read as the list it stands for (``where``
    as locations, ``file`` and ``trace_id`` as repeated values)."""
    _expect(type(table) is dict and table.keys() == set(names), f"a table of {', '.join(names)}")
    columns = [_NESTED.get(name, _list)(table[name]) for name in names]
    _expect(not same_length or len({len(column) for column in columns}) == 1, "a table's columns' length")
    return columns


_NESTED: dict[str, Any] = {"where": _locations_from, "file": _repeated_from, "trace_id": _repeated_from}


def _unique(keys: list[Any], values: Any) -> dict[Any, Any]:
    """A map of ``keys`` to ``values`` (as many), none of whose keys may repeat."""
    mapping = dict(zip(keys, values, strict=True))
    _expect(len(mapping) == len(keys), "unique keys")
    return mapping


def _str(value: Any) -> str:
    _expect(type(value) is str, "a string")
    return value


def _optional_str(value: Any) -> str | None:
    _expect(value is None or type(value) is str, "a string or null")
    return value


def _strings(value: Any) -> list[str]:
    strings: list[str] = _list(value)
    _expect(all(type(text) is str for text in strings), "strings")
    return strings


def _optional_strings(strings: list[Any]) -> None:
    _expect(all(text is None or type(text) is str for text in strings), "strings or nulls")


def _action_ids(value: Any) -> list[str]:
    """Action ids, interned as the fold interns them: one copy per id across the maps
    (``sys.intern`` raises TypeError for anything but a string)."""
    return list(map(_intern, _list(value)))
