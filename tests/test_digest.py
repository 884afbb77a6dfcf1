"""Canonical JSON without recursion (``digest._canonical_text``) writes what the standard
library writes, at any depth: a digest of a deeply nested result must equal the digest
of the same value made where Python's recursion limit was not reached."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.digest import _canonical_text, canonical_json, digest_value, fingerprint, outcome_json

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=30,
)


def standard(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES)
def test_the_text_is_the_standard_librarys(value: Any) -> None:
    assert _canonical_text(value) == standard(value)


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value, "a": level}
    return value


def test_a_value_past_the_recursion_limit_has_the_text_it_would_have_had() -> None:
    deep = nested(5000, 10**30)
    expected = str(10**30)
    for level in range(5000):
        expected = f"[{expected}]" if level % 2 else f'{{"a":{level},"k":{expected}}}'
    assert canonical_json(deep).decode() == expected
    assert digest_value(deep) == digest_value(nested(5000, 10**30)) != digest_value(nested(5000, 10**30 + 1))
    assert fingerprint(deep) != fingerprint(nested(5000, 10**30 + 1))


def test_non_finite_numbers_deep_down_are_refused_as_at_the_top() -> None:
    with pytest.raises(ValueError):
        _canonical_text(nested(3000, float("nan")))
    with pytest.raises(ValueError):
        outcome_json(nested(3000, float("inf")))


def test_what_is_not_json_still_gets_a_digest_at_any_depth() -> None:
    assert digest_value(nested(3000, {1, 2})) == digest_value(nested(3000, {1, 2}))
    assert digest_value(nested(3000, {1, 2})).startswith("sha256:")
