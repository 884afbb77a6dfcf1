"""Kept session states: a session rebuilt from the state kept in the store, and the records
stored after it, is judged exactly as by an engine that never let it go."""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import kept_fed, wait_for, written
from durable_sessions_collector.evaluator import KEEP_STATE_AFTER, Evaluator, arrival
from durable_sessions_collector.store import Store, action_row, open_store
from durable_sessions_collector.store.base import KeptState
from test_evaluator_edges import Run, action_span, by_session, random_phase, verdict_of
from test_sidecar_evaluator import stream

from durable_sessions.engine import Checker
from durable_sessions.mapping import Mapped
from durable_sessions.record import span_location
from durable_sessions.rules import select_rules
from durable_sessions.rules.snapshot import FORMAT_VERSION

PAGE = 10
"""Violations per page read back from the sidecar's session detail: fewer than the tests' sessions have."""


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = open_store(store_url)
    yield opened
    opened.close()


def judge(store: Store, evaluator: Evaluator, batch: int = 25) -> tuple[set[str], set[str]]:
    """Feed ``stream(400)`` in write batches, then end every session: the keys found."""
    items = stream(400)
    found: set[str] = set()
    for start in range(0, len(items), batch):
        with store.writer() as writer:
            for item in items[start : start + batch]:
                stored, violations = evaluator.ingest(writer, arrival(item), 0.0)
                assert stored
                found.update(v.key for v in violations)
    with store.writer() as writer:
        ended = {
            v.key for s in sorted({i.record["session_id"] for i in items}) for v in evaluator.end(writer, s)
        }
    return found, ended


@pytest.mark.parametrize("max_actions", [100_000, 4])
@pytest.mark.parametrize("keep_after", [1, 3])
def test_sessions_rebuilt_from_kept_states_are_judged_as_by_an_engine_that_held_them(
    store: Store, tmp_path: Path, keep_after: int, max_actions: int
) -> None:
    items = stream(400)
    reference = Checker(select_rules(), max_actions_per_session=max_actions)
    expected = {v.key for item in items for v in reference.feed(dict(item.record), item.where)}  # type: ignore[arg-type]
    end_expected = {v.key for v in reference.finish()}
    evaluator = Evaluator(max_sessions=1, keep_state_after=keep_after, max_actions_per_session=max_actions)
    assert judge(store, evaluator) == (expected, end_expected)
    assert evaluator.restored > 50  # sessions really were restored over and over
    # Re-feeding only the records after a kept state is far less work than whole rebuilds.
    whole = Evaluator(
        max_sessions=1, max_actions_per_session=max_actions
    )  # these sessions are too short to keep
    other = open_store(f"sqlite:///{tmp_path / 'whole.db'}")
    assert judge(other, whole) == (expected, end_expected)
    other.close()
    assert whole.restored == 0 and evaluator.refed * 4 < whole.refed


def test_a_state_the_engine_cannot_take_is_rebuilt_by_re_feeding_every_record(store: Store) -> None:
    """A kept state of another engine version, or damaged, is not restored: the session is
    rebuilt from all its records, as before there were kept states."""
    items = stream(400)
    reference = Checker(select_rules())
    expected = {v.key for item in items for v in reference.feed(dict(item.record), item.where)}  # type: ignore[arg-type]
    before, after = items[:200], items[200:]
    found: set[str] = set()
    first = Evaluator(max_sessions=1, keep_state_after=1)
    with store.writer() as writer:
        for item in before:
            found.update(v.key for v in first.ingest(writer, arrival(item), 0.0)[1])
        first.keep_states(writer, first.unkept(), float("inf"))
        damaged = 0
        for session_id in sorted({item.record["session_id"] for item in before}):
            kept = writer.kept_state(session_id)
            if kept is not None:
                writer.keep_state(session_id, kept.fed, b"not a state")
                damaged += 1
    assert damaged > 1
    restarted = Evaluator(max_sessions=1)  # keeps no state of its own of these short sessions
    with store.writer() as writer:
        for item in after:
            found.update(v.key for v in restarted.ingest(writer, arrival(item), 0.0)[1])
    assert found == expected
    assert restarted.rebuilt > 0 and restarted.restored == 0


def row(span: int) -> object:
    return action_row(
        {"session_id": "sess", "action_id": f"a{span}", "kind": "tool_call", "status": "ok", "seq": span},  # type: ignore[typeddict-item]
        "t" * 32,
        f"{span:016x}",
    )


