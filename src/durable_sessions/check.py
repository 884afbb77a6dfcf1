"""Offline checking: log files through the readers into the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from durable_sessions.engine import Checker
from durable_sessions.readers import DEFAULT_MAX_LINE_BYTES, Format, Unreadable, open_source, read
from durable_sessions.violation import Violation

Progress = Callable[[str, int, int | None], None]
"""Called now and then with (file, bytes read, file size or None)."""

PROGRESS_EVERY = 65_536


def check_paths(
    paths: Iterable[str],
    checker: Checker,
    *,
    fmt: Format = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    progress: Progress | None = None,
) -> Iterator[Violation]:
    """Every violation in ``paths``, checked as one stream, then the end-of-input ones.

    Sessions may span files (one file per process run, say). Raises
    :class:`~durable_sessions.readers.InputError` for a source that cannot be read.
    """
    feed, unreadable = checker.feed, checker.unreadable
    for path in paths:
        with open_source(path) as source:
            size = _size(source)
            for count, item in enumerate(read(path, source, fmt=fmt, max_line_bytes=max_line_bytes)):
                if type(item) is Unreadable:
                    yield from unreadable(item.location, item.reason)  # type: ignore[union-attr]
                elif violations := feed(*item):  # type: ignore[misc]
                    yield from violations
                if progress is not None and count % PROGRESS_EVERY == 0:
                    progress(path, source.tell(), size)
    yield from checker.finish()


def _size(source) -> int | None:
    try:
        import os

        return os.fstat(source.fileno()).st_size or None
    except (OSError, ValueError, AttributeError):
        return None
