"""Holding a long session again from a snapshot of its state, against re-feeding its records.

For one session of each ``--actions`` count and shape, in this process: the time to feed
its records to a new :class:`~durable_sessions.engine.Checker` (what a rebuild from the
store costs the engine, the store's reading and mapping aside), to take
``Checker.snapshot`` of it, and to ``Checker.restore`` that into another new checker
(whose symbol table numbered another session's strings first), and the snapshot's size
(and, for a store that would compress it, its size after ``zlib`` at level 1). Shapes:

- ``llm_call``: one ``llm_call`` span per action, its result recorded by digest, as an
  agent's long conversation reaches the sidecar;
- ``mixed``: prompts answered, model calls, keyed and retried tool calls, payments
  started then completed, failures, an incarnation change every 10,000 actions.

Past ``max_actions_per_session`` (100,000) a session holds its last 100,000 actions, so a
snapshot's size and time stop growing there; feeding does not. Run::

    .venv/bin/python benchmarks/session_snapshot.py [--actions 100000 300000] [--rounds 3]

With ``DURABLE_SESSIONS_NATIVE=false`` the feed is the pure-Python engine's (snapshot and
restore are Python either way). It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

from durable_sessions.digest import digest_text
from durable_sessions.engine import Checker
from durable_sessions.native import native_module
from durable_sessions.record import Location, span_location

SESSION = "week-long"
TRACE = "ab" * 16
Step = tuple[dict[str, Any], Location]


def llm_call(n: int, start_ts: float = 1_700_000_000) -> dict[str, Any]:
    """Action ``n`` of an agent's long conversation: a model call and its recorded answer."""
    return {
        "session_id": SESSION,
        "action_id": f"a{n}",
        "kind": "llm_call",
        "status": "ok",
        "incarnation": "run-1",
        "seq": n,
        "ts": start_ts + n / 1000,
        "result_digest": digest_text(f"answer {n}"),
    }


def llm_calls(actions: int) -> list[Step]:
    return [(llm_call(n), span_location(TRACE, f"{n + 1:016x}")) for n in range(actions)]


def _mixed_record(n: int) -> dict[str, Any]:
    record: dict[str, Any] = {
        "session_id": SESSION,
        "action_id": f"a{n}",
        "incarnation": f"run-{n // 10_000}",
        "seq": n,
        "ts": 1_700_000_000 + n,
        "status": "ok",
    }
    match n % 8:
        case 0:
            record.update(
                kind="user_prompt", prompt_digest=digest_text(f"q{n}"), result_digest=digest_text(f"{n}")
            )
        case 1 | 2:
            record.update(kind="llm_call", result_digest=digest_text(f"answer {n}"))
        case 3:
            record.update(kind="tool_call", name="search", retryable=True, attempts=1 + n % 3, max_attempts=3)
        case 4:
            record.update(kind="payment", status="started", idempotency_key=f"pay-{n}")
        case 5:
            record.update(
                action_id=f"a{n - 1}",
                kind="payment",
                idempotency_key=f"pay-{n - 1}",
                result_digest=digest_text("paid"),
            )
        case 6:
            record.update(kind="tool_call", name="book", status="error")
        case _:
            record.update(kind="email", idempotency_key=f"mail-{n}", side_effects=True)
    return record


def mixed(actions: int) -> list[Step]:
    return [(_mixed_record(n), span_location(TRACE, f"{n + 1:016x}")) for n in range(actions)]


def _warmed() -> Checker:
    """A new checker that has numbered another session's strings first."""
    checker = Checker()
    checker.feed({"session_id": "other", "action_id": "x", "kind": "clock", "status": "error"})
    checker.feed({"session_id": "other", "action_id": "y", "kind": "tool_call", "status": "started"})
    return checker


def _timed(work: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``work`` took, and what it gave; each starts from a collected heap, so that
    none pays for a collection the one before made due."""
    gc.collect()
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def one_round(steps: list[Step]) -> dict[str, float]:
    fed = Checker()
    feed = fed.feed
    feed_s, _ = _timed(lambda: [feed(record, where) for record, where in steps])
    snapshot_s, data = _timed(lambda: fed.snapshot(SESSION))
    restoring = _warmed()
    restore_s, restored = _timed(lambda: restoring.restore(SESSION, data))
    if not restored:
        raise SystemExit("the snapshot was not restored")
    return {
        "feed_s": feed_s,
        "snapshot_s": snapshot_s,
        "restore_s": restore_s,
        "bytes": len(data),
        "zlib_bytes": len(zlib.compress(data, 1)),
        "held": len(fed._sessions[SESSION].actions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"Python {platform.python_version()}, {platform.machine()}, "
        f"native engine: {native_module('_engine') is not None}; median of {args.rounds} rounds"
    )
    print(
        f"{'session':>16} {'held':>8} {'feed':>8} {'snapshot':>9} {'restore':>8} {'feed/restore':>13} "
        f"{'size':>10} {'B/held':>7} {'zlib -1':>10}"
    )
    for shape, make in (("llm_call", llm_calls), ("mixed", mixed)):
        for actions in args.actions:
            steps = make(actions)
            rounds = [one_round(steps) for _ in range(args.rounds)]
            m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            print(
                f"{f'{shape} {actions:,}':>16} {m['held']:>8,.0f} {m['feed_s']:>7.2f}s "
                f"{m['snapshot_s'] * 1000:>7.0f}ms {m['restore_s'] * 1000:>6.0f}ms "
                f"{m['feed_s'] / m['restore_s']:>12.1f}x {m['bytes']:>10,.0f} "
                f"{m['bytes'] / m['held']:>7.1f} {m['zlib_bytes']:>10,.0f}"
            )


if __name__ == "__main__":
    main()