def test_a_kept_state_holds_while_the_store_holds_the_records_it_was_kept_after(store: Store) -> None:
    with store.writer() as writer:
        for span in (1, 2):
            assert writer.add_action(row(span), 1.0)  # type: ignore[arg-type]
        writer.keep_state("sess", 2, b"two")
        kept = writer.kept_state("sess")
        assert isinstance(kept, KeptState) and (kept.fed, kept.state) == (2, b"two")
        assert writer.add_action(row(3), 1.0)  # type: ignore[arg-type]
        assert writer.kept_state("sess") == kept  # the record after it is re-fed
        assert [record["seq"] for record, _ in writer.session_records("sess", kept.through_id)] == [3]
        writer.keep_state("sess", 4, b"four")  # says 4 records: the store holds 3
        assert writer.kept_state("sess") is None
        writer.keep_state("sess", 3, b"three")
        writer.touch_session("sess", 1.0, 3)
        writer.end_session("sess", 1.0)
    with store.writer() as writer:
        assert writer.prune(10.0, 10, 100).sessions == ["sess"]
        assert writer._db.execute("SELECT count(*) FROM session_states").fetchone() == (0,)  # type: ignore[attr-defined]
        assert writer.kept_state("sess") is None


LONG_IDLE = {"evaluation__idle_s": 600}
"""For a sidecar that must not end a session between two Exports, however far apart a
slow (loaded) sidecar answers them: an end there would make the next span rebuild the
session again (its restore counted twice), and may change the status of its
end-of-session findings (more alerts: see ``Run.alerted_keys``)."""


def ended_by_a_new_start(run: Run, start_sidecar, store: Path) -> None:  # type: ignore[no-untyped-def]
    """Stop the sidecar the spans were sent to (its stop keeps the session's state again)
    and start one that ends the idle session: restoring that state."""
    run.sidecar.stop()
    run.use(start_sidecar(store))
    run.wait_all_ended()
    wait_for(lambda: run.sidecar.metric("durable_sessions_sessions_restored_total") == 1)


def test_a_long_session_held_at_a_stop_is_restored_at_the_next_start(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A stop keeps the state of the long sessions held; the next start restores it and
    judges the session's next spans as the offline checker judges the whole of it (its
    end, by a third start, too)."""
    rng = random.Random(5)
    store = tmp_path / "sessions.db"
    run = Run(start_sidecar(store, **LONG_IDLE), tmp_path)
    # Random actions around many clean model calls: a long session.
    clean = [
        action_span(10_000 + n, {"session.id": "s0", "id": f"c{n}", "kind": "llm_call", "status": "ok",
                                 "result_digest": f"sha256:{n:064x}"})
        for n in range(KEEP_STATE_AFTER)
    ]  # fmt: skip
    first = random_phase(rng, 1, 80, 1) + clean + random_phase(rng, 1, 40, 100)
    for start in range(0, len(first), 100):
        run.send(first[start : start + 100])
    run.sidecar.stop()
    assert [
        line["sessions"] for line in run.sidecar.log.lines() if line.get("event") == "session-states-kept"
    ] == [1]
    run.use(start_sidecar(store, **LONG_IDLE))
    second = random_phase(rng, 1, 60, 20_000)
    for start in range(0, len(second), 20):
        run.send(second[start : start + 20])
    assert run.sidecar.metric("durable_sessions_sessions_restored_total") == 1
    ended_by_a_new_start(run, start_sidecar, store)
    found, verdicts, keys = run.sidecar_findings(page=PAGE)
    expected = by_session(run.offline()).get("s0", set())
    assert found == {"s0": expected} and len(expected) > PAGE  # read over several pages
    assert verdicts["s0"] == verdict_of(found["s0"])
    assert sorted(run.alerted_once(len(keys))) == sorted(keys)


def test_a_first_attempt_without_attempts_is_remembered_across_a_restart(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Attempt 1 failed, its span without ``agent.action.attempts`` (as the instrumentation
    writes a first attempt), then attempt 2 failed, in a long session whose state a stop
    keeps; after the restart an attempt 1 of the action succeeds. The restored session
    knows attempt 1 was seen, as the offline checker over the whole file does: a second
    action under one id."""
    store = tmp_path / "sessions.db"
    run = Run(start_sidecar(store, **LONG_IDLE), tmp_path)
    retry = {"session.id": "s0", "id": "t1", "kind": "tool_call", "retryable": True, "max_attempts": 3}
    clean = [
        action_span(10_000 + n, {"session.id": "s0", "id": f"c{n}", "kind": "llm_call", "status": "ok",
                                 "result_digest": f"sha256:{n:064x}"})
        for n in range(KEEP_STATE_AFTER)
    ]  # fmt: skip
    first = [
        action_span(1, {**retry, "status": "error"}, error=True),
        action_span(2, {**retry, "status": "error", "attempts": 2}, error=True),
        *clean,
    ]
    for start in range(0, len(first), 100):
        run.send(first[start : start + 100])
    run.sidecar.stop()
    run.use(start_sidecar(store, **LONG_IDLE))
    run.send([action_span(3, {**retry, "status": "ok", "attempts": 1})])
    assert run.sidecar.metric("durable_sessions_sessions_restored_total") == 1
    ended_by_a_new_start(run, start_sidecar, store)
    found, verdicts, _ = run.sidecar_findings()
    assert found == {"s0": by_session(run.offline()).get("s0", set())}
    assert {(rule, action_id) for rule, action_id, *_ in found["s0"]} == {("duplicate-action-id", "t1")}
    assert verdicts["s0"] == "unrecoverable"


