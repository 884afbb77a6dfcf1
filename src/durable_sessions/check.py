"""Offline checking: log files through the readers into the engine.

:class:`OfflineCheck` checks a list of files as one stream (a session may span files).
With ``jobs`` above 1 the lines of a JSONL action log are routed by session to worker
processes, each running its own engine: every session is still judged by exactly one
engine, in line order, so the findings are the same as those of a single process.
Either way, the findings come out in input order, the end-of-session ones last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import multiprocessing
import os
import re
import signal
import stat
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from durable_sessions.engine import Checker, Line
from durable_sessions.native import native_module
from durable_sessions.readers import (
    DEFAULT_MAX_LINE_BYTES,
    Format,
    InputError,
    Item,
    Redeliveries,
    Unreadable,
    display_name,
    numbered_lines,
    open_source,
    parse_line,
    read,
    sniff,
    sniff_format,
)
from durable_sessions.record import Location
from durable_sessions.rules import Rule, rule_references, rules_from_references
from durable_sessions.rules.state import DEFAULT_KEY_WINDOW_S
from durable_sessions.violation import Violation

Progress = Callable[[str, int, int | None], None]
"""Called now and then with (file, bytes read, file size or None)."""

PROGRESS_EVERY = 65_536
PARALLEL_MIN_BYTES = 64 * 1024 * 1024


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, where known)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs(paths: Sequence[str], fmt: Format) -> int:
    """Worker processes worth starting: one per core for big JSONL files, else none."""
    if fmt == "tracing" or "-" in paths:
        return 1
    try:
        total = sum(os.path.getsize(path) for path in paths)
    except OSError:
        return 1
    return min(usable_cores(), 8) if total >= PARALLEL_MIN_BYTES else 1


def cli_start_method() -> str:
    """How the CLI starts its workers: ``fork`` where the platform has it and no other
    Python thread runs here (true of the CLI, not always of a test calling it), else
    ``spawn``. Forked workers skip re-importing the checker: ~0.3 s of a big check."""
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return "fork"
    return "spawn"


class OfflineCheck:
    """One check of ``paths``; iterate it for the violations, then read the counts.

    Standard input (``-``), a FIFO or a pipe can be read only once, so a check that
    includes one runs in this process whatever ``jobs`` says. Workers are started with
    ``start_method`` (:mod:`multiprocessing`'s): ``spawn`` by default, which is safe in any process;
    ``fork`` starts them without re-importing the checker, which is safe only in a
    process with no other threads (the CLI passes it where the platform has it).
    """

    def __init__(
        self,
        paths: Sequence[str],
        rules: Iterable[Rule],
        *,
        key_window_s: float = DEFAULT_KEY_WINDOW_S,
        fmt: Format = "auto",
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        jobs: int = 1,
        progress: Progress | None = None,
        start_method: str = "spawn",
        intents: Sequence[str] = (),
        attribute_value_limit: int | None = None,
    ) -> None:
        self.attribute_value_limit = attribute_value_limit
        self.paths = list(paths)
        self.intents = list(intents)
        self.rules = tuple(rules)
        self.key_window_s = key_window_s
        self.fmt = fmt
        self.max_line_bytes = max_line_bytes
        self.jobs = jobs
        self.progress = progress
        self.start_method = start_method
        self.actions = 0
        self.sessions = 0

    def __iter__(self) -> Iterator[Violation]:
        if (
            self.jobs > 1
            and not self.intents
            and all(map(_rereadable, self.paths))
            and self._all_actions_format()
        ):
            return self._parallel()
        return self._sequential()

    def _sequential(self) -> Iterator[Violation]:
        checker = offline_checker(self.rules, key_window_s=self.key_window_s)
        try:
            yield from check_paths(
                self.paths,
                checker,
                fmt=self.fmt,
                max_line_bytes=self.max_line_bytes,
                progress=self.progress,
                intents=self.intents,
                attribute_value_limit=self.attribute_value_limit,
            )
        finally:
            self.actions, self.sessions = checker.actions, checker.sessions

    def _all_actions_format(self) -> bool:
        if self.fmt != "auto":
            return self.fmt == "actions"
        for path in self.paths:
            with open_source(path) as source:
                if sniff_format(source, display_name(path), self.max_line_bytes) != "actions":
                    return False
        return True

    def _parallel(self) -> Iterator[Violation]:
        """Each worker reads every file and checks the lines of its own sessions."""
        for path in self.paths:
            with open_source(path):
                pass  # fail here, loudly, before any worker starts
        context = multiprocessing.get_context(self.start_method)
        rule_ids = rule_references(self.rules)
        workers = []
        for shard in range(self.jobs):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_check_shard,
                args=(
                    sender,
                    self.paths,
                    shard,
                    self.jobs,
                    rule_ids,
                    self.key_window_s,
                    self.max_line_bytes,
                    shard == 0 and self.progress is not None,
                ),
                daemon=True,
            )
            with _stopping_signals_held():
                process.start()
            sender.close()
            workers.append((process, receiver))
        # Per occurrence of a path, not per name: a file given twice is read twice.
        record_time: list[list[Violation]] = [[] for _ in self.paths]
        session_end: list[Violation] = []
        received = False
        try:
            for _, receiver in workers:
                found, ended, actions, sessions = _receive(receiver, self.progress)
                for mine, theirs in zip(record_time, found, strict=True):
                    mine.extend(theirs)
                session_end.extend(ended)
                self.actions += actions
                self.sessions += sessions
            received = True
        finally:
            for process, receiver in workers:
                receiver.close()
                if not received:  # interrupted, or a worker failed: stop the others now
                    process.terminate()  # rather than wait out their work
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
        for found in record_time:  # as one process finds them: file by file, line by line
            yield from sorted(found, key=_line_of)
        yield from sorted(session_end, key=_position_in(self.paths))


ATTRIBUTE_LIMIT_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")


def sdk_attribute_value_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """The span attribute value length limit the OpenTelemetry SDK applies in ``environ``
    (default: this process's environment): ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``,
    else ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, as the SDK's ``SpanLimits`` reads them;
    None when unset. Raises ``ValueError`` for a value the SDK refuses."""
    from opentelemetry.sdk.trace import SpanLimits  # the SDK is imported only when asked

    environ = os.environ if environ is None else environ
    name = next((name for name in ATTRIBUTE_LIMIT_VARIABLES if environ.get(name)), None)
    if name is None:
        return None
    try:
        return SpanLimits(max_span_attribute_length=int(environ[name])).max_span_attribute_length or None
    except ValueError:
        raise ValueError(f"${name} must be a non-negative integer, got {environ[name]!r}") from None


def offline_checker(rules: Iterable[Rule], *, key_window_s: float = DEFAULT_KEY_WINDOW_S) -> Checker:
    """The engine :func:`check_paths` is made to feed: its readers drop every OTLP span
    delivered again, by session, trace id, span id and status (:class:`Redeliveries`), as
    the sidecar's stores do, so the engine is told not to skip a span repeating the span id
    and status of its action's last span, which in another trace is another span; the
    sidecar and the offline checker then judge the same spans alike."""
    return Checker(rules, key_window_s=key_window_s, dropped_redeliveries=True)


def check_paths(
    paths: Iterable[str],
    checker: Checker,
    *,
    fmt: Format = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    progress: Progress | None = None,
    intents: Sequence[str] = (),
    attribute_value_limit: int | None = None,
) -> Iterator[Violation]:
    """Every violation in ``paths``, checked as one stream, then the end-of-input ones.

    ``attribute_value_limit``: the attribute value length limit OTLP/JSON spans were
    recorded under, when known (a result that long was probably cut: ``truncated-result``).
    ``checker``: one made by :func:`offline_checker`; another also skips a span of an
    action's last span id and status in another trace (the span processor's engine does).

    Sessions may span files (one file per process run, say). ``intents`` are intent logs
    (:mod:`durable_sessions.intent_log`): an intent whose span is among ``paths`` is that
    span's start, and adds nothing; the others, side effects whose span never ended,
    are checked after ``paths``, as the last thing their actions did. Raises
    :class:`~durable_sessions.readers.InputError` for a source that cannot be read.
    """
    feed = checker.feed
    paths = list(paths)
    pending, unreadable = _read_intents(intents, max_line_bytes)
    for item in unreadable:
        yield from _unreadable(checker, item)
    # The state a stream carries from file to file: a span may come back in the next
    # file (OTLP/JSON), a tool call completed in one file may get its result in the next
    # (tracing).
    redeliveries, completed = Redeliveries(), set()  # type: ignore[var-annotated]
    for path in paths:
        with open_source(path) as source:
            size = _size(source)
            name = display_name(path)
            file_fmt = fmt
            if fmt == "auto":  # a pipe's first lines are read to tell: read on from the stream returned
                file_fmt, source = sniff(source, name, max_line_bytes)
            if intents and file_fmt == "actions" and fmt == "auto" and _holds_nothing(source):
                file_fmt = "otlp-json"  # no span ended before the crash: every intent is unfinished
            if intents and file_fmt != "otlp-json":
                raise InputError(
                    f"{name}: --intents pairs intent records with the spans of OTLP/JSON traces; "
                    f"this is {file_fmt} input, whose records name no span"
                )
            # A pipe or FIFO cannot tell how far it has been read: no progress for it.
            reports = progress is not None and _can_tell(source)
            if file_fmt == "actions" and _reads_in_blocks(path, source):

                def report(path: str = path, source: Any = source, size: int | None = size) -> None:
                    progress(path, source.tell(), size)  # type: ignore[misc]

                reporting = report if reports else None
                yield from _check_blocks(source, name, checker, 0, 1, max_line_bytes, reporting)
                continue
            items = read(
                path,
                source,
                fmt=file_fmt,
                max_line_bytes=max_line_bytes,
                redeliveries=redeliveries,
                completed=completed,
                attribute_value_limit=attribute_value_limit,
            )
            for count, item in enumerate(items):
                if type(item) is Unreadable:
                    yield from _unreadable(checker, item)  # type: ignore[arg-type]
                    continue
                if pending:
                    where = item[1]  # type: ignore[index]
                    pending.pop((where.trace_id, where.span_id), None)
                if violations := feed(*item):  # type: ignore[misc]
                    yield from violations
                if reports and count % PROGRESS_EVERY == 0:
                    progress(path, source.tell(), size)  # type: ignore[misc]
    for record, where in pending.values():
        yield from feed(record, where)
    yield from sorted(checker.finish(), key=_position_in([*paths, *intents]))


def _read_intents(
    intents: Sequence[str], max_line_bytes: int
) -> tuple[dict[tuple[str | None, str | None], tuple[Any, Location]], list[Unreadable]]:
    """The intent records of ``intents`` by (trace id, span id), and their unreadable lines."""
    pending: dict[tuple[str | None, str | None], tuple[Any, Location]] = {}
    unreadable: list[Unreadable] = []
    for path in intents:
        with open_source(path) as source:
            for item in read(path, source, fmt="actions", max_line_bytes=max_line_bytes):
                if type(item) is Unreadable:
                    unreadable.append(item)  # type: ignore[arg-type]
                    continue
                record, where = item  # type: ignore[misc]
                trace_id, span_id = (
                    value.lower() if type(value) is str else value
                    for value in (record.get("trace_id"), record.get("span_id"))
                )
                where = Location(where.file, where.line, trace_id, span_id)
                pending[(trace_id, span_id) if span_id is not None else (where.file, str(where.line))] = (
                    record,
                    where,
                )
    return pending, unreadable


def _can_tell(source: Any) -> bool:
    """Whether ``source`` can tell its position: a regular file can; standard input from
    a pipe, a FIFO or ``<(zcat log.gz)`` cannot (``tell()`` raises "Illegal seek")."""
    try:
        return bool(source.seekable())
    except (OSError, ValueError, AttributeError):
        return False


def _unreadable(checker: Checker, item: Unreadable) -> list[Violation]:
    """What ``checker`` reports for ``item``, each violation keyed by ``item``'s occurrence
    (the bad spans of one OTLP/JSON line share its location, not their keys)."""
    found = checker.unreadable(item.location, item.reason)
    if item.occurrence:
        return [dataclasses.replace(violation, occurrence=item.occurrence) for violation in found]
    return found


def _rereadable(path: str) -> bool:
    """Whether every worker of a parallel check can open ``path`` and read it all: a
    regular file, not standard input, a FIFO or a pipe (``<(zcat log.gz)``, /dev/stdin),
    whose lines only the first reader would get. A path that cannot be examined counts
    as rereadable: the parallel check then reports it before starting a worker."""
    if path == "-":
        return False
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return True


def _reads_in_blocks(path: str, source: Any) -> bool:
    """Whether an action log is read as a parallel worker reads its share: a block at a
    time, each line fed by :meth:`Checker.feed_lines`. So it is in a regular file where
    the native extension routes lines; a stream (standard input, a pipe) is checked line
    by line as it comes."""
    if path == "-" or native_module() is None:
        return False
    try:
        return stat.S_ISREG(os.fstat(source.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def _check_blocks(
    source: Any,
    name: str,
    checker: Checker,
    shard: int,
    shards: int,
    max_line_bytes: int,
    progress: Callable[[], None] | None,
) -> Iterator[Violation]:
    """The violations in the lines of ``source`` that worker ``shard`` of ``shards`` owns
    (one process is worker 0 of 1), found a block at a time."""
    other = _line_checker(checker, name, shard, shards, max_line_bytes)
    for lines in own_lines(source, name, shard, shards, max_line_bytes, progress):
        if violations := checker.feed_lines(lines, name, other):
            yield from violations


def _line_of(violation: Violation) -> int:
    return violation.line or 0


def _position_in(paths: Sequence[str]) -> Callable[[Violation], tuple[int, int]]:
    """A sort key putting violations in input order: by file, then line. A violation
    names its file only, so a file given twice sorts at its last place (in one process
    and in several alike)."""
    order = {display_name(path): index for index, path in enumerate(paths)}
    return lambda violation: (order.get(violation.file, -1), violation.line or 0)  # type: ignore[arg-type]


def _holds_nothing(source: Any) -> bool:
    peek = getattr(source, "peek", None)
    return peek is not None and peek(1) == b""


def _size(source) -> int | None:
    try:
        return os.fstat(source.fileno()).st_size or None
    except (OSError, ValueError, AttributeError):
        return None


# -- worker processes ---------------------------------------------------------------


def shard_of(item: Item, shards: int) -> int:
    """The worker that checks ``item``: a hash of its session id, so one worker sees a whole session.

    Items without a string session id (unreadable lines, records missing it) carry no
    session state and go to worker 0. The hash must agree across processes, so it is
    CRC-32 of the UTF-8 id rather than the salted built-in ``hash``.
    """
    if type(item) is Unreadable:
        return 0
    session_id = item[0].get("session_id")  # type: ignore[index]
    if type(session_id) is not str:
        return 0
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % shards


_LEADING_SESSION_ID = b'{"session_id":"'
_ESCAPED_LETTER = re.compile(rb"\\u00[4-7]")
"""A ``\\u`` escape of an ASCII letter or the underscore (and of a few other characters):
a key so written may be ``session_id`` again, which the bytes cannot see."""


def raw_shard_of(raw: bytes, shards: int) -> int | None:
    """The worker for a raw line when its bytes alone decide it, else None (parse it).

    They decide when the line starts with ``{"session_id":"`` (writers usually put it
    first), names ``session_id`` nowhere else, even with escaped letters (no ``\\u004`` to
    ``\\u007`` anywhere: ``"session\\u005fid"`` is the same key, and the parser keeps its
    last value), and the id has no escape: the bytes between the quotes are then the
    id's UTF-8, hashed as :func:`shard_of` hashes it. The worker so chosen owns the line
    whatever it turns out to hold; the others skip it without parsing.
    """
    if not raw.startswith(_LEADING_SESSION_ID) or raw.count(b'"session_id"') != 1:
        return None
    if b"\\u00" in raw and _ESCAPED_LETTER.search(raw):
        return None
    end = raw.find(b'"', 15)
    session_id = raw[15:end]
    if end < 0 or not session_id or b"\\" in session_id:
        return None
    return zlib.crc32(session_id) % shards


OwnLine = Line
"""(line number, raw line or None when it is too long, whether the bytes already showed it is
this worker's); other lines are not given."""
ROUTE_BLOCK = 1 << 18
LINES_PER_BLOCK = 1024


def own_lines(
    source: Any,
    name: str,
    shard: int,
    shards: int,
    max_line_bytes: int,
    progress: Callable[[], None] | None = None,
) -> Iterator[list[OwnLine]]:
    """The lines of ``source`` that worker ``shard`` of ``shards`` must look at, in blocks:
    those :func:`raw_shard_of` gives it, and those the bytes do not decide (parse and see).

    Uses the native extension's ``route_lines`` where it was built, so that a line another
    worker owns costs no Python code; the same lines either way (a test checks this).
    """
    native = native_module()
    if native is None:
        return _batched(_own_lines_by_line(source, name, shard, shards, max_line_bytes, progress))
    return _own_lines_by_block(source, name, shard, shards, max_line_bytes, progress, native.route_lines)


def _batched(lines: Iterator[OwnLine]) -> Iterator[list[OwnLine]]:
    while block := list(itertools.islice(lines, LINES_PER_BLOCK)):
        yield block


def _own_lines_by_line(
    source: Any, name: str, shard: int, shards: int, max_line_bytes: int, progress: Callable[[], None] | None
) -> Iterator[OwnLine]:
    for number, raw in numbered_lines(source, name, max_line_bytes):
        if progress is not None and number % PROGRESS_EVERY == 0:
            progress()
        owner = None if raw is None else raw_shard_of(raw, shards)
        if owner is None:
            yield number, raw, False
        elif owner == shard:
            yield number, raw, True


def _own_lines_by_block(
    source: Any,
    name: str,
    shard: int,
    shards: int,
    max_line_bytes: int,
    progress: Callable[[], None] | None,
    route_lines: Callable[..., tuple[list[OwnLine], int, int]],
) -> Iterator[list[OwnLine]]:
    """As :func:`_own_lines_by_line`, a block at a time; a line longer than
    ``max_line_bytes`` is never held whole (as :func:`readers.numbered_lines`).

    The start of a line that goes on past its block is held as a list of blocks until
    its end comes, then joined once: joining and routing it again with every block cost
    time quadratic in the line's length (seconds for a line of 50 MB).
    """
    number, held, held_bytes, skipping = 0, [], 0, False
    try:
        while True:
            block = source.read(ROUTE_BLOCK)
            final = not block
            if progress is not None:
                progress()
            if skipping:  # the rest of a line already reported as too long
                newline = block.find(b"\n")
                if newline < 0 and not final:
                    continue
                block, skipping = block[newline + 1 :] if newline >= 0 else b"", False
            if held and not final and b"\n" not in block:  # the held line goes on
                held.append(block)
                held_bytes += len(block)
            else:
                data = b"".join((*held, block)) if held else block
                lines, consumed, number = route_lines(data, number, shard, shards, max_line_bytes, final)
                if lines:
                    yield lines
                if final:
                    return
                carry = data[consumed:]
                held, held_bytes = ([carry], len(carry)) if carry else ([], 0)
            if held_bytes > max_line_bytes:  # no end in sight: too long, skip the rest
                number += 1
                yield [(number, None, False)]
                held, held_bytes, skipping = [], 0, True
    except OSError as error:
        raise InputError(f"cannot read {name!r} after line {number}: {error.strerror or error}") from None


def _receive(
    receiver: Any, progress: Progress | None
) -> tuple[list[list[Violation]], list[Violation], int, int]:
    """A worker's findings; on the way, the progress it reports (worker 0 only)."""
    while True:
        try:
            message = receiver.recv()
        except EOFError:
            raise InputError("a checking worker process died; run again with --jobs 1") from None
        if isinstance(message, str):
            raise InputError(message)
        if message[0] != _PROGRESS:
            return message
        if progress is not None:
            progress(*message[1:])


_PROGRESS = "progress"


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the length of a check.

    The engine's session memory holds no reference cycles, so reference counting frees
    all of it. The collector would only walk that growing memory again and again: about
    12% of a one-process check of a million actions (measured in docs/benchmarks.md).
    Only for processes that the check owns (the CLI and its workers), never inside an
    application.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _line_checker(
    checker: Checker, name: str, shard: int, shards: int, max_line_bytes: int
) -> Callable[[int, bytes | None, bool], list[Violation]]:
    """What a worker does with a line :meth:`Checker.feed_lines` does not feed itself: parse
    it, skip it if another worker owns it, else check it (readers report why it is unreadable)."""

    def check_line(number: int, raw: bytes | None, owned: bool) -> list[Violation]:
        item = parse_line(raw, name, number, max_line_bytes)
        if item is None or (not owned and shard_of(item, shards) != shard):
            return []
        if type(item) is Unreadable:
            return checker.unreadable(item.location, item.reason)  # type: ignore[union-attr]
        return checker.feed(*item)  # type: ignore[misc]

    return check_line


_STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _stopping_signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while a worker starts: it inherits them held, and
    :func:`_check_shard` lets them in once it has set how it takes them. A worker forked
    with the CLI's handlers that Ctrl-C reached before then printed a KeyboardInterrupt
    traceback. This process takes what came meanwhile once the start returns."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no fork, and no signal mask
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _check_shard(*args: Any) -> None:
    """A worker process's entry: :func:`_check_own_lines`, with the cyclic collector paused.

    Ctrl-C reaches every process of the terminal's group: a worker ignores it and is
    stopped by its parent (see :meth:`OfflineCheck._parallel`), so one interrupt prints no
    traceback per worker; SIGTERM, which the parent sends, ends it quietly.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the CLI's handler
    if hasattr(signal, "pthread_sigmask"):  # held since the fork (_stopping_signals_held): let them in
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING_SIGNALS)
    with cyclic_gc_paused():
        _check_own_lines(*args)


def _check_own_lines(
    sender: Any,
    paths: list[str],
    shard: int,
    shards: int,
    rule_ids: list[str],
    key_window_s: float,
    max_line_bytes: int,
    reports_progress: bool,
) -> None:
    """A worker: read every line, check those whose session hashes to ``shard``, send the findings.

    Every worker reads every line; it parses only those that may be its own. That costs
    less than a parent process parsing once and shipping records to the workers.
    """
    checker = offline_checker(rules_from_references(rule_ids), key_window_s=key_window_s)
    found: list[list[Violation]] = []  # per path, in the order given
    parent = os.getppid()
    try:
        for path in paths:
            name = display_name(path)
            with open_source(path) as source:
                size = _size(source) if reports_progress else None

                def progress(path: str = path, source: Any = source, size: int | None = size) -> None:
                    if os.getppid() != parent:  # the parent was killed (SIGKILL): no one will
                        os._exit(1)  # read the findings, so stop rather than check on for minutes
                    if reports_progress:
                        sender.send((_PROGRESS, path, source.tell(), size))

                checked = _check_blocks(source, name, checker, shard, shards, max_line_bytes, progress)
                found.append(list(checked))
    except InputError as error:
        sender.send(str(error))
        return
    sender.send((found, checker.finish(), checker.actions, checker.sessions))
