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

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.check import check_paths
from durable_sessions.digest import digest_value
from durable_sessions.engine import Checker
from durable_sessions.record import REDACTED, Location, line_location, span_location
from durable_sessions.rules import select_rules
from durable_sessions.rules.state import SessionState, Symbols, remembering
from tests.support.senders import require_native

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def native_remember() -> Any:
    require_native("_memory")
    remember = remembering()
    assert remember is not SessionState.remember, "the native fold should be selected"
    return remember


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
any_value = st.one_of(json_values, st.sampled_from([True, "yes", 1, 0, "", None, 2**70, -5]))
digests = st.sampled_from(
    [
        digest_value({"a": 1}),
        digest_value("ok"),
        "sha256:" + "A" * 64,
        "sha256:abc",
        "md5:0123",
        "",
        7,
    ]
)
OPTIONAL = {
    "retryable": any_value,
    "replayed": any_value,
    "side_effects": any_value,
    "result": st.one_of(json_values, st.just(REDACTED), st.just(2**80)),
    "redacted": any_value,
    "result_ref": st.sampled_from(["", "blob://r", None, 3]),
    "result_digest": digests,
    "attempts": st.sampled_from([1, 2, 3, 62, 63, 70, True, "2", 0]),
    "idempotency_key": st.sampled_from(["k1", "k2", "", 5]),
    "prompt_digest": st.sampled_from(["p1", "p2", ""]),
    "incarnation": st.sampled_from(["run-1", "run-2", "", 7, None]),
    "ts": st.sampled_from(["2026-11-29T10:00:00Z", 1_700_000_000, "soon"]),
}
records = st.fixed_dictionaries(
    {
        "session_id": st.just("s-1"),
        "action_id": st.sampled_from(["a1", "a2", "a3", "a4"]),
        "kind": st.sampled_from(["tool_call", "payment", "email", "user_prompt", "llm_call", "odd kind"]),
        "status": st.sampled_from(["ok", "ok", "error", "started", "done"]),
    },
    optional=OPTIONAL,
)
line_locations = st.builds(
    line_location,
    st.sampled_from(["run.jsonl", "other.jsonl", ""]),
    st.one_of(st.integers(0, 5000), st.just(2**70)),
)
span_locations = st.builds(
    span_location,
    st.sampled_from(["4bf92f3577b34da6a3ce929d0e0e4736", ""]),
    st.sampled_from(
        ["00f067aa0ba902b7", "ABCDEF", "1", "zz", "-1f", " 1f", "0x1f", "1_0", "f" * 17, "", "é1"]
    ),
)
odd_locations = st.sampled_from(
    [Location(), Location("run.jsonl"), Location(None, 3), Location("x", -2), Location("x", True)]
)
actions = st.lists(st.tuples(records, st.one_of(line_locations, span_locations, odd_locations)), max_size=25)


class FullSymbols(Symbols):
    """A symbol table that has no room for strings starting with ``new``."""

    def number(self, text: str) -> int | None:
        return None if text.startswith("new") else super().number(text)


def memory_of(session: SessionState) -> dict[str, Any]:
    return {
        "actions": list(session.actions.items()),
        "details": list(session.details.items()),
        "keys": list(session.keys.items()),
        "answered_prompts": list(session.answered_prompts.items()),
        "incarnation": session.incarnation,
        "symbols": list(session.symbols.texts),
    }


def fold_both(native_remember: Any, steps: list, *, max_actions: int, symbols: type[Symbols]) -> None:
    python = SessionState("s-1", max_actions=max_actions, symbols=symbols())
    native = SessionState("s-1", max_actions=max_actions, symbols=symbols())
    for record, where in steps:
        prior = python.recall(record["action_id"])
        assert native.recall(record["action_id"]) == prior
        SessionState.remember(python, dict(record), where, prior)
        native_remember(native, dict(record), where, prior)
        assert memory_of(native) == memory_of(python), (record, where)
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
    assert memory_of(native) == memory_of(python)


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
