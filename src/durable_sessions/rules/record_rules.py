"""Rules that judge one action record on its own."""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from operator import itemgetter
from types import MappingProxyType
from typing import Any, NamedTuple

from durable_sessions import kinds
from durable_sessions.record import (
    ON_FAILURE_VALUES,
    STATUSES,
    ActionRecord,
    is_epoch_seconds,
    is_int,
    is_recorded,
    is_redacted,
    parse_ts,
)
from durable_sessions.rules.base import Facts, applies_when, record_rule
from durable_sessions.violation import Severity

REPLAY_CONSEQUENCE = "replay re-runs it and the session diverges"


def might_side_effect(facts: Facts) -> bool:
    """The record's kind or its ``side_effects`` field may make it side-effecting."""
    return facts.kind in kinds.SIDE_EFFECTING or "side_effects" in facts.fields


@record_rule(
    "unrecorded-answer",
    Severity.ERROR,
    fix="Record the person's answer in `result` (or `result_ref`) when they give it",
    seed=True,
    **applies_when(kinds={kinds.USER_PROMPT}, statuses={"ok"}),
)
def unrecorded_answer(record: ActionRecord) -> str | None:
    """A question answered by a person has no recorded answer.

    ## Why is this bad?
    After a crash, recovery replays the log. An answered `user_prompt` without its
    answer cannot be replayed, so the resumed session asks the person again: a question
    from days ago, already answered. It is the failure users notice first: it reads as
    the agent having forgotten them. A redacted answer (`__REDACTED__`) is not recorded
    either: the trace no longer holds it. A `result_ref` or a `result_digest` counts as
    recorded, as for `unrecorded-result`.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","prompt":"Budget?"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","prompt":"Budget?","result":{"budget_gbp":2400}}
    ```
    """
    if record.get("status") != "ok" or is_recorded(record):
        return None
    how = " (its value was redacted)" if is_redacted(record) else ""
    return (
        f"user_prompt has no recorded answer{how} — recovery asks the person again "
        "a question they already answered"
    )


@record_rule(
    "unrecorded-result",
    Severity.ERROR,
    fix="Record the outcome in `result` (or `result_ref`) before the action counts as done",
    seed=True,
    **applies_when(kinds=kinds.NON_DETERMINISTIC - {kinds.USER_PROMPT}, statuses={"ok"}),
)
def unrecorded_result(record: ActionRecord) -> str | None:
    """A non-deterministic action (model call, external read, clock, random) has no recorded result.

    ## Why is this bad?
    Running a model call, a web read, a clock read or a random draw again gives a
    different answer. Without the recorded result, replay must run it again, and the
    resumed session silently diverges from the one the user was in. `result: null` is
    a recorded result; an absent or redacted `result` is not. A `result_ref`, or a
    `result_digest`, counts as recorded: the outcome is kept where it points, or where
    the digest was made (the journal; the sidecar keeps digests only, and judges the
    sessions it rebuilds from them).

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","model":"main"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","model":"main","result_ref":"blob://s-1/a02.json"}
    ```
    """
    if record.get("status") != "ok" or is_recorded(record):
        return None
    how = " (its value was redacted)" if is_redacted(record) else ""
    return f"non-deterministic kind '{record['kind']}' has no recorded result{how} — {REPLAY_CONSEQUENCE}"


@record_rule(
    "unkeyed-side-effect",
    Severity.ERROR,
    fix="Add an idempotency_key derived from session and action id, or mark it `replay: skip`",
    seed=True,
    when=lambda facts: facts.status == "ok" and might_side_effect(facts),
    fields=frozenset({"side_effects"}),
)
def unkeyed_side_effect(record: ActionRecord) -> str | None:
    """A side-effecting action has neither an idempotency key nor `replay: skip`.

    ## Why is this bad?
    A payment, an email, a write or a deploy changes the world. If recovery replays
    it, the effect happens twice: the card is charged twice, the email sent twice. An
    idempotency key lets the far side recognise the second attempt and collapse it;
    `replay: skip` makes recovery step over the action. There is no safe third option.
    Any kind counts as side-effecting when the record says `side_effects: true`.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","result":{"charge":"ch_1"}}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a07","result":{"charge":"ch_1"}}
    ```
    """
    if record.get("status") != "ok" or record.get("idempotency_key") or record.get("replay") == "skip":
        return None
    if record.get("kind") in kinds.SIDE_EFFECTING:
        what = f"side-effecting kind '{record['kind']}'"
    elif record.get("side_effects") is True:
        what = f"'{record['kind']}' marked side_effects"
    else:
        return None
    return (
        f"{what} has no idempotency_key and is not replay: skip — recovery would repeat a real-world effect"
    )


