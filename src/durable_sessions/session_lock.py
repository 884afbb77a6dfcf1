"""One process at a time per session: a lock the operating system drops when its holder dies.

Two live processes running one session (a supervisor that starts a second copy while the
first still runs, a queue that hands a session to a second worker) would both run its
actions: both ask the user, both charge the card, and the journal can only log that the
second completion lost. A :func:`~durable_sessions.instrument.session` block with a
journal therefore holds the session's lock for as long as it is open, and a block of
another process fails with :class:`SessionInUse` instead of running beside it.

The lock is a one-byte range of a lock file beside the journal (``<journal>-sessions.lock``),
at an offset that the session id's SHA-256 gives, so one file serves every session.
The kernel releases it when its holder dies (a SIGKILL included), so a process that
resumes a crashed session never waits for a lease to run out. On Linux the range is an
*open file description* lock (``F_OFD_SETLK``): a child forked inside the block shares
its parent's hold, and may enter the session too; the kernel releases a shared hold only
when every process sharing it is gone, so such a child that outlives a crashed parent
keeps the session held until it ends. Elsewhere it is a POSIX record lock
(``lockf``), which a forked child does not share. Blocks nest, and threads of one
process share the hold; it is let go when the last block of the process ends.

:func:`live` tells which sessions a live process holds, for a listing of actions
``started``: those of a held session are running, not in doubt.

Failing open: a lock file that cannot be opened or locked for any reason but another
holder (a read-only directory, a file system without locks) is logged and the block
runs unlocked; repeats of the error are not logged until the lock file works again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from durable_sessions.pickling import reduced
from durable_sessions.repeats import RepeatedFailures

logger = logging.getLogger("durable_sessions")

_OFFSETS = 1 << 62
"""Offsets are taken below this, well inside a 64-bit ``off_t``."""

_OFD_LOCKS = sys.platform == "linux" and struct.calcsize("@hhqqi4x") == 32
"""Open file description locks, with Linux's 64-bit ``struct flock`` layout."""

if _OFD_LOCKS or sys.platform != "win32":
    import fcntl
else:  # pragma: no cover - no advisory locks to take
    fcntl = None  # type: ignore[assignment]


class SessionInUse(RuntimeError):
    """Another live process runs this session: running it here too could repeat its effects.

    Raised when a :func:`~durable_sessions.instrument.session` block with a journal is
    entered while another process has the same session open. Wait for that process to
    end (or stop it): its lock goes with it. A helper process that runs actions of a
    session its parent holds opens its block with ``exclusive=False``.
    """

    advice = "run one session in one process at a time, or pass exclusive=False to a helper process's block"
    """What to do about it, the end of the message."""

    def __init__(self, session_id: str, lock_path: Path) -> None:
        self.session_id = session_id
        self.lock_path = lock_path
        super().__init__(
            f"session {session_id!r} is open in another live process (its lock in {lock_path} is held); "
            + self.advice
        )

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as what it was made from (:func:`~durable_sessions.pickling.reduced`)."""
        return reduced(self, self.session_id, self.lock_path)


def lock_path_of(journal_path: Path) -> Path:
    """The lock file of the journal at ``journal_path``."""
    return journal_path.with_name(journal_path.name + "-sessions.lock")


def offset_of(session_id: str) -> int:
    """The byte of the lock file that stands for ``session_id``."""
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % _OFFSETS


class _Hold:
    __slots__ = ("blocks", "inherited")

    def __init__(self) -> None:
        self.blocks = 0
        self.inherited = False
        """Forked while held: the parent's lock, which this process must never let go."""


