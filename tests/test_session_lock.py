"""One live process per session: the lock a journaled ``session`` block holds."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from durable_sessions.instrument import session
from durable_sessions.journal import SqliteJournal
from durable_sessions.session_lock import SessionInUse, lock_path_of

ENTER = """
import sys
from durable_sessions.instrument import session
from durable_sessions.journal import SqliteJournal
from durable_sessions.session_lock import SessionInUse
try:
    with session(sys.argv[2], journal=SqliteJournal(sys.argv[1])):
        print("entered")
except SessionInUse:
    print("refused")
"""

HOLD = """
import sys, time
from pathlib import Path
from durable_sessions.instrument import session
from durable_sessions.journal import SqliteJournal
with session(sys.argv[2], journal=SqliteJournal(sys.argv[1])):
    Path(sys.argv[3]).touch()
    time.sleep(600)
"""


def another_process_enters(journal: Path, session_id: str) -> str:
    """What another process gets entering ``session_id``: ``entered`` or ``refused``."""
    done = subprocess.run(
        [sys.executable, "-c", ENTER, str(journal), session_id], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "journal.db"


def test_the_session_of_a_process_killed_with_sigkill_can_be_resumed_at_once(
    journal_path: Path, tmp_path: Path
) -> None:
    """The kernel lets go of a dead holder's lock: no lease to wait out after a crash."""
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(journal_path), "s-1", str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = pytest.raises(SessionInUse, match="'s-1' is open in another live process")
        with refused, session("s-1", journal=SqliteJournal(journal_path)):
            pass
        assert another_process_enters(journal_path, "s-2") == "entered"  # other sessions are free
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with session("s-1", journal=SqliteJournal(journal_path)) as resumed:
        assert resumed == "s-1"


def test_blocks_and_threads_of_one_process_share_the_hold_until_the_last_ends(journal_path: Path) -> None:
    journal = SqliteJournal(journal_path)
    with session("s-1", journal=journal):
        with session("s-1", journal=journal):
            entered_in_thread: list[str] = []

            def enter() -> None:
                with session("s-1", journal=SqliteJournal(journal_path)):
                    entered_in_thread.append("s-1")

            thread = threading.Thread(target=enter)
            thread.start()
            thread.join()
            assert entered_in_thread == ["s-1"]
        assert another_process_enters(journal_path, "s-1") == "refused"  # the outer block still holds it
    assert another_process_enters(journal_path, "s-1") == "entered"


def test_two_spellings_of_one_journal_are_one_hold(
    journal_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(journal_path.parent.parent)
    with session("s-1", journal=SqliteJournal(journal_path)):
        with session("s-1", journal=SqliteJournal(Path("state") / ".." / "state" / "journal.db")):
            pass
        assert another_process_enters(journal_path, "s-1") == "refused"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="open file description locks are Linux's")
def test_a_child_forked_inside_the_block_shares_the_hold_and_never_drops_it(journal_path: Path) -> None:
    """A worker forked inside the block may enter the session; its end does not let go of
    the parent's lock."""
    journal = SqliteJournal(journal_path)
    with session("s-1", journal=journal):
        pid = os.fork()
        if pid == 0:  # the child
            try:
                with session("s-1", journal=journal):
                    pass
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert another_process_enters(journal_path, "s-1") == "refused"
    assert another_process_enters(journal_path, "s-1") == "entered"


def test_exclusive_false_neither_holds_nor_is_refused(journal_path: Path) -> None:
    with session("s-1", journal=SqliteJournal(journal_path), exclusive=False):
        assert another_process_enters(journal_path, "s-1") == "entered"