@record_rule(
    "unbounded-retry",
    Severity.ERROR,
    fix="Give every retryable action an integer max_attempts of at least 1",
    seed=True,
    **applies_when(any_field={"retryable"}),
)
def unbounded_retry(record: ActionRecord) -> str | None:
    """A retryable action has no finite, integer `max_attempts`.

    ## Why is this bad?
    A retry without a cap is an unbounded loop: it burns budget, never surfaces, and
    never asks anyone. A cap must be a JSON integer of at least 1: `true`, `"3"`,
    `3.0` and `-1` are not caps.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a04","kind":"tool_call","status":"error","retryable":true,"attempts":19}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a04","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":2}
    ```
    """
    if record.get("retryable") is not True:
        return None
    cap = record.get("max_attempts")
    if is_int(cap) and cap >= 1:
        return None
    why = "" if cap is None else f" (max_attempts is {describe(cap)})"
    return f"retryable without a finite max_attempts{why} — an unbounded loop that never escalates"


@record_rule(
    "retry-overrun",
    Severity.ERROR,
    fix="Stop retrying at max_attempts and escalate instead",
    seed=True,
    **applies_when(any_field={"attempts"}),
)
def retry_overrun(record: ActionRecord) -> str | None:
    """An action was attempted more often than its own `max_attempts`.

    ## Why is this bad?
    The cap was declared but not enforced: whatever retries the action ignores it,
    so the cap protects nothing and the loop is unbounded in practice.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a05","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":7,"on_failure":"ask_user"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a05","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":3,"on_failure":"ask_user"}
    ```
    """
    attempts, cap = record.get("attempts"), record.get("max_attempts")
    if is_int(attempts) and is_int(cap) and attempts > cap:
        return f"attempts {attempts} exceeds max_attempts {cap} — the cap is not enforced"
    return None


@record_rule(
    "cached-human-answer",
    Severity.ERROR,
    fix="Never mark a user_prompt cacheable; its answer belongs to one session",
    seed=True,
    **applies_when(kinds={kinds.USER_PROMPT}, any_field={"cacheable"}),
)
def cached_human_answer(record: ActionRecord) -> str | None:
    """A person's answer is marked cacheable.

    ## Why is this bad?
    The useful question for a cache is "whose answer is it?". What a person told the
    agent belongs to their session; a shared cache serves it to everyone else. That is
    a correctness bug and, when the answer is personal, a disclosure bug.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a06","kind":"user_prompt","status":"ok","result":{"seat":"aisle"},"cacheable":true,"cache_key":"seat-pref","ttl_s":3600}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a06","kind":"user_prompt","status":"ok","result":{"seat":"aisle"}}
    ```
    """
    if record.get("cacheable") is True:
        return "user_prompt marked cacheable — a person's answer is not shareable across sessions"
    return None


@record_rule(
    "cache-without-key",
    Severity.ERROR,
    fix="Give every cacheable action a cache_key naming what makes two calls the same",
    seed=True,
    **applies_when(any_field={"cacheable"}),
)
def cache_without_key(record: ActionRecord) -> str | None:
    """A cacheable action has no `cache_key`.

    ## Why is this bad?
    Without a key nothing says which calls may share an entry, so one call's answer
    can be served for another.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a03","kind":"external_read","status":"ok","result":{"quotes":2},"cacheable":true,"ttl_s":86400}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a03","kind":"external_read","status":"ok","result":{"quotes":2},"cacheable":true,"cache_key":"flights:LHR-KIX:2026-11-02","ttl_s":86400}
    ```
    """
    if record.get("cacheable") is True and not record.get("cache_key"):
        return "cacheable without a cache_key — one call's answer can be served for another"
    return None