class _SessionLocks:
    """This process's holds, by lock file and offset; one descriptor per lock file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[Path, int] = {}
        self._holds: dict[tuple[Path, int], _Hold] = {}
        self._failing = RepeatedFailures()
        """Lock files that cannot be locked, logged once per error (not at every block)."""

    @contextlib.contextmanager
    def held(self, lock_path: Path, session_id: str) -> Iterator[None]:
        """Hold ``session_id``'s lock in ``lock_path`` for the ``with`` block; raise
        :class:`SessionInUse` when another process holds it."""
        key = (lock_path, offset_of(session_id))
        with self._lock:
            hold = self._holds.get(key)
            if hold is None and self._locked(key, session_id):
                hold = self._holds[key] = _Hold()
            if hold is not None:  # else failed open: the block runs unlocked
                hold.blocks += 1
        try:
            yield
        finally:
            if hold is not None:
                self._let_go(key, hold)

    def _locked(self, key: tuple[Path, int], session_id: str) -> bool:
        """Take the lock; False (logged) when it cannot be taken for another reason than a holder."""
        lock_path, offset = key
        try:
            descriptor = self._file(lock_path)
        except OSError as error:
            return self._unlocked(session_id, lock_path, error)
        try:
            _set_lock(descriptor, fcntl.F_WRLCK, offset)
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.EACCES):
                raise SessionInUse(session_id, lock_path) from None
            return self._unlocked(session_id, lock_path, error)
        self._locks_again(lock_path)
        return True

    def _unlocked(self, session_id: str, lock_path: Path, error: OSError) -> bool:
        """Log that the session runs unlocked: once per lock file and error, not at every
        session block of a server whose lock file cannot be made (a read-only file system)."""
        if not self._failing.failed(lock_path, "lock", str(error)):
            return False
        logger.warning(
            "durable_sessions: cannot lock session %r in %s (%s); it runs unlocked: a second "
            "process running it at the same time would not be stopped (repeats of this error are not "
            "logged until the lock file works again)",
            session_id,
            lock_path,
            error,
        )
        return False

    def _locks_again(self, lock_path: Path) -> None:
        ended = self._failing.worked(lock_path, "lock")
        if ended is not None:
            logger.warning(
                "durable_sessions: the lock file %s works again (%d more sessions ran unlocked with %s, not logged)",
                lock_path,
                ended[1],
                ended[0],
            )

    def _let_go(self, key: tuple[Path, int], hold: _Hold) -> None:
        with self._lock:
            hold.blocks -= 1
            if hold.blocks > 0 or self._holds.get(key) is not hold:
                return
            del self._holds[key]
            if not hold.inherited:
                with contextlib.suppress(OSError):  # the process keeps a lock it cannot drop; it goes at exit
                    _set_lock(self._files[key[0]], fcntl.F_UNLCK, key[1])
            if not any(path == key[0] for path, _ in self._holds):
                # No lock left on the file: its descriptor goes too (a process that opens
                # many journals in turn must not run out of descriptors).
                descriptor = self._files.pop(key[0], None)  # none in a child, for an inherited hold
                if descriptor is not None:
                    os.close(descriptor)

    def live(self, lock_path: Path, session_ids: Iterable[str]) -> set[str]:
        """See :func:`live`. Under this object's lock, so that the descriptor of a lock
        file this process holds a lock in is not closed meanwhile."""
        with self._lock:
            ids = {session_id: offset_of(session_id) for session_id in session_ids}
            found = {session_id for session_id, offset in ids.items() if (lock_path, offset) in self._holds}
            # This process's own descriptor where it has one: closing another of the same
            # file would let go of every POSIX lock this process holds there (off Linux).
            descriptor, opened = self._files.get(lock_path), None
            if descriptor is None:
                try:
                    descriptor = opened = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    return found
            try:
                return found | {
                    s for s, offset in ids.items() if s not in found and _held_elsewhere(descriptor, offset)
                }
            finally:
                if opened is not None:
                    os.close(opened)

    def _file(self, lock_path: Path) -> int:
        descriptor = self._files.get(lock_path)
        if descriptor is None:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._files[lock_path] = descriptor
        return descriptor

    def after_fork_in_child(self) -> None:
        """The child shares its parent's open locks (Linux) but must never let them go:
        they are marked inherited. Its own locks go on new descriptors, since letting go
        of a range on a shared one would let go of the parent's. The inherited descriptors
        stay open: closing one would drop every POSIX lock of this process on the file."""
        self._lock = threading.Lock()
        for hold in self._holds.values():
            hold.inherited = True
        if not _OFD_LOCKS:  # POSIX locks are not inherited: the child holds nothing
            self._holds.clear()
        _INHERITED.extend(self._files.values())
        self._files = {}


_INHERITED: list[int] = []
"""Descriptors a forked child inherited: kept open, never used."""


def _set_lock(descriptor: int, kind: int, offset: int) -> None:
    if _OFD_LOCKS:
        fcntl.fcntl(descriptor, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))
    else:
        fcntl.lockf(
            descriptor, (fcntl.LOCK_UN if kind == fcntl.F_UNLCK else fcntl.LOCK_EX | fcntl.LOCK_NB), 1, offset
        )


def _held_elsewhere(descriptor: int, offset: int) -> bool:
    """Whether another process (or, on Linux, another open file description) holds the
    lock at ``offset``, found without taking it where the system can tell (Linux)."""
    if _OFD_LOCKS:
        found = fcntl.fcntl(
            descriptor, fcntl.F_OFD_GETLK, struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
        )
        return struct.unpack("@hhqqi4x", found)[0] != fcntl.F_UNLCK
    # F_GETLK's struct differs between systems: a shared lock taken and let go at once
    # tells, on a descriptor opened for reading.
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, offset)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    fcntl.lockf(descriptor, fcntl.LOCK_UN, 1, offset)
    return False


LOCKS = _SessionLocks()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LOCKS.after_fork_in_child)


@contextlib.contextmanager
def held(lock_path: Path, session_id: str) -> Iterator[None]:
    """Hold ``session_id``'s lock in ``lock_path`` for the ``with`` block (see the module)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with LOCKS.held(lock_path, session_id):
        yield


def live(lock_path: Path, session_ids: Iterable[str]) -> set[str]:
    """The sessions among ``session_ids`` whose lock in ``lock_path`` a live process holds
    (this one included): their ``session`` blocks are open. Takes no lock on Linux and
    makes no lock file (without one, no session is held). Raises ``OSError`` when the
    lock file is there but cannot be read."""
    if fcntl is None:  # pragma: no cover
        return set()
    return LOCKS.live(lock_path, session_ids)
