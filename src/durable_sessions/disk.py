"""Files and directories that survive a power loss: their names as well as their data.

``fsync`` on a file makes its data durable, not its name: the entry that creating or
renaming a file puts in a directory is the directory's data, durable only once the
directory is ``fsync``-ed. Without that, a power loss can take away a file (or undo a
rename) whose every write was ``fsync``-ed. These functions sync the directory once per
entry they create or rename, never per write.

On Windows, where a directory cannot be opened to sync (NTFS journals its metadata),
and on a file system that cannot sync a directory (some network and FUSE file systems
say ``EINVAL`` or ``ENOTSUP``, as SQLite also finds), the directory is not synced: there
is nothing more a program can do there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from typing import AnyStr

_UNSYNCABLE = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES, errno.EPERM})
"""Errors that say a directory cannot be opened or synced here, rather than that it failed."""


def sync_directory(path: AnyStr | os.PathLike[AnyStr]) -> None:
    """``fsync`` the directory ``path``: the entries created, renamed or removed in it so
    far survive a power loss when this returns. Raises ``OSError`` when the sync fails
    (``EIO``); a file system that cannot sync a directory is left as it is."""
    if os.name == "nt":
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno in _UNSYNCABLE:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _UNSYNCABLE:
            raise
    finally:
        os.close(fd)


def sync_entry(path: AnyStr | os.PathLike[AnyStr]) -> None:
    """Make the entry of ``path`` in its directory durable, once it was created or renamed there."""
    sync_directory(os.path.dirname(os.path.abspath(path)))


def make_directories(path: AnyStr | os.PathLike[AnyStr]) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it makes durable in its parent.

    One ``stat`` when ``path`` exists already. A directory another process makes at the
    same time is synced too: that process may not have synced it yet.
    """
    directory = os.path.abspath(path)
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):  # a file of that name: as os.makedirs raises
                raise
        sync_entry(directory)


def write_atomically(path: AnyStr | os.PathLike[AnyStr], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all, and durably: to a file beside it,
    ``fsync``-ed, renamed over ``path``, and the directory synced. A write that fails (a
    full disk) leaves neither a part of ``data`` nor the file it was written to."""
    target = os.fspath(path)
    suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
    partial = target + (suffix if isinstance(target, str) else os.fsencode(suffix))
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)  # the data first: a rename made durable before it would name an empty file
        finally:
            os.close(fd)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    sync_entry(target)


def ends_mid_line(path: AnyStr | os.PathLike[AnyStr]) -> bool:
    """Whether the file at ``path`` ends in a line cut short: not empty, and its last
    byte no line break. A process killed while it wrote a line (``SIGKILL`` stops a
    long ``write`` between pages) or a full disk leaves one; a writer appending to the
    file must end it first, or its own first line would run on from it, and the two
    read as one line that holds neither. False when the file cannot be read (nothing
    to end, or nothing to tell) or is no regular file (standard output, a pipe: nothing
    there can be read back, and opening it must not wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size == 0:
            return False
        os.lseek(fd, status.st_size - 1, os.SEEK_SET)  # not pread: Windows has none
        return os.read(fd, 1) != b"\n"
    except OSError:
        return False
    finally:
        os.close(fd)


class LineAppender:
    """Appends lines to a file descriptor opened with ``O_APPEND``, each whole, and none
    running on from a line cut short.

    Each line goes out in as many ``write`` calls as it takes (one, but for a full disk or
    a signal), never through a buffer that would keep a failed line's rest to write out
    with the next one. ``O_APPEND`` puts every write at the end, so lines of processes
    sharing the file do not overwrite each other. A line cut short, by a full disk here or
    by an earlier process killed while writing one (found when the file was opened), is
    ended before the next line is written, so that the next line stays readable.
    """

    def __init__(self, fd: int, path: str | os.PathLike[str]) -> None:
        """``fd``: the file open at ``path`` for appending."""
        self.fd = fd
        self.torn = ends_mid_line(path)
        """Whether the file ends mid-line: the next line starts with a line break."""

    def append(self, line: bytes) -> None:
        """Write ``line`` (ending with a line break) at the end of the file; an ``OSError``
        (a full disk) leaves at most a part of it, which the next line does not run into."""
        if self.torn:
            line = b"\n" + line
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        finally:
            # Torn if part of the line went out; still torn if none did and it was before.
            self.torn = bool(view) and (self.torn or len(view) < len(line))


__all__ = [
    "LineAppender",
    "ends_mid_line",
    "make_directories",
    "sync_directory",
    "sync_entry",
    "write_atomically",
]
