"""The native fold leaves a session's memory exactly as ``SessionState.remember`` does.

``durable_sessions._memory.Fold.remember`` folds every checked action into its session
in C. These tests feed generated actions (odd types, redacted results, given digests,
retries, keys, several incarnations, line and span locations, a tiny action limit) to
two sessions, one folded by the Python reference and one natively, and compare every
map the rules read after each action. They also check the C SHA-256 against hashlib and
that whole checks report the same findings either way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.check import check_paths
from durable_sessions.digest import digest_value
from durable_sessions.engine import Checker
from durable_sessions.record import Location, line_location
from durable_sessions.rules import select_rules, state
from durable_sessions.rules.state import SessionState, Symbols, remembering
from tests.support.actions import actions, session_memory
from tests.support.senders import require_native

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def native_remember() -> Any:
    require_native("_memory")
    remember = remembering()
    assert remember is not SessionState.remember, "the native fold should be selected"
    return remember


class FullSymbols(Symbols):
    """A symbol table that has no room for strings starting with ``new``."""

    def number(self, text: str) -> int | None:
        return None if text.startswith("new") else super().number(text)


class FullIncarnations(SessionState):
    """A session whose incarnation table has no room for incarnations starting with ``new``."""

    __slots__ = ()

    def incarnation_index(self, incarnation: str) -> int | None:
        return None if incarnation.startswith("new") else super().incarnation_index(incarnation)


def fold_both(
    native_remember: Any,
    steps: list,
    *,
    max_actions: int,
    symbols: type[Symbols],
    session: type[SessionState] = SessionState,
) -> None:
    python = session("s-1", max_actions=max_actions, symbols=symbols())
    native = session("s-1", max_actions=max_actions, symbols=symbols())
    for record, where in steps:
        prior = python.recall(record["action_id"])
        assert native.recall(record["action_id"]) == prior
        SessionState.remember(python, dict(record), where, prior)
        native_remember(native, dict(record), where, prior)
        assert session_memory(native) == session_memory(python), (record, where)
    for action_id in ("a1", "a2", "a3", "a4"):
        assert native.recall(action_id) == python.recall(action_id)


@settings(max_examples=400, deadline=None)
@given(steps=actions, max_actions=st.sampled_from([2, 100_000]))
def test_native_fold_leaves_the_same_memory(native_remember: Any, steps: list, max_actions: int) -> None:
    fold_both(native_remember, steps, max_actions=max_actions, symbols=Symbols)


@settings(max_examples=100, deadline=None)
@given(steps=actions.map(lambda steps: [({**r, "incarnation": "new-run"}, w) for r, w in steps]))
def test_native_fold_when_the_symbol_table_is_full(native_remember: Any, steps: list) -> None:
    fold_both(native_remember, steps, max_actions=100_000, symbols=FullSymbols)


@settings(max_examples=100, deadline=None)
@given(steps=actions.map(lambda steps: [({**r, "incarnation": "new-run"}, w) for r, w in steps]))
def test_native_fold_when_the_incarnation_table_is_full(native_remember: Any, steps: list) -> None:
    fold_both(native_remember, steps, max_actions=100_000, symbols=Symbols, session=FullIncarnations)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from("abcdefgh"), st.sampled_from([None, "k1", "k2", "k3", "k4"]))),
    max_actions=st.integers(1, 4),
)
def test_past_its_limit_a_session_forgets_its_oldest_first(
    native_remember: Any, steps: list, max_actions: int
) -> None:
    """The oldest action ids and keys are looked up a batch at a time (finding a dict's
    first key one at a time made each action past the limit cost up to 15 times as
    much): what is forgotten is still the oldest, in both folds, across batches."""
    with patch.object(state, "FORGET_BATCH", 2):
        for remember in (SessionState.remember, native_remember):
            session = SessionState("s-1", max_actions=max_actions)
            expected_actions: dict[str, None] = {}
            expected_keys: dict[str, None] = {}
            for action_id, key in steps:
                record = {"session_id": "s-1", "action_id": action_id, "kind": "payment", "status": "ok"}
                if key is not None:
                    record["idempotency_key"] = key
                remember(session, record, line_location("run.jsonl", 1), session.recall(action_id))
                for expected, new in ((expected_actions, action_id), (expected_keys, key)):
                    if new is not None and new not in expected:
                        expected[new] = None
                        if len(expected) > max_actions:
                            del expected[next(iter(expected))]
                assert list(session.actions) == list(expected_actions)
                assert list(session.keys) == list(expected_keys)


def test_native_fold_packs_what_the_rules_later_read(native_remember: Any) -> None:
    """A recorded result, read back: the fingerprint is the SHA-256 one, the flags set."""
    session = SessionState("s-1")
    record = {"session_id": "s-1", "action_id": "p1", "kind": "payment", "status": "ok", "result": {"id": 4}}
    native_remember(session, record, line_location("run.jsonl", 9), None)
    memory = session.recall("p1")
    assert memory is not None
    assert (memory.kind, memory.status, memory.where) == ("payment", "ok", Location("run.jsonl", 9))
    assert memory.recorded and memory.effect_done and not memory.retryable
    assert memory.outcome == int(digest_value({"id": 4})[7:23], 16)


def test_native_fold_hands_unusual_inputs_to_the_reference(native_remember: Any) -> None:
    """A record that is not a plain dict is folded by the Python code, with the same result."""

    class Record(dict):
        pass

    record = {"session_id": "s-1", "action_id": "a1", "kind": "email", "status": "ok", "result": None}
    python, native = SessionState("s-1"), SessionState("s-1")
    SessionState.remember(python, record, line_location("f", 1), None)
    native_remember(native, Record(record), line_location("f", 1), None)
    assert session_memory(native) == session_memory(python)


def sha256_prefix(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@pytest.mark.parametrize("accelerated", [True, False], ids=["cpu-sha-extensions-if-any", "portable"])
@pytest.mark.parametrize("length", [0, 1, 31, 55, 56, 63, 64, 65, 119, 120, 128, 1000])
def test_sha256_prefix_is_the_first_64_bits_of_sha256(length: int, accelerated: bool) -> None:
    require_native("_memory")
    from durable_sessions import _memory

    data = bytes((i * 37 + length) % 256 for i in range(length))
    assert _memory.sha256_prefix(data, accelerated) == sha256_prefix(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_sha256_prefix_on_generated_bytes(data: bytes) -> None:
    require_native("_memory")
    from durable_sessions import _memory

    assert _memory.sha256_prefix(data) == sha256_prefix(data)
    assert _memory.sha256_prefix(data, False) == sha256_prefix(data)


def findings(paths: list[Path]) -> list[str]:
    return [repr(v) for v in check_paths(map(str, paths), Checker(select_rules("all")))]


def test_whole_checks_report_the_same_with_and_without_the_fold(
    native_remember: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = sorted(EXAMPLES.rglob("*.jsonl"))
    assert len(logs) > 20
    native = findings(logs)
    monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", "false")
    assert remembering() is SessionState.remember
    python = findings(logs)
    assert native == python
    assert len(native) > 20


# -- found under AddressSanitizer/UndefinedBehaviorSanitizer -------------------------------


def _fold_arguments(**layout: int) -> tuple[tuple, dict[str, Any]]:
    """The arguments state.py makes its Fold with, with ``layout`` changed."""
    from durable_sessions.rules import state

    return (state.ActionMemory, state.ActionDetails), {
        "python_remember": SessionState.remember,
        "side_effecting": state.kinds.SIDE_EFFECTING,
        "redacted": state.REDACTED,
        "no_attempts": state._NO_ATTEMPTS,
        "dumps": state.orjson.dumps,
        "dumps_option": state.CANONICAL,
        "fingerprint": state.fingerprint,
        "flag_bits": (
            state._RETRYABLE,
            state._RECORDED,
            state._EFFECT_DONE,
            state._HAS_DETAILS,
            state._HAS_OUTCOME,
        ),
        "incarnation_shift": state._INCARNATION_SHIFT,
        "outcome_shift": state._OUTCOME_SHIFT,
        "position_shift": state._POSITION_SHIFT,
        **layout,
    }


_RECORD = {"session_id": "s-1", "action_id": "a1", "kind": "payment", "status": "ok", "result": {"id": 4}}


def _fold_twice(remember: Any) -> dict[str, Any]:
    session = SessionState("s-1")
    remember(session, dict(_RECORD), line_location("run.jsonl", 7), None)
    remember(session, dict(_RECORD), line_location("run.jsonl", 9), session.recall("a1"))
    return session_memory(session)


def test_a_failed_reinit_leaves_the_fold_as_it_was(native_remember: Any) -> None:
    # Fold.__init__ wrote the shifts before checking them: after the ValueError, the fold
    # shifted words past its 256 bits (a stack-buffer-overflow).
    from durable_sessions._memory import Fold

    args, kwargs = _fold_arguments()
    fold = Fold(*args, **kwargs)
    expected = _fold_twice(SessionState.remember)
    assert _fold_twice(fold.remember) == expected
    bad_args, bad_kwargs = _fold_arguments(outcome_shift=500, position_shift=2000)
    with pytest.raises(ValueError, match="does not fit"):
        fold.__init__(*bad_args, **bad_kwargs)  # type: ignore[misc]
    assert _fold_twice(fold.remember) == expected


@pytest.mark.parametrize("layout", [{"outcome_shift": -1}, {"outcome_shift": -200, "position_shift": -100}])
def test_a_negative_shift_is_refused(native_remember: Any, layout: dict[str, int]) -> None:
    from durable_sessions._memory import Fold

    args, kwargs = _fold_arguments(**layout)
    with pytest.raises(ValueError, match="does not fit"):
        Fold(*args, **kwargs)


def test_a_fold_made_without_init_raises_instead_of_crashing(native_remember: Any) -> None:
    from durable_sessions._memory import Fold

    fold = Fold.__new__(Fold)
    with pytest.raises(RuntimeError, match="not initialised"):
        fold.remember(SessionState("s-1"), dict(_RECORD), line_location("run.jsonl", 7), None)


def test_a_prior_whose_where_is_not_a_location_goes_to_the_reference(native_remember: Any) -> None:
    # The fold cites a logged action where it first appeared (prior.where) and read that
    # as a 4-tuple without checking it.
    session = SessionState("s-1")
    native_remember(session, dict(_RECORD), line_location("run.jsonl", 7), None)
    prior = session.recall("a1")
    assert prior is not None
    odd = prior._replace(where=None)
    with pytest.raises(AttributeError):
        SessionState.remember(SessionState("s-1"), dict(_RECORD), line_location("run.jsonl", 9), odd)
    with pytest.raises(AttributeError):
        native_remember(session, dict(_RECORD), line_location("run.jsonl", 9), odd)