def as_version(state: bytes, version: int) -> bytes:
    """A kept state as written with the format's ``version`` number (and its checksum)."""
    body = state[:4] + struct.pack(">H", version) + state[6:-4]
    return body + struct.pack(">I", zlib.crc32(body))


@pytest.mark.parametrize("version", [1, FORMAT_VERSION])
def test_a_state_of_format_version_1_is_rebuilt_and_knows_an_unwritten_first_attempt(
    store: Store, version: int
) -> None:
    """Version 1 kept attempt numbers as written ({2} for an unwritten attempt 1 and
    attempt 2): a restarted sidecar does not restore such a state but re-feeds the
    session's records, and judges attempt 1 again as a second action under the id, as
    it does from a state of this version."""
    retry = {"session_id": "s", "action_id": "t1", "kind": "tool_call", "retryable": True, "max_attempts": 3}
    records = [{**retry, "status": "error"}, {**retry, "status": "error", "attempts": 2}]
    records.append({**retry, "status": "ok", "attempts": 1})
    items = [Mapped(r, span_location("1" * 32, f"{n:016x}")) for n, r in enumerate(records, 1)]  # type: ignore[arg-type]
    first = Evaluator(keep_state_after=1)
    with store.writer() as writer:
        for item in items[:2]:
            assert first.ingest(writer, arrival(item), 0.0) == (True, [])
        kept = writer.kept_state("s")
        assert kept is not None and kept.fed == 2
        writer.keep_state("s", kept.fed, as_version(kept.state, version))
    restarted = Evaluator(keep_state_after=1)
    with store.writer() as writer:
        stored, violations = restarted.ingest(writer, arrival(items[2]), 0.0)
    assert stored and [v.rule for v in violations] == ["duplicate-action-id"]
    assert restarted.rebuilt == 1
    assert restarted.restored == (version == FORMAT_VERSION)
    assert restarted.refed == (2 if version == 1 else 0)


def tool_call(session: str, n: int) -> Mapped:
    record = {"session_id": session, "action_id": f"c{n}", "kind": "tool_call", "status": "ok"}
    return Mapped(record, span_location("t" * 32, f"{session}{n:015x}"[-16:]), [])  # type: ignore[arg-type]


def test_an_evicted_session_s_state_is_kept_also_when_it_was_rebuilt_in_a_later_batch(store: Store) -> None:
    # An evicted session's state is kept only if the store still holds what the engine was
    # fed (see test_sidecar_postgres_store). A session rebuilt in a batch of a later time
    # than its row's must still pass that, on a store of one writer too.
    evaluator = Evaluator(max_sessions=1, keep_state_after=1)
    written(store, evaluator, *(tool_call("S", n) for n in range(5)), now=1.0)  # kept at 4
    written(store, evaluator, tool_call("T", 0), now=2.0)  # evicts S: kept at 5
    assert kept_fed(store, "S") == 5
    written(store, evaluator, *(tool_call("S", n) for n in range(5, 9)), now=3.0)  # rebuilt; kept at 7
    assert kept_fed(store, "S") == 7
    written(store, evaluator, tool_call("T", 1), now=4.0)  # evicts S, fed 9
    assert kept_fed(store, "S") == 9