@record_rule(
    "cache-without-ttl",
    Severity.ERROR,
    fix="Give every cacheable action a positive integer ttl_s",
    seed=True,
    **applies_when(any_field={"cacheable"}),
)
def cache_without_ttl(record: ActionRecord) -> str | None:
    """A cacheable action has no positive integer `ttl_s`.

    ## Why is this bad?
    An entry that never expires is a stale answer waiting to be served: prices,
    availability and search results change, the cache does not.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a03","kind":"external_read","status":"ok","result":{"quotes":2},"cacheable":true,"cache_key":"flights:LHR-KIX"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a03","kind":"external_read","status":"ok","result":{"quotes":2},"cacheable":true,"cache_key":"flights:LHR-KIX","ttl_s":86400}
    ```
    """
    if record.get("cacheable") is not True:
        return None
    ttl = record.get("ttl_s")
    if is_int(ttl) and ttl > 0:
        return None
    why = "" if ttl is None else f" (ttl_s is {describe(ttl)})"
    return f"cacheable without a positive ttl_s{why} — a stale answer with no way to expire"


@record_rule(
    "dead-end",
    Severity.ERROR,
    fix="Say what recovery does after this failure: on_failure ask_user, abort or compensate",
    seed=True,
    strict_only=True,
    **applies_when(statuses={"error"}),
)
def dead_end(record: ActionRecord) -> str | None:
    """A failed action that is not retryable gives no `on_failure` instruction (strict only).

    ## Why is this bad?
    Recovery meets a failure it may not retry and has no instruction for: it has to
    guess whether to ask the user, abort or compensate. Guessing is how sessions end
    silently. Checked only with `--strict`.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a08","kind":"tool_call","status":"error","retryable":false,"error":"visa check failed"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a08","kind":"tool_call","status":"error","retryable":false,"on_failure":"ask_user","error":"visa check failed"}
    ```
    """
    if record.get("status") != "error" or record.get("retryable") is True:
        return None
    on_failure = record.get("on_failure")
    if type(on_failure) is str and on_failure in ON_FAILURE_VALUES:
        return None
    why = "" if on_failure is None else f" (on_failure is {describe(on_failure)})"
    return (
        f"failed, not retryable and no on_failure instruction{why} — recovery has to "
        "guess whether to ask, abort or compensate"
    )


