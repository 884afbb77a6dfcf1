"""Hypothesis strategies for action records as the engine meets them: odd field types,
redacted results, given digests, retries, keys, several incarnations, and line, span and
malformed locations; and :func:`session_memory`, to compare what two sessions remember.
Shared by the tests that hold a native step to its Python reference."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from durable_sessions.digest import digest_value
from durable_sessions.record import REDACTED, Location, line_location, span_location
from durable_sessions.rules.state import SessionState

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
        "sha256:" + digest_value("ok")[7:].upper(),  # one digest in either case
        "sha256:" + "A" * 64,
        "sha256:" + "aB" * 32,
        "SHA256:" + "a" * 64,
        "sha256:" + "g" * 64,
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
    "attempts": st.sampled_from([1, 2, 3, 62, 63, 70, True, "2", 0, None]),
    "idempotency_key": st.sampled_from(["k1", "k2", "", 5]),
    "prompt_digest": st.sampled_from(["p1", "p2", ""]),
    "incarnation": st.sampled_from(["run-1", "run-2", "", 7, None]),
    "ts": st.sampled_from(["2026-11-29T10:00:00Z", 1_700_000_000, "soon"]),
    "max_attempts": st.sampled_from([1, 3, 63, 0, -1, True, 3.0, "3", float("inf"), 2**70, None]),
    "cacheable": any_value,
    "cache_key": st.sampled_from(["c1", "", 4, None]),
    "ttl_s": st.sampled_from([60, 0, -5, 60.0, 60.5, True, "60", None]),
    "replay": st.sampled_from(["skip", "run", "", None, True]),
    "on_failure": st.sampled_from(["ask_user", "abort", "compensate", "retry", "", 3, None]),
    "cache_hit": any_value,
    "value_limit": st.sampled_from([4, 10, 0, None, "4", True]),
    "result_length": st.sampled_from([4, 10, 0, None, "4", True]),
    "mapping_problems": st.sampled_from([(), ("a span problem — it cannot be checked",), ["listed"], None]),
}
IDENTIFIERS = {
    "session_id": st.just("s-1"),
    "action_id": st.sampled_from(["a1", "a2", "a3", "a4"]),
    "kind": st.sampled_from(["tool_call", "payment", "email", "user_prompt", "llm_call", "odd kind"]),
    "status": st.sampled_from(["ok", "ok", "error", "started", "done"]),
}
records = st.fixed_dictionaries(IDENTIFIERS, optional=OPTIONAL)
retries = st.fixed_dictionaries(
    {**IDENTIFIERS, "retryable": st.just(True), "max_attempts": st.just(3)},
    optional={
        "attempts": st.sampled_from([None, 1, 2, 2, 3]),
        "result": st.sampled_from([1, 2]),
        "incarnation": st.sampled_from(["run-1", "run-2"]),
        "replayed": st.just(True),
    },
)
"""Attempts of retried actions, numbered or not: the first attempt is often written without
``attempts`` (absent or null), as the instrumentation writes it, among numbered ones."""
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
locations = st.one_of(line_locations, span_locations, odd_locations)
actions = st.lists(st.tuples(st.one_of(records, retries), locations), max_size=25)


def session_memory(session: SessionState) -> dict[str, Any]:
    """Every map of a session's memory, in order, for comparing two sessions."""
    return {
        "actions": list(session.actions.items()),
        "details": list(session.details.items()),
        "keys": list(session.keys.items()),
        "answered_prompts": list(session.answered_prompts.items()),
        "exhausted_retries": list(session.exhausted_retries.items()),
        "unfinished_effects": list(session.unfinished_effects.items()),
        "failure_runs": list(session.failure_runs.items()),
        "incarnation": session.incarnation,
        "symbols": list(session.symbols.texts),
        "incarnations": list(session.incarnations),
    }