def test_a_lock_that_cannot_be_taken_fails_open(journal_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A lock file that cannot be opened (here a directory in its place) is logged and the
    block runs, as without a lock."""
    journal_path.parent.mkdir(parents=True)
    lock_path_of(journal_path).mkdir()
    logged = caplog.at_level(logging.WARNING, logger="durable_sessions")
    with logged, session("s-1", journal=SqliteJournal(journal_path)) as entered:
        assert entered == "s-1"
    assert "cannot lock session 's-1'" in caplog.text and "runs unlocked" in caplog.text


def test_a_journal_opened_read_only_holds_nothing(journal_path: Path) -> None:
    SqliteJournal(journal_path).entries()  # the file exists
    with session("s-1", journal=SqliteJournal(journal_path, readonly=True)):
        assert another_process_enters(journal_path, "s-1") == "entered"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_process_that_opens_many_journals_in_turn_keeps_no_descriptor_of_theirs(tmp_path: Path) -> None:
    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_descriptors()
    for n in range(50):
        journal = SqliteJournal(tmp_path / f"j{n}" / "journal.db")
        with session("s-1", journal=journal):
            pass
        journal.close()
    assert open_descriptors() - before < 5


def _enter_in_a_worker(path: str) -> None:
    with session("trip-42", journal=SqliteJournal(path)):
        pass


def test_session_in_use_in_a_process_pool_worker_reaches_the_caller(tmp_path: Path) -> None:
    """SessionInUse pickled as its message, which its constructor cannot take: a process
    pool's worker that raised it broke the pool (BrokenProcessPool) instead."""
    journal = SqliteJournal(tmp_path / "journal.db")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        pool.submit(os.getpid).result(timeout=60)  # the worker is forked before the hold: it shares none
        with session("trip-42", journal=journal), pytest.raises(SessionInUse) as raised:
            pool.submit(_enter_in_a_worker, str(journal.path)).result(timeout=60)
        assert raised.value.session_id == "trip-42"
        assert raised.value.lock_path == lock_path_of(journal.path.resolve())
        assert pickle.loads(pickle.dumps(raised.value)).args == raised.value.args


FORK_AND_DIE = """
import os, signal, sys, time
from pathlib import Path
from durable_sessions.instrument import session
from durable_sessions.journal import SqliteJournal
with session(sys.argv[2], journal=SqliteJournal(sys.argv[1])):
    if os.fork() == 0:  # an idle pool worker: it lives until told to go
        while not Path(sys.argv[3]).exists():
            time.sleep(0.05)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="open file description locks are Linux's")
def test_a_child_forked_inside_the_block_keeps_the_hold_after_its_parent_died(
    journal_path: Path, tmp_path: Path
) -> None:
    """What recovery.md says: the hold goes with the last process that shares it, so a
    child that outlives its crashed parent keeps the session held until it ends."""
    go = tmp_path / "go"
    parent = subprocess.run(
        [sys.executable, "-c", FORK_AND_DIE, str(journal_path), "s-1", str(go)], timeout=60
    )
    assert parent.returncode == -signal.SIGKILL
    try:
        assert another_process_enters(journal_path, "s-1") == "refused"
    finally:
        go.touch()
    deadline = time.monotonic() + 30
    while another_process_enters(journal_path, "s-1") == "refused":
        assert time.monotonic() < deadline, "the orphaned child never let the session go"
        time.sleep(0.1)


class _RecordAndReplayOnly:
    """A journal of the protocol's two methods (its own database's, say): no ``hold``."""

    def __init__(self, path: Path) -> None:
        self._journal = SqliteJournal(path)
        self.get, self.put = self._journal.get, self._journal.put


def test_a_journal_without_hold_holds_nothing(journal_path: Path) -> None:
    """What recovery.md says of a journal of get and put only: its session blocks hold no
    session, so another live process is not refused."""
    with session("s-1", journal=_RecordAndReplayOnly(journal_path)):  # type: ignore[arg-type]
        assert another_process_enters(journal_path, "s-1") == "entered"
    with session("s-1", journal=SqliteJournal(journal_path)):
        assert another_process_enters(journal_path, "s-1") == "refused"


def test_a_lock_file_that_keeps_failing_is_logged_once_until_it_works_again(
    journal_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that opens a session block per request on a read-only file system would
    otherwise log a warning per request."""
    journal_path.parent.mkdir(parents=True)
    lock_path_of(journal_path).mkdir()  # cannot be opened as a file, every time
    journal = SqliteJournal(journal_path)
    with caplog.at_level(logging.WARNING, logger="durable_sessions"):
        for n in range(20):
            with session(f"s-{n}", journal=journal):
                pass
        [warning] = [record.getMessage() for record in caplog.records]
        assert "cannot lock session 's-0'" in warning and "repeats of this error are not logged" in warning
        caplog.clear()
        lock_path_of(journal_path).rmdir()
        with session("s-20", journal=journal):
            assert another_process_enters(journal_path, "s-20") == "refused"  # locked again
    [recovered] = [record.getMessage() for record in caplog.records]
    assert (
        f"the lock file {lock_path_of(journal_path)} works again (19 more sessions ran unlocked" in recovered
    )