_DAY = r"(?:0[1-9]|[12]\d|3[01])"
_MONTH = r"(?:0[1-9]|1[0-2])"
# Year first, its parts apart by one separator used twice: 2026-11-01, 2026/11/01,
# 2026_11_01, 2026.11.01 (what strftime makes of %Y-%m-%d and its kin).
_YEAR_FIRST_DATE = rf"(?:19|20)\d\d(?P<ymd>[-/_.]){_MONTH}(?P=ymd){_DAY}"
# Year last, day or month first (01-11-2026, 11/01/2026, 01.11.2026): two two-digit parts
# of at most 31 and no digit on either side, so that a longer number is not taken for one.
_YEAR_LAST_DATE = rf"(?<!\d){_DAY}(?P<dmy>[-/.]){_DAY}(?P=dmy)(?:19|20)\d\d(?!\d)"
# A compact date, alone or with a time and its fraction of a second: 20261101,
# 20261101T0914, 20261101-091400, 202611010914, 20261101091400123 (milliseconds, as
# yyyyMMddHHmmssSSS gives). Calendar bounds and no digit on either side, so that an
# arbitrary number (an order id 12345678, a 10-digit account) is not taken for one.
_COMPACT_DATE_TIME = (
    rf"(?<!\d)(?:19|20)\d\d{_MONTH}{_DAY}"
    r"(?:[-_T]?(?:[01]\d|2[0-3])[0-5]\d(?:[0-5]\d(?:[.,]?\d{3}){0,3})?)?(?!\d)"
)
_TIME_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[167][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
_DATE_LIKE = re.compile(rf"{_YEAR_FIRST_DATE}|{_YEAR_LAST_DATE}|{_COMPACT_DATE_TIME}")
_TIME_UUID_LIKE = re.compile(_TIME_UUID, re.I)
# A UUID written without its dashes (uuid.uuid1().hex): 32 hex digits, none on either side.
# So are a content hash cut to 32 digits and an MD5, which have a time-based UUID's version
# and variant digits one time in 21: only the time such a UUID embeds tells it from a hash.
_UNDASHED_UUID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", re.I)
_GREGORIAN_TO_UNIX_S = 12_219_292_800  # v1 and v6 count 100 ns from 1582-10-15, 1970 less this
# A ULID: 26 Crockford base32 digits (no I, L, O or U) in one case, the first ten the
# milliseconds since 1970 (so the first digit is at most 7), alone between non-alphanumerics.
_ULID = re.compile(r"(?<![0-9a-z])[0-7][0-9a-hjkmnp-tv-z]{25}(?![0-9a-z])", re.I)
_CROCKFORD_TO_BASE32 = str.maketrans("ABCDEFGHJKMNPQRSTVWXYZ", "abcdefghijklmnopqrstuv")
_DIGIT_RUN = re.compile(r"(?<!\d)(\d{10}|\d{13}|\d{16}|\d{19})(?!\d)")
_EPOCH_RANGE_S = (946_684_800, 4_102_444_800)  # 2000-01-01 .. 2100-01-01
# What durable_sessions.instrument.idempotency_key() returns: "ds1-" and 32 base32 digits
# of a SHA-256 of the identity. Its digits 2-7 can form a run that reads as an epoch
# second, but the key holds no time.
_DERIVED_KEY = re.compile(r"ds1-[a-z2-7]{32}")


def time_component(key: str) -> str | None:
    """The part of ``key`` that is derived from time, or None.

    A key in exactly the format of ``idempotency_key()`` is a hash of the action's
    identity, whatever its digits look like: None.
    """
    if _DERIVED_KEY.fullmatch(key):
        return None
    if found := _DATE_LIKE.search(key):
        return f"the date '{found.group()}'"
    if found := _TIME_UUID_LIKE.search(key):
        return f"the time-based UUID '{found.group()}'"
    for digits in _UNDASHED_UUID.findall(key):
        if _is_plausible_time(_uuid_unix_seconds(uuid.UUID(hex=digits))):
            return f"the time-based UUID '{digits}'"
    for token in _ULID.findall(key):
        if _is_plausible_time(_ulid_unix_seconds(token)):
            return f"the ULID '{token}'"
    for run in _DIGIT_RUN.findall(key):
        if _is_plausible_time(int(run) / 10 ** (len(run) - 10)):
            return f"the epoch timestamp '{run}'"
    return None


def _uuid_unix_seconds(value: uuid.UUID) -> float | None:
    """The Unix time a version 1, 6 or 7 UUID (RFC 9562) embeds, or None for any other
    version or variant."""
    if value.variant != uuid.RFC_4122 or value.version not in (1, 6, 7):
        return None
    bits = value.int
    if value.version == 7:
        return (bits >> 80) / 1000  # 48 bits of milliseconds since 1970
    # The 60-bit count of 100 ns in three fields: in version 1 its least significant bits
    # come first (time_low, time_mid, time_high), in version 6 its most significant.
    first, middle, last = bits >> 96, (bits >> 80) & 0xFFFF, (bits >> 64) & 0x0FFF
    ticks = last << 48 | middle << 32 | first if value.version == 1 else first << 28 | middle << 12 | last
    return ticks / 10_000_000 - _GREGORIAN_TO_UNIX_S


def _ulid_unix_seconds(token: str) -> float | None:
    """The Unix time a ULID embeds, or None for 26 characters that are no ULID: mixed case
    (base62 or base64) or hex digits only (a hex digest cut to 26; a ULID has 16 random
    digits, all hex one time in 65,536)."""
    if token not in (token.upper(), token.lower()) or _HEX_DIGITS.fullmatch(token):
        return None
    return int(token[:10].upper().translate(_CROCKFORD_TO_BASE32), 32) / 1000


_HEX_DIGITS = re.compile(r"[0-9a-f]+", re.I)


def _is_plausible_time(unix_s: float | None) -> bool:
    """``unix_s`` falls in the years a key read today could have been made in (2000-2100)."""
    return unix_s is not None and _EPOCH_RANGE_S[0] <= unix_s < _EPOCH_RANGE_S[1]


@record_rule(
    "time-derived-key",
    Severity.ERROR,
    fix="Derive the idempotency key from session and action identity, e.g. `pay-<session>-<action>`",
    **applies_when(any_field={"idempotency_key"}),
)
def time_derived_key(record: ActionRecord) -> str | None:
    """An idempotency key contains a date, an epoch timestamp, a time-based UUID or a ULID.

    ## Why is this bad?
    A key computed from the clock differs on every attempt, so the far side sees the
    replay as a new request and performs the effect again: the key keys nothing.
    Detected: ISO dates and date-times, dates with `/`, `_` or `.` between year, month
    and day (`2026/11/01`), dates with the year last (`01-11-2026`, `11/01/2026`,
    `01.11.2026`), compact dates and date-times (`20261101`, `20261101T0914`,
    `20261101-091400`, `20261101091400123`; a year 19xx or 20xx, a real month and day,
    and no digit on either side), epoch numbers of 10, 13, 16 or 19 digits in a
    plausible range, and UUIDs of versions 1, 6 and 7 (which embed a timestamp), with
    their dashes or without (`uuid1().hex`). Without dashes, 32 hex digits are read as
    one only when the time they embed falls between 2000 and 2100: a content hash cut
    to 32 hex digits (or an MD5) has a time-based UUID's version and variant digits
    one time in 21, and a time in that range about one time in a thousand. A whole
    SHA-256 (64 hex digits) is never read as a UUID. ULIDs (26 Crockford base32
    characters in one case, the first ten milliseconds since 1970) are read as one when
    that time falls between 2000 and 2100; a SHA-256 cut to 26 characters of hex, base32
    (RFC 4648), base62 or base64 is, at most, one time in a thousand, but written in
    Crockford base32, a ULID's own alphabet, about three times in a thousand. KSUIDs are
    not detected: a random base62 token of 27 characters embeds a time after 2014 about
    one time in three.
    Not flagged: a key in exactly the format `idempotency_key()` gives (`ds1-` and 32
    characters of `a`-`z`, `2`-`7`), a hash of the identity whose digits may happen to
    read as an epoch number.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-1764581640123"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a07"}
    ```
    """
    key = record.get("idempotency_key")
    if type(key) is not str or not key:
        return None
    component = time_component(key)
    if component is None:
        return None
    return f"idempotency_key '{key}' contains {component} — it differs on replay, so it keys nothing"


@record_rule(
    "truncated-result",
    Severity.WARNING,
    fix="Raise OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT or record large results by reference (result_ref)",
    **applies_when(any_field={"value_limit"}),
)
def truncated_result(record: ActionRecord) -> str | None:
    """A result read from a span is exactly as long as the attribute length limit.

    ## Why is this bad?
    The OpenTelemetry SDK cuts attribute values at `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`
    without telling the application. A recorded result of exactly that length was
    probably cut, so replaying it would hand the session half an answer.

    ## Example
    ```
    agent.action.result = '{"text": "The itinerary is … (4096 characters, the limit)'
    ```

    ## Use instead
    ```
    agent.action.result_ref = "blob://sessions/s-1/a02.json"
    agent.action.result_digest = "sha256:…"
    ```
    """
    limit, length = record.get("value_limit"), record.get("result_length")
    if limit and length is not None and length == limit:
        return (
            f"recorded result is {length} characters, exactly the attribute length limit — "
            "it was probably cut by the SDK and cannot be replayed"
        )
    return None


def _readable_time(value: str) -> bool:
    """``value`` is a time key-outlived-window can read (:func:`parse_ts`)."""
    return parse_ts(value) is not None


class FieldSpec(NamedTuple):
    """What a well-formed value of one field looks like.

    ``types`` are the JSON types allowed; ``accepts`` maps some of them to a further
    check of a value of that type (truthy when acceptable); ``waived_by`` names a flag
    that, when true, hands the field to the rule that owns it (``unbounded-retry``
    judges ``max_attempts`` of a retryable action, ``cache-without-ttl`` the ``ttl_s``
    of a cacheable one). The checks are C functions rather than lambdas because
    ``invalid-field`` runs them on every record (a ``ts`` string, which spans never
    carry, is read as the rule that uses it reads it).
    """

    types: tuple[type, ...]
    expected: str
    accepts: Mapping[type, Callable[[Any], Any]] = MappingProxyType({})
    waived_by: str | None = None

    def admits(self, value: Any) -> bool:
        """``value`` is well formed for this field."""
        kind = type(value)
        if kind not in self.types:
            return False
        accepts = self.accepts.get(kind)
        return accepts is None or bool(accepts(value))


def _checks(accepts: dict[type, Callable[[Any], Any]]) -> Mapping[type, Callable[[Any], Any]]:
    return MappingProxyType(accepts)


_STRING = FieldSpec((str,), "a string")
_BOOLEAN = FieldSpec((bool,), "true or false")
_AT_LEAST_ONE = _checks({int: partial(operator.le, 1)})
_FIELD_SPECS: dict[str, FieldSpec] = {
    **dict.fromkeys(
        (
            "idempotency_key",
            "cache_key",
            "name",
            "result_ref",
            "result_digest",
            "prompt_digest",
            "incarnation",
        ),
        _STRING,
    ),
    **dict.fromkeys(("replayed", "side_effects", "retryable", "cacheable", "cache_hit"), _BOOLEAN),
    "attempts": FieldSpec((int,), "an integer of at least 1", _AT_LEAST_ONE),
    "max_attempts": FieldSpec((int,), "an integer of at least 1", _AT_LEAST_ONE, "retryable"),
    "ttl_s": FieldSpec((int,), "a positive integer", _checks({int: partial(operator.lt, 0)}), "cacheable"),
    "replay": FieldSpec((str,), "'skip'", _checks({str: partial(operator.eq, "skip")})),
    "on_failure": FieldSpec(
        (str,), "ask_user, abort or compensate", _checks({str: ON_FAILURE_VALUES.__contains__})
    ),
    # An ISO-8601 date or date-time that parse_ts reads (one that only started like a
    # date, "2026-11-01 09:00:00 UTC", left key-outlived-window blind without a word), or
    # finite epoch seconds: a number beyond MAX_EPOCH_S is milliseconds or finer, which
    # read as seconds made a two-minute retry "33.3 h" after its first use.
    "ts": FieldSpec(
        (str, float, int),
        "an ISO-8601 date-time or epoch seconds (not milliseconds)",
        _checks({str: _readable_time, float: is_epoch_seconds, int: is_epoch_seconds}),
    ),
    # Set by the span mapping (always a tuple, which no JSON log can produce): what the
    # span said that no field can carry. A list read from a log is not honoured.
    "mapping_problems": FieldSpec((tuple, list), "no problems", _checks({tuple: operator.not_})),
}
_CHECKED_FIELDS = frozenset(_FIELD_SPECS)


def _field_problem(record: ActionRecord, name: str, value: Any, spec: FieldSpec) -> str | None:
    """Why ``value`` is not well formed, or None when it is acceptable after all."""
    if value is None:
        return None
    if spec.waived_by is not None and record.get(spec.waived_by) is True:
        return None
    return f"{name} is {describe(value)}, expected {spec.expected}"


@record_rule(
    "invalid-field",
    Severity.ERROR,
    fix="Write each field with the type and values documented in docs/semconv.md",
    judges_replays=True,  # the rules read a replayed record's fields too
    when=lambda facts: _kind_or_status_unknown(facts) or not _CHECKED_FIELDS.isdisjoint(facts.fields),
    fields=_CHECKED_FIELDS,
    specialize=lambda facts: _fields_checker(facts),
)
def invalid_field(record: ActionRecord) -> str | None:
    """A field has the wrong type or an unknown value.

    ## Why is this bad?
    The rules, and recovery, read these fields literally: `retryable: "yes"` is not
    `true`, `attempts: "2"` is not a number, `status: "done"` is neither `ok` nor
    `error`, `kind: "Payment"` (or `" payment"`, `"user-prompt"`) is no known kind, so
    an unkeyed payment written so would pass every rule, and a kind of spaces names no
    kind at all. A wrong type silently turns a protection off, so it is reported rather
    than guessed at. (`max_attempts` and `ttl_s` are judged by `unbounded-retry` and
    `cache-without-ttl` when the action is retryable or cacheable.) `replay-check`, the
    seed's drop-in, and the seed's rule set (`--rules seed`) judge `kind` and `status`
    only: every seed rule is chosen by them, and the other fields are not all the seed's.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a04","kind":"tool_call","status":"done","retryable":"yes","attempts":"2"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a04","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":2}
    ```
    """
    return _check_fields(tuple(sorted(_CHECKED_FIELDS.intersection(record))), record)


def _fields_checker(facts: Facts) -> Callable[[ActionRecord], str | None]:
    """``invalid_field`` for records with these facts: the fields to check known in advance.

    The common case, every field of a type seen well formed before, costs one C-level
    pass to fetch the values and their types, then the C value checks of those types.
    """
    names = tuple(sorted(_CHECKED_FIELDS & facts.fields))
    if not names or _kind_or_status_unknown(facts):
        return partial(_check_fields, names)
    values_of = itemgetter(*names) if len(names) > 1 else lambda record: (record[names[0]],)
    specs = [_FIELD_SPECS[name] for name in names]

    def value_checks(types: tuple[type, ...]) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
        return tuple(
            (index, spec.accepts[kind])
            for index, (spec, kind) in enumerate(zip(specs, types, strict=True))
            if kind in spec.accepts
        )

    usual_types = tuple(spec.types[0] for spec in specs)
    checks_by_types = {usual_types: value_checks(usual_types)}

    def check(record: ActionRecord) -> str | None:
        values = values_of(record)
        types = tuple(map(type, values))
        checks = checks_by_types.get(types)
        if checks is not None:
            for index, accepts in checks:
                if not accepts(values[index]):
                    break
            else:
                return None
        problem = _check_fields(names, record)
        if problem is None and len(checks_by_types) < 64 and _NONE_TYPE not in types:
            checks_by_types[types] = value_checks(types)  # every value of these types passed: a usual shape
        return problem

    return check


_NONE_TYPE = type(None)


def _kind_or_status_unknown(facts: Facts) -> bool:
    """The record's status is none the rules know, or its kind is blank or a known kind
    spelt otherwise (:func:`kinds.expected_kind`): every rule would pass it over."""
    return facts.status not in STATUSES or kinds.expected_kind(facts.kind) is not None


def _check_fields(names: tuple[str, ...], record: ActionRecord) -> str | None:
    problems = []
    from_mapping: tuple[str, ...] = ()
    for name in names:
        value = record[name]
        if name == "mapping_problems":
            if type(value) is tuple:
                from_mapping = tuple(problem for problem in value if type(problem) is str)
            continue
        spec = _FIELD_SPECS[name]
        if spec.admits(value):
            continue
        if problem := _field_problem(record, name, value, spec):
            problems.append(problem)
    if record.get("status") not in STATUSES:
        problems.append(f"status is {describe(record.get('status'))}, expected one of ok, error, started")
    if (expected := kinds.expected_kind(record.get("kind"))) is not None:
        problems.append(f"kind is {describe(record.get('kind'))}, expected {expected}")
    messages = [f"{'; '.join(sorted(problems))} — the rules cannot rely on it"] if problems else []
    messages.extend(from_mapping)  # already in the rule's style: what, then the consequence
    return "; ".join(messages) or None


INVALID_KIND_OR_STATUS = dataclasses.replace(
    invalid_field,
    fields=frozenset(),
    when=_kind_or_status_unknown,
    specialize=None,
    check=partial(_check_fields, ()),
)
"""``invalid-field`` for ``kind`` and ``status`` alone, as the seed's rule set
(``replay-check``, ``--rules seed``) runs it beside the seed's rules. Those two fields
choose which of the seed's rules judge a record, so a ``Payment`` or a status ``OK``
passed every one of them as replay-safe; the seed never defined the other fields
``invalid-field`` judges (``ts``, ``incarnation``, ...), so a log that carries them its
own way stays a seed log. Not in the catalogue: one rule, one id (another process
rebuilds it by :func:`durable_sessions.rules.rule_references`)."""


def describe(value: Any) -> str:
    """A short, type-revealing rendering of a field value for messages."""
    if value is None:
        return "null"
    if type(value) is bool:
        return f"the boolean {'true' if value else 'false'}"
    if type(value) is str:
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if type(value) is int:
        if value.bit_length() > 128:
            return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
        return f"the integer {value}"
    if type(value) is float:
        if math.isinf(value) or math.isnan(value):
            return f"the non-finite number {value}"
        return f"the number {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
