"""Canonical JSON without recursion (``digest._canonical_text``) writes what the standard
library writes, at any depth: a digest of a deeply nested result must equal the digest
of the same value made where Python's recursion limit was not reached."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.digest import (
    _canonical_text,
    canonical_json,
    digest_fingerprint,
    digest_value,
    fingerprint,
    normal_digest,
    outcome_json,
    sha256_digest,
)

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


@dataclasses.dataclass
class Quote:
    price: int
    currency: str
    legs: list[Any] = dataclasses.field(default_factory=list)


def test_a_dataclass_is_written_as_the_dictionary_of_its_fields_keys_sorted() -> None:
    """orjson sorts dictionary keys but not dataclass fields: a dataclass and the
    dictionary replay hands back for it had two digests, a false replay-mismatch."""
    quote = Quote(2400, "GBP", [Quote(1, "EUR")])
    as_dict = dataclasses.asdict(quote)
    assert canonical_json(quote) == canonical_json(as_dict) == standard(as_dict).encode()
    assert outcome_json({"z": quote, "a": [quote]}) == standard({"z": as_dict, "a": [as_dict]}).encode()
    assert digest_value(quote) == digest_value(as_dict)
    # the paths for what orjson cannot write: an integer past 64 bits, nesting past recursion
    huge = Quote(10**30, "GBP")
    assert canonical_json(huge).decode() == standard(dataclasses.asdict(huge))
    assert _canonical_text(nested(3, huge)) == standard(nested(3, dataclasses.asdict(huge)))


def test_a_dataclass_result_is_recorded_as_text_that_hashes_to_its_digest() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from durable_sessions import instrument
    from durable_sessions.digest import digest_bytes

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with (
        instrument.session("s-1"),
        instrument.action("quote", kind="external_read", tracer_provider=provider) as act,
    ):
        act.record(Quote(2400, "GBP"))
    (span,) = exporter.get_finished_spans()
    text = span.attributes["agent.action.result"]
    assert text == '{"currency":"GBP","legs":[],"price":2400}'
    assert span.attributes["agent.action.result_digest"] == digest_bytes(text.encode())


@pytest.mark.parametrize("in_order", [False, True])
def test_an_outcome_whose_keys_share_a_text_is_refused_whoever_writes_it(in_order: bool) -> None:
    """orjson writes the first; a key past 64 bits makes the standard library write the
    second (in order: sorted, its int and str keys cannot even be compared)."""
    with pytest.raises(ValueError, match="share the text '1'"):
        outcome_json({1: "int", "1": "text"}, in_order=in_order)
    with pytest.raises((ValueError, TypeError)):
        outcome_json({10**20: "big", "100000000000000000000": "text"}, in_order=in_order)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_an_outcome_in_order_is_the_canonical_one_read_in_its_own_order(value: Any) -> None:
    """The journal's text (keys in order) and the span's (sorted) are one outcome."""
    kept = json.loads(outcome_json(value, in_order=True))
    assert kept == value and key_order(kept) == key_order(value)
    assert canonical_json(kept) == outcome_json(value)


def key_order(value: Any) -> Any:
    """The keys of every dictionary in ``value``, in their order."""
    if isinstance(value, dict):
        return [(key, key_order(member)) for key, member in value.items()]
    if isinstance(value, list):
        return [key_order(member) for member in value]
    return None


def test_an_outcome_past_the_recursion_limit_is_written_in_order_too() -> None:
    deep = nested(3000, 1)  # a list of {"k": ..., "a": level} at the top
    assert outcome_json(deep, in_order=True).startswith(b'[{"k":[{"k":')
    assert outcome_json(deep).startswith(b'[{"a":2998,"k":[{"a":2996,')
    assert len(outcome_json(deep, in_order=True)) == len(outcome_json(deep))


def test_a_sha256_digest_is_read_with_hex_of_either_case() -> None:
    """``sha256:ABCD…`` (Java's and .NET's hex encoders) is the digest ``sha256:abcd…``:
    one normal form, one fingerprint, the fingerprint of the value it digests."""
    digest = digest_value({"plan": "A"})
    upper, mixed = "sha256:" + digest[7:].upper(), "sha256:" + digest[7:39] + digest[39:].upper()
    for spelling in (digest, upper, mixed):
        assert sha256_digest(spelling) == normal_digest(spelling) == digest
        assert digest_fingerprint(spelling) == fingerprint({"plan": "A"})
    for other in (
        "SHA256:" + digest[7:],
        digest[:-1],
        digest + "0",
        digest[:-1] + "g",
        "sha256:abc",
        "md5:0a",
    ):
        assert sha256_digest(other) is None
        assert normal_digest(other) == digest_fingerprint(other) == other
