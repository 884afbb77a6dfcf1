"""Rules that readers raise before a record exists."""

from __future__ import annotations

from durable_sessions.rules.base import line_rule
from durable_sessions.violation import Severity


@line_rule(
    "unreadable-line",
    Severity.ERROR,
    fix="Write one JSON object per line, UTF-8 encoded",
    seed=True,
)
def unreadable_line() -> None:
    """A log line is not valid JSON, or not a JSON object.

    ## Why is this bad?
    Recovery reads the log to learn what already happened. A line it cannot read is an
    action it cannot replay: whatever that action did (a question answered, a card
    charged) is forgotten, and the resumed session re-runs it.

    ## Example
    ```
    {"session_id":"s-1","action_id":"a01","kind":"payment","status":"ok",
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a01","kind":"payment","status":"ok","idempotency_key":"pay-s-1-a01"}
    ```
    """


@line_rule(
    "missing-field",
    Severity.ERROR,
    fix="Give every record a non-empty string session_id, action_id, kind and status",
    seed=True,
)
def missing_field() -> None:
    """A record lacks a required field (`session_id`, `action_id`, `kind`, `status`).

    ## Why is this bad?
    These four fields are how recovery finds an action again: the session it belongs
    to, its identity within that session, what kind of action it is and whether it
    finished. Without any one of them the record cannot be matched on replay, so the
    action is re-run. A record with a missing field is not checked any further.

    ## Example
    ```json
    {"session_id":"s-1","kind":"llm_call","status":"ok","result":{}}
    ```

    ## Use instead
    ```json
    {"session_id":"s-1","action_id":"a02","kind":"llm_call","status":"ok","result":{}}
    ```
    """
