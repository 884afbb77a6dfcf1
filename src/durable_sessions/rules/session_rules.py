"""Rules that judge an action against what its session did before.

Order within a session is line order for files and start time for spans. An
*incarnation* is one process run (``service.instance.id``); a *replayed* record served
its outcome from the record instead of executing. Each check receives the session's
memory, the record, and ``prior``: what the session remembers of the same action id
(``None`` the first time it is seen).
"""

from __future__ import annotations

from collections.abc import Iterator

from durable_sessions import kinds
from durable_sessions.digest import as_digest, normal_digest, same_outcome
from durable_sessions.record import (
    ActionRecord,
    Location,
    attempt_number,
    is_int,
    is_side_effecting,
    outcome_digest,
    outcome_fingerprint,
    parse_ts,
)
from durable_sessions.rules.base import Finding, applies_when, session_rule
from durable_sessions.rules.record_rules import describe, might_side_effect
from durable_sessions.rules.state import ActionMemory, FailureRun, Pending, SessionState
from durable_sessions.violation import Severity

LOOP_THRESHOLD = 5


def _at(location: Location, relative_to: Location) -> str:
    if location.line is not None and location.file == relative_to.file:
        return f"line {location.line}"
    return str(location)


def _shown(value: object) -> str:
    """A field's value in a message: a string quoted, anything else described (a key or
    an incarnation of the wrong type may be a list nested too deeply to ``repr``)."""
    return repr(value) if type(value) is str else describe(value)


def _again(prior: ActionMemory, record: ActionRecord, done: str = "executed") -> str:
    """``in incarnation 'run-1' was executed again in 'run-2'``: the two process runs
    involved, or the attempt that ran again in the same one."""
    if not prior.is_other_incarnation(record):
        return f"at an earlier attempt was {done} again at attempt {attempt_number(record)}"
    return (
        f"in incarnation {_shown(prior.incarnation)} was {done} again in {_shown(record.get('incarnation'))}"
    )


def _is_executed_again(prior: ActionMemory, record: ActionRecord) -> bool:
    """``record`` runs an action again that the session saw before: in another process
    run, or as a later attempt (one already completed needs no more attempts). Only a
    strictly later attempt than every one seen: an earlier attempt that arrives after the
    completed one (spans of one batch, redelivered) is the past, not a re-run. A record
    without ``attempts`` is the first attempt (:func:`attempt_number`), on either side
    (:meth:`ActionMemory.attempts_seen`)."""
    if prior.is_other_incarnation(record):
        return True
    attempt = attempt_number(record)
    return attempt is not None and attempt > max(prior.attempts_seen())


