"""Hypothesis strategies for OTLP/JSON attribute values (``AnyValue``), well-formed or not:
what a reader of OTLP/JSON must take without raising, and judge as the sidecar does."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

VALUE_KINDS = ("stringValue", "boolValue", "intValue", "doubleValue", "bytesValue")
TRICKY_STRINGS = ("3", "-1", "3.0", "1e2", "NaN", "Infinity", "2", "STATUS_CODE_ERROR")
"""Strings that look like the numbers, enums and codes a reader might coerce them to."""


def json_scalars(*more_strings: str) -> SearchStrategy[object]:
    """Any JSON scalar, integers past 64 bits included, and the tricky strings."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
        st.sampled_from([*TRICKY_STRINGS, *more_strings]),
    )


def any_values(
    inner: SearchStrategy[object],
    odd: SearchStrategy[object],
    *,
    kinds: tuple[str, ...] = VALUE_KINDS,
    max_leaves: int,
) -> SearchStrategy[object]:
    """``{kind: inner}`` values and ``odd`` ones, nested in arrays and key-value lists."""
    return st.recursive(
        st.one_of(st.builds(lambda kind, value: {kind: value}, st.sampled_from(kinds), inner), odd),
        lambda children: st.one_of(
            st.builds(lambda values: {"arrayValue": {"values": values}}, st.lists(children, max_size=3)),
            st.builds(
                lambda values: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in values]}},
                st.lists(st.tuples(st.text(max_size=3), children), max_size=3),
            ),
        ),
        max_leaves=max_leaves,
    )
