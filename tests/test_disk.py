"""The files the library keeps survive a power loss: their names as well as their data.

A test cannot pull the power. What it can see is each ``fsync`` made and what it was made
on: ``os.fsync`` is wrapped to record the file or directory of each call (device and
inode) and still does the real sync. A file's entry is durable once its directory has
been synced after the entry was made; a directory made for it needs its parent synced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from durable_sessions.instrument import FileResultStore
from durable_sessions.intent_log import IntentLog
from durable_sessions.journal import SqliteJournal

Identity = tuple[int, int]


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Identity]:
    """What each ``os.fsync`` from now on was made on, in order."""
    calls: list[Identity] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        status = os.fstat(fd)
        calls.append((status.st_dev, status.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


def identity(path: Path) -> Identity:
    status = os.stat(path)
    return status.st_dev, status.st_ino


def test_a_new_intent_log_is_synced_into_its_directory_once_not_per_record(
    tmp_path: Path, synced: list[Identity]
) -> None:
    """Each intent was fsync-ed, but the log's directory never was: after a power loss
    the log made at start could be gone, with every intent written durably into it."""
    path = tmp_path / "intents.jsonl"
    log = IntentLog(path)
    assert synced == [identity(tmp_path)]
    for n in range(3):
        log.write({"action_id": f"a{n}"})
    log.close()
    assert synced == [identity(tmp_path), *[identity(path)] * 3]


def test_a_stored_result_is_synced_before_its_rename_and_its_directory_after(
    tmp_path: Path, synced: list[Identity]
) -> None:
    """The store wrote a result and renamed it into place with no fsync at all: after a
    power loss the file its span's result_ref names could be missing, or empty."""
    results = tmp_path / "results"
    store = FileResultStore(results)
    uri = store.put("s1", "a1", b'{"answer": 42}')
    first = Path(uri.removeprefix("file://"))
    assert first.read_bytes() == b'{"answer": 42}'
    folder = results / "s1"
    # The directories made for it (results, then s1) each in its parent, the data, then
    # the rename into s1.
    assert synced == [identity(tmp_path), identity(results), identity(first), identity(folder)]

    synced.clear()
    second = Path(store.put("s1", "a2", b"[1, 2]").removeprefix("file://"))
    assert synced == [identity(second), identity(folder)]  # the folder is there: one sync per file
    assert sorted(path.name for path in folder.iterdir()) == ["a1.json", "a2.json"]


def test_a_journal_in_new_directories_syncs_each_into_its_parent(
    tmp_path: Path, synced: list[Identity]
) -> None:
    """SQLite syncs the directory the journal's files are in, but not the directories
    made above it: a journal in state/run-7/ could vanish with state/ after a power loss.
    (SQLite's own syncs are not os.fsync calls; the test sees the library's only.)"""
    journal = SqliteJournal(tmp_path / "state" / "run-7" / "journal.db")
    assert journal.get("s", "a") is None  # opens, and so makes, the journal
    journal.close()
    assert synced == [identity(tmp_path), identity(tmp_path / "state")]
