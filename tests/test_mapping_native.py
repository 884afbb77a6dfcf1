"""The C mapping (``_mapping.c``) against its reference, the Python ``map_attributes``:
whenever the C path maps a span, the same record (keys, their order, values and their
types) and the same problems; every span it declines goes to the reference."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions import mapping
from durable_sessions import semconv as sc
from durable_sessions.mapping import reference_map_attributes
from tests.support.senders import require_native
from tests.support.typed import typed


@pytest.fixture(autouse=True)
def _native_mapping() -> None:
    require_native("_mapping")
    assert mapping.map_attributes is not reference_map_attributes, (
        "built, but DURABLE_SESSIONS_NATIVE turned it off"
    )


def agrees(args: tuple[Any, ...]) -> bool:
    """Whether the C path mapped ``args`` (else it declined); either way what the front
    ends get, ``map_attributes``, equals the reference's answer exactly."""
    from durable_sessions import _mapping  # type: ignore[attr-defined]

    expected = reference_map_attributes(*args)
    assert typed(mapping.map_attributes(*args)) == typed(expected)
    fast = mapping.map_attributes.attempt(*args)  # type: ignore[attr-defined]
    if fast is _mapping.DECLINED:
        return False
    assert typed(fast) == typed(expected)
    return True


# -- generated spans --------------------------------------------------------------------


class Kind(enum.StrEnum):
    PAYMENT = "payment"


class Cap(enum.IntEnum):
    THREE = 3


JSON_TEXTS = [
    '{"answer": "yes"}',
    '{"text": "ok", "n": [1, 2.5, null, true]}',
    "[]",
    '"__REDACTED__"',
    "__REDACTED__",
    "null",
    "5",
    "-7",
    "12345678901234567890123",
    '{"n": 123456789012345678901}',
    '{"n": 1234567890123456789}',
    "1e999",
    '{"x": 1e999}',
    "not json",
    "",
    '{"cut": "abc',
    '"\\ud800"',
    '{"b": 1, "a": {"d": [], "c": "\u00e9\u4e2d"}}',
]
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
scalars = st.one_of(
    st.text(max_size=12),
    st.sampled_from(JSON_TEXTS),
    st.booleans(),
    int64s,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
)
values = st.one_of(
    scalars,
    st.tuples(scalars, scalars),
    st.lists(st.one_of(st.text(max_size=4), int64s, st.booleans()), max_size=3).map(tuple),
    st.sampled_from([Kind.PAYMENT, Cap.THREE, (Cap.THREE,), (2**64,), None, b"bytes", ("a", 1)]),
)
own_keys = [*sc.ACTION_ATTRIBUTES, "agent.action.prompt", "agent.action.redacted", "agent.action.custom"]
other_keys = [
    *sc.SESSION_ATTRIBUTES,
    *sc.NAME_FALLBACKS,
    sc.GEN_AI_OPERATION_NAME,
    sc.OPENINFERENCE_SPAN_KIND,
    sc.TRACELOOP_SPAN_KIND,
    sc.GEN_AI_SYSTEM,
    sc.GEN_AI_OUTPUT_MESSAGES,
    sc.OUTPUT_VALUE,
    "gen_ai.completion.0.content",
    "agent.action.",
    "agent.action.r\u00e9sultat",
    "agent.action.\u4e2d",
    "http.method",
]
keys = st.one_of(st.sampled_from(own_keys), st.sampled_from(other_keys), st.text(max_size=8))
kinds = st.one_of(
    st.just("tool_call"), st.sampled_from(["payment", "user_prompt", "llm_call", Kind.PAYMENT, 7])
)
resources = st.dictionaries(
    st.sampled_from([sc.RESOURCE_SESSION_ID, sc.SERVICE_INSTANCE_ID, "service.name"]), values, max_size=3
)
ids = st.one_of(
    st.sampled_from(["0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"]), st.integers(0, 2**128)
)
times = st.one_of(st.just(0), st.integers(1, 2**63 - 1), st.just(1_764_581_640_123_456_789))