@session_rule(
    "duplicate-action-id",
    Severity.ERROR,
    fix="Give every action a unique, stable action_id within its session",
    seed=True,
    **applies_when(needs_prior=True),
)
def duplicate_action_id(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """Two records in one session share an `action_id` without being the same action.

    ## Why is this bad?
    Replay looks outcomes up by `action_id`. When two different actions share one, the
    lookup returns the wrong recorded result, or the wrong one is skipped. Not
    duplicates: distinct attempts (`attempts` differs; a record without it is the first
    attempt) of a retryable action, counted per incarnation (a resumed process may count
    from 1 again), a `started` record and its completion, a replay (`replayed: true`),
    and a re-execution in a later incarnation (`re-asked`, `re-executed-side-effect` and
    `diverged-result` judge re-executions, and a later attempt of an action that
    completed). Different kinds under one id are always duplicates. The same id in two
    different sessions is not a duplicate.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","result":{}}
    {"session_id":"s-1","action_id":"a02","kind":"clock","status":"ok","result":{"now":"2026-11-01T09:14:00Z"}}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","result":{}}
    {"session_id":"s-1","action_id":"a03","kind":"clock","status":"ok","result":{"now":"2026-11-01T09:14:00Z"}}
    ```
    """
    if prior is None:
        return None
    first = _at(prior.where, where)
    if record.get("kind") != prior.kind:
        return (
            f"duplicate action_id '{record['action_id']}' (first at {first} as '{prior.kind}', "
            f"now '{record['kind']}') — replay applies the wrong recorded result"
        )
    if _is_same_action_again(record, prior):
        return None
    return (
        f"duplicate action_id '{record['action_id']}' (first at {first}) — replay applies "
        "the wrong recorded result"
    )


def _is_same_action_again(record: ActionRecord, prior: ActionMemory) -> bool:
    """``record`` is the action seen before, again: a replay, a re-execution in another
    run, the completion of its ``started`` record, or another attempt of a retryable
    action. A record without ``attempts`` is the first attempt (:func:`attempt_number`),
    on either side (:meth:`ActionMemory.attempts_seen`)."""
    if record.get("replayed") is True or prior.is_other_incarnation(record):
        return True
    if prior.status == "started" and record.get("status") != "started":
        return True
    attempt = attempt_number(record)
    new_attempt = attempt is not None and attempt not in prior.attempts_seen()
    return new_attempt and (record.get("retryable") is True or prior.retryable)


@session_rule(
    "re-asked",
    Severity.ERROR,
    fix="On recovery, serve the recorded answer (replayed: true) instead of asking again",
    **applies_when(kinds={kinds.USER_PROMPT}),
)
def re_asked(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A question the person already answered is asked again after a restart, or retried.

    ## Why is this bad?
    The answer was recorded, so recovery had what it needed, and still put the question
    to the person again instead of replaying the answer. It is the sharpest form of the
    replay bug: the user notices at once, and their second answer may differ from the
    first. Detected by `action_id` (in a later incarnation, or at a later attempt: an
    answered question needs no retry), and by `prompt_digest` when the resumed process
    gave the same question a new id.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","incarnation":"run-1","result":{"budget":2400}}
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","incarnation":"run-2","result":{"budget":2000}}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","incarnation":"run-1","result":{"budget":2400}}
    {"session_id":"s-1","action_id":"a01","kind":"user_prompt","status":"ok","incarnation":"run-2","replayed":true,"result":{"budget":2400}}
    ```
    """
    if record.get("kind") != kinds.USER_PROMPT or record.get("replayed") is True:
        return None
    if prior is not None:
        if prior.kind == kinds.USER_PROMPT and prior.recorded and _is_executed_again(prior, record):
            return (
                f"user_prompt '{record['action_id']}' answered {_again(prior, record, 'asked')} instead of "
                "replayed — the person is asked the same question twice"
            )
        return None
    digest = record.get("prompt_digest")
    earlier = session.answered_prompts.get(normal_digest(digest)) if digest and type(digest) is str else None
    if earlier is None:
        return None
    action_id, incarnation = earlier
    if incarnation is None or record.get("incarnation") is None or incarnation == record.get("incarnation"):
        return None
    return (
        f"user_prompt '{record['action_id']}' asks the question already answered as "
        f"'{action_id}' in incarnation {_shown(incarnation)} — the person is asked the same "
        "question twice"
    )


@session_rule(
    "re-executed-side-effect",
    Severity.ERROR,
    fix="On recovery, skip completed side effects or re-send them with the same idempotency key",
    other_severities=(Severity.WARNING,),  # re-sent with the same key
    when=lambda facts: facts.has_prior and might_side_effect(facts),
    fields=frozenset({"side_effects"}),
)
def re_executed_side_effect(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A side effect that already completed is executed again after a restart, or retried.

    ## Why is this bad?
    The effect already happened (the card was charged, the email sent) and recovery (or
    a retry at a later attempt) ran it again instead of replaying its outcome. Without
    an idempotency key, or with a different one, the far side cannot tell, and the
    effect fires twice (error). With the same key it now depends on the far side
    honouring the key (warning).

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","incarnation":"run-1","idempotency_key":"pay-s-1-a07"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","incarnation":"run-2"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","incarnation":"run-1","idempotency_key":"pay-s-1-a07"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","incarnation":"run-2","idempotency_key":"pay-s-1-a07","replayed":true}
    ```
    """
    if prior is None or record.get("replayed") is True or not is_side_effecting(record):
        return None
    if not prior.effect_done or not _is_executed_again(prior, record):
        return None
    what = f"'{record['kind']}' '{record['action_id']}' completed {_again(prior, record)}"
    key = record.get("idempotency_key")
    if not key:
        return f"{what} without an idempotency key — the effect fires twice"
    if key != prior.key:
        return f"{what} with a different idempotency key ({_shown(key)}, first {_shown(prior.key)}) — the effect fires twice"
    return (
        f"{what} with the same idempotency key — safe only if the far side honours the key",
        Severity.WARNING,
    )


@session_rule(
    "diverged-result",
    Severity.ERROR,
    fix="On recovery, return the recorded result (replayed: true) instead of calling again",
    **applies_when(kinds=kinds.NON_DETERMINISTIC - {kinds.USER_PROMPT}, needs_prior=True),
)
def diverged_result(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A non-deterministic action whose result was recorded is executed again after a restart, or retried.

    ## Why is this bad?
    The recorded result was there to replay; running the model call, the web read or the
    clock read again (after a restart, or as a later attempt) gives another answer, so
    the resumed session diverges from the one the user was in. When the results differ
    the message gives both digests (the recorded one by its first 16 hex digits: that
    is what the session keeps).

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","incarnation":"run-1","result":{"plan":"A"}}
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","incarnation":"run-2","result":{"plan":"B"}}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","incarnation":"run-1","result":{"plan":"A"}}
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","incarnation":"run-2","replayed":true,"result":{"plan":"A"}}
    ```
    """
    if prior is None or record.get("replayed") is True or record.get("kind") == kinds.USER_PROMPT:
        return None
    if record.get("kind") not in kinds.NON_DETERMINISTIC or prior.kind != record.get("kind"):
        return None
    if not prior.recorded or not _is_executed_again(prior, record):
        return None
    now = outcome_fingerprint(record) if record.get("status") == "ok" else None
    digests = ""
    if now is not None and prior.outcome is not None and same_outcome(now, prior.outcome) is False:
        digests = f" (recorded {as_digest(prior.outcome)}, now {outcome_digest(record)})"
    return (
        f"'{record['kind']}' '{record['action_id']}' recorded {_again(prior, record)} instead of "
        f"replayed{digests} — the resumed session diverges"
    )


@session_rule(
    "replay-mismatch",
    Severity.ERROR,
    fix="Replay the outcome recorded for this action_id, byte for byte",
    **applies_when(any_field={"replayed"}, needs_prior=True),
)
def replay_mismatch(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A replayed record serves a different result from the one recorded.

    ## Why is this bad?
    Replay is meant to hand the resumed session exactly what the first run saw. A
    replayed result whose digest differs from the recorded one means the journal was
    read wrongly (a wrong key, a stale blob, a cache hit from another session): the
    session diverges while claiming it did not.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","result_digest":"sha256:aa11"}
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","replayed":true,"result_digest":"sha256:bb22"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","result_digest":"sha256:aa11"}
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","replayed":true,"result_digest":"sha256:aa11"}
    ```
    """
    if record.get("replayed") is not True or prior is None or prior.outcome is None:
        return None
    now = outcome_fingerprint(record)
    if now is None or same_outcome(now, prior.outcome) is not False:
        return None
    return (
        f"replayed '{record['action_id']}' serves {outcome_digest(record)}, but "
        f"{as_digest(prior.outcome)} was recorded — "
        "the resumed session diverges while claiming to replay"
    )


@session_rule(
    "unstable-key",
    Severity.ERROR,
    fix="Derive the idempotency key from session and action identity only, never per attempt",
    **applies_when(any_field={"idempotency_key"}, needs_prior=True),
)
def unstable_key(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """One action carries different idempotency keys across attempts or restarts.

    ## Why is this bad?
    The key exists so that a repeated attempt is recognised as the same attempt. A key
    that changes between attempts, or is computed in memory and lost on a crash, makes
    every attempt look new to the far side.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"error","retryable":true,"max_attempts":3,"attempts":1,"idempotency_key":"pay-7d1c"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","retryable":true,"max_attempts":3,"attempts":2,"idempotency_key":"pay-90ab"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"error","retryable":true,"max_attempts":3,"attempts":1,"idempotency_key":"pay-s-1-a07"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","retryable":true,"max_attempts":3,"attempts":2,"idempotency_key":"pay-s-1-a07"}
    ```
    """
    key = record.get("idempotency_key")
    if not key or prior is None or not prior.key or key == prior.key:
        return None
    # Cite where this action carried its first key, which may be later than where the
    # action first appeared (a first attempt without a key).
    first_use = session.keys.get(prior.key)
    first = (
        first_use.where
        if first_use is not None and first_use.action_id == record["action_id"]
        else prior.where
    )
    return (
        f"action '{record['action_id']}' carries idempotency_key {_shown(key)}, but {_shown(prior.key)} "
        f"at {_at(first, where)} — the far side sees two different requests"
    )


@session_rule(
    "shared-key",
    Severity.ERROR,
    fix="Include the action id in the idempotency key so each action has its own",
    **applies_when(any_field={"idempotency_key"}),
)
def shared_key(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """Two different actions use the same idempotency key.

    ## Why is this bad?
    The far side collapses requests that share a key: the second action's effect is
    silently dropped and it receives the first one's response. Keys are compared within
    one session, as every session rule judges its session on its own: the same key in
    two sessions (`pay-a07`, made from the action id alone) is not reported, though the
    far side collapses those too. Make keys from the session and the action id. A replay
    (`replayed: true`) of an action the session holds sends nothing, so it is not judged
    again.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1"}
    {"session_id":"s-1","action_id":"a11","kind":"payment","status":"ok","idempotency_key":"pay-s-1"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a07"}
    {"session_id":"s-1","action_id":"a11","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a11"}
    ```
    """
    key = record.get("idempotency_key")
    if not key or type(key) is not str:
        return None
    if prior is not None and record.get("replayed") is True:
        return None  # a replay sends nothing; the action's own use of the key was judged
    first = session.keys.get(key)
    if first is None or first.action_id == record.get("action_id"):
        return None
    return (
        f"idempotency_key {_shown(key)} is already used by action '{first.action_id}' at "
        f"{_at(first.where, where)} — the far side collapses this effect into that one"
    )


@session_rule(
    "key-outlived-window",
    Severity.WARNING,
    fix="Finish or reconcile side effects within the provider's key window (about 24 h)",
    **applies_when(any_field={"idempotency_key"}, needs_prior=True),
)
def key_outlived_window(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """An idempotency key is re-sent long after its first use.

    ## Why is this bad?
    Payment and messaging providers keep idempotency keys for a limited time, commonly
    about 24 hours. A key re-sent after that window is a new request to them, and the
    effect can fire again. The window is `--key-window-s` (default 86,400 s) and needs
    `ts` on the records; the first use is dated by the first record with the key that has
    one. A replayed record (`replayed: true`) sends nothing, so it is not a re-send.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"started","idempotency_key":"pay-s-1-a07","ts":"2026-11-01T09:00:00Z"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a07","ts":"2026-11-03T09:00:00Z"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"started","idempotency_key":"pay-s-1-a07","ts":"2026-11-01T09:00:00Z"}
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a07","ts":"2026-11-01T09:00:02Z"}
    ```
    """
    key = record.get("idempotency_key")
    if not key or type(key) is not str or record.get("replayed") is True:  # a replay re-sends nothing
        return None
    first = session.keys.get(key)
    if first is None or first.ts is None or first.action_id != record["action_id"]:
        return None
    ts = parse_ts(record.get("ts"))
    if ts is None:
        return None
    age = ts - first.ts
    if age <= session.key_window_s:
        return None
    unit, seconds = _duration_unit(session.key_window_s)
    shown_age = f"{age / seconds:.1f}"
    # Just past the window the age rounds to it ("24.0 h ... beyond the 24 h key window"):
    # then say by how much it is past.
    by = f"{age - session.key_window_s:.3g} s " if float(shown_age) <= session.key_window_s / seconds else ""
    return (
        f"idempotency_key {_shown(key)} re-sent {shown_age} {unit} after its first use, {by}beyond the "
        f"{session.key_window_s / seconds:g} {unit} key window — the far side may have forgotten it"
    )


def _duration_unit(window_s: float) -> tuple[str, float]:
    """The unit to state a key window and an age beyond it in: hours, as providers state
    their windows, unless the window is shorter (a 10 s window was "0.00277778 h")."""
    if window_s >= 3600:
        return "h", 3600
    if window_s >= 60:
        return "min", 60
    return "s", 1


def _exhausted(record: ActionRecord) -> bool:
    """A retryable action's attempt failed at its cap (a record without ``attempts`` is
    the first attempt, so ``max_attempts: 1`` is used up by one failure)."""
    cap, attempt = record.get("max_attempts"), attempt_number(record)
    return (
        record.get("status") == "error"
        and record.get("retryable") is True
        and is_int(cap)
        and attempt is not None
        and attempt >= cap
    )


def _unescalated_retries(session: SessionState) -> Iterator[tuple[Pending, str]]:
    for pending in session.exhausted_retries.values():
        if session.status_of(pending.action_id) == "ok":
            continue
        yield (
            pending,
            f"'{pending.kind}' '{pending.action_id}' failed its last attempt {pending.detail} "
            "and nothing escalated — the session gives up silently",
        )


@session_rule(
    "retry-not-escalated",
    Severity.ERROR,
    fix="When the cap is reached, ask the user (on_failure: ask_user or a user_prompt)",
    at_end=_unescalated_retries,
    when=lambda facts: facts.kind == kinds.USER_PROMPT or facts.status == "error",
)
def retry_not_escalated(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A retryable action used up its attempts and nothing escalated (checked at session end).

    ## Why is this bad?
    A cap is the point where the system admits the failure is not transient. Reaching
    it should route somewhere, usually to the person: the missing thing is often
    information only they have. A session that just stops looks, from outside, like
    nothing happened. A replayed `user_prompt` (`replayed: true`) asks no one, so it is
    no escalation. A record without `attempts` is the action's first attempt (the
    instrumentation writes `attempts` from the second on), so a failure under
    `max_attempts: 1` has used the cap up. When a resumed run retries the action and uses
    the cap up again, its last attempt decides: `on_failure: ask_user` there escalates.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a05","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":3}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a05","kind":"tool_call","status":"error","retryable":true,"max_attempts":3,"attempts":3,"on_failure":"ask_user"}
    ```
    """
    pending = session.exhausted_retries
    if record["kind"] == kinds.USER_PROMPT:
        if record.get("replayed") is not True:  # a replayed answer asks no one
            pending.clear()
    elif _exhausted(record):
        if record.get("on_failure") != "ask_user":
            pending[record.get("action_id")] = Pending(
                record.get("action_id"),
                record.get("kind"),
                where,
                f"({attempt_number(record)} of {record.get('max_attempts')})",
            )
        elif record.get("replayed") is not True:
            # The action used its cap up again (a resumed run retried it) and this time
            # asked: its last attempt escalated, whatever an earlier run's did.
            pending.pop(record.get("action_id"), None)
    return None


@session_rule(
    "disguised-retry-loop",
    Severity.WARNING,
    fix="Retry under one action_id with max_attempts, so the cap and escalation apply",
    when=lambda facts: (
        facts.status == "error"
        or facts.kind == kinds.USER_PROMPT
        or "on_failure" in facts.fields
        or (facts.watching and facts.status == "ok")
    ),
    fields=frozenset({"on_failure"}),
)
def disguised_retry_loop(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """Five or more failures in a row of the same kind and name, each under a new action id.

    ## Why is this bad?
    A retry written as a new action escapes every cap: each attempt is "attempt 1" of
    a fresh action, so `max_attempts` never triggers and nothing escalates. Failures of
    other actions in between do not break the run; a success of the same kind and name,
    a `user_prompt` or an `on_failure: ask_user` does. A replayed record (`replayed:
    true`) executed nothing, so it neither counts as a failure nor breaks the run.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a10","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    {"session_id":"s-1","action_id":"a11","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    {"session_id":"s-1","action_id":"a12","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    {"session_id":"s-1","action_id":"a13","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    {"session_id":"s-1","action_id":"a14","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a10","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":1}
    {"session_id":"s-1","action_id":"a10","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":2}
    {"session_id":"s-1","action_id":"a10","kind":"tool_call","name":"book","status":"error","retryable":true,"max_attempts":3,"attempts":3,"on_failure":"ask_user"}
    ```
    """
    if record.get("replayed") is True:  # a replay neither fails, succeeds nor asks anew
        return None
    runs = session.failure_runs
    if record.get("kind") == kinds.USER_PROMPT or record.get("on_failure") == "ask_user":
        runs.clear()
        return None
    signature = (record.get("kind"), record.get("name") if type(record.get("name")) is str else None)
    if record.get("status") == "ok":
        runs.pop(signature, None)
        return None
    if record.get("status") != "error":
        return None
    run = runs.setdefault(signature, FailureRun())
    if run.reported:
        return None
    run.action_ids.add(record.get("action_id"))
    if len(run.action_ids) < LOOP_THRESHOLD:
        return None
    run.reported = True
    named = f" '{record.get('name')}'" if signature[1] else ""
    return (
        f"{len(run.action_ids)} consecutive failures of '{record['kind']}'{named} under different "
        "action_ids — a retry loop written as new actions bypasses every cap"
    )


def _unfinished_side_effects(session: SessionState) -> Iterator[tuple[Pending, str]]:
    for pending in session.unfinished_effects.values():
        if session.status_of(pending.action_id) not in (None, "started"):
            continue
        yield (
            pending,
            f"'{pending.kind}' '{pending.action_id}' started but never completed, with no "
            "idempotency_key and not replay: skip — recovery cannot know whether the effect happened",
        )


@session_rule(
    "unresolved-side-effect",
    Severity.ERROR,
    fix="Key the side effect (idempotency_key) so recovery can safely retry it, or mark replay: skip",
    at_end=_unfinished_side_effects,
    when=lambda facts: facts.status == "started" and might_side_effect(facts),
    fields=frozenset({"side_effects"}),
)
def unresolved_side_effect(
    session: SessionState, record: ActionRecord, where: Location, prior: ActionMemory | None
) -> Finding:
    """A side effect was started but never completed, and nothing makes retrying it safe (checked at session end).

    ## Why is this bad?
    The write-ahead `started` record says the effect may have happened; no completion
    says whether it did. Without an idempotency key recovery must either retry (and
    maybe charge twice) or skip (and maybe never charge): it cannot know which is right.

    ## Example
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"started"}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a07","kind":"payment","status":"started","idempotency_key":"pay-s-1-a07"}
    ```
    """
    if is_side_effecting(record) and not record.get("idempotency_key") and record.get("replay") != "skip":
        action_id = record["action_id"]
        session.unfinished_effects[action_id] = Pending(action_id, record["kind"], where)
    return None