@st.composite
def span_arguments(draw: st.DrawFn) -> tuple[Any, ...]:
    attributes = draw(st.dictionaries(keys, values, max_size=8))
    if draw(st.booleans()):
        attributes[sc.ACTION_KIND] = draw(kinds)
    if draw(st.booleans()):
        attributes[sc.ACTION_RESULT] = draw(st.sampled_from(JSON_TEXTS))
    result = attributes.get(sc.ACTION_RESULT)
    limit = draw(st.one_of(st.none(), st.integers(1, 64), st.just(len(result) if type(result) is str else 8)))
    return (
        attributes,
        draw(resources),
        draw(st.booleans()),
        draw(times),
        draw(ids),
        draw(ids),
        limit,
        draw(st.booleans()),
        draw(times),
    )


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(span_arguments())
def test_the_c_mapping_agrees_with_the_reference_wherever_it_maps(args: tuple[Any, ...]) -> None:
    agrees(args)
    agrees(args[:8])  # end_time_ns left to its default


# -- what the C path takes --------------------------------------------------------------


def own_span(**extra: Any) -> dict[str, Any]:
    return {
        sc.SESSION_ID: "s-1",
        sc.ACTION_ID: "a1",
        sc.ACTION_KIND: "tool_call",
        sc.ACTION_RESULT: '{"rows": [1, 2], "next": null}',
        **extra,
    }


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("limit", [None, 30])
@pytest.mark.parametrize(
    "attributes",
    [
        own_span(),
        own_span(**{sc.ACTION_RESULT: '"__REDACTED__"'}),
        own_span(**{sc.ACTION_RESULT: "__REDACTED__"}),
        own_span(**{sc.ACTION_RESULT_DIGEST: "sha256:" + "0" * 64}),
        own_span(**{sc.ACTION_RETRYABLE: True, sc.ACTION_MAX_ATTEMPTS: 3, "agent.action.prompt": "Pay?"}),
        own_span(**{sc.ACTION_SIDE_EFFECTS: ("email", "charge"), sc.ACTION_TTL_S: 1.5}),
        {sc.ACTION_ID: "a1", sc.ACTION_KIND: "payment", sc.GEN_AI_TOOL_NAME: "pay"},
        {sc.ACTION_ID: "a1", sc.ACTION_STATUS: "ok"},  # no kind, no convention: missing-field
        {sc.SESSION_ID: "s-1", "http.method": "GET"},  # no action
    ],
)
def test_the_common_spans_are_mapped_in_c(attributes: dict[str, Any], limit: int | None, keep: bool) -> None:
    resource = {sc.SERVICE_INSTANCE_ID: "run-1"}
    for trace_id, span_id in (("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"), (7, 9)):
        assert agrees(
            (attributes, resource, False, 1_764_581_640_123_456_789, trace_id, span_id, limit, keep, 0)
        )
        assert agrees((attributes, {}, True, 0, trace_id, span_id, limit, keep, 1_764_581_640_123_456_789))


@pytest.mark.parametrize(
    "attributes",
    [
        {sc.GEN_AI_OPERATION_NAME: "execute_tool", sc.GEN_AI_TOOL_CALL_ID: "c1"},  # a third-party convention
        own_span(**{sc.ACTION_KIND: Kind.PAYMENT}),  # exact() converts it
        own_span(**{sc.ACTION_MAX_ATTEMPTS: 2**64}),  # OTLP cannot carry it
        own_span(**{sc.ACTION_RESULT: "1e999"}),  # the standard library reads it
        own_span(**{sc.ACTION_RESULT: '{"n": 123456789012345678901}'}),  # orjson rounds it
        own_span(**{sc.ACTION_RESULT: "cut"}),  # not JSON: a problem to report
        own_span(**{sc.ACTION_RESULT: 3}),  # no text: a problem to report
    ],
)
def test_the_rare_spans_go_to_the_reference(attributes: dict[str, Any]) -> None:
    assert not agrees(
        (attributes, {}, False, 1, "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", 9, False)
    )


def test_keyword_arguments_go_to_the_reference() -> None:
    args = (own_span(), {}, False, 1, "0" * 32, "0" * 16, None, False)
    assert mapping.map_attributes(*args[:7], keep_result=False) == reference_map_attributes(*args)


def test_an_uninitialised_mapper_refuses_to_map() -> None:
    from durable_sessions import _mapping  # type: ignore[attr-defined]

    blank = _mapping.Mapper.__new__(_mapping.Mapper)
    with pytest.raises(TypeError, match="not initialised"):
        blank(own_span(), {}, False, 1, "0" * 32, "0" * 16, None, False)


def test_with_the_extensions_off_the_python_maps() -> None:
    code = (
        "from durable_sessions import mapping\n"
        "print(mapping.map_attributes is mapping.reference_map_attributes)"
    )
    for switch, python in (("false", "True"), ("true", "False")):
        env = {**os.environ, "DURABLE_SESSIONS_NATIVE": switch}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert done.stdout.strip() == python
