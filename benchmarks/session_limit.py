"""What an action costs the engine once its session is past ``max_actions_per_session``,
against what it cost below the limit, in the same run.

One session of ``--actions`` distinct action ids (tool calls, each with an idempotency
key) is fed to a bare :class:`~durable_sessions.engine.Checker` whose limit is
``--limit``; the cost per action is timed in blocks of ``--block``. Past the limit, each
new action makes the session forget its oldest action id and key. Run::

    .venv/bin/python benchmarks/session_limit.py [--actions 250000] [--limit 100000] [--rounds 3]

With ``DURABLE_SESSIONS_NATIVE=false`` it measures the pure-Python fold. It measures and
prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from durable_sessions.engine import Checker
from durable_sessions.native import native_module


def one_round(actions: int, limit: int, block: int) -> list[float]:
    """Microseconds per action, block by block."""
    records = [
        {
            "session_id": "s",
            "action_id": f"a{i}",
            "kind": "tool_call",
            "status": "ok",
            "idempotency_key": f"k{i}",
        }
        for i in range(actions)
    ]
    checker = Checker(max_actions_per_session=limit)
    costs = []
    for start in range(0, actions, block):
        began = time.perf_counter()
        for record in records[start : start + block]:
            checker.feed(record)
        costs.append((time.perf_counter() - began) / block * 1e6)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", type=int, default=250_000)
    parser.add_argument("--limit", type=int, default=100_000)
    parser.add_argument("--block", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.block <= args.limit <= args.actions - args.block:
        parser.error(
            "needs a whole --block below --limit and one past it: 0 < block <= limit <= actions - block"
        )
    print(
        f"Python {platform.python_version()}, {platform.machine()}, native fold: {native_module() is not None}"
    )
    ratios = []
    for number in range(1, args.rounds + 1):
        costs = one_round(args.actions, args.limit, args.block)
        below = [cost for i, cost in enumerate(costs) if (i + 1) * args.block <= args.limit]
        past = [cost for i, cost in enumerate(costs) if i * args.block >= args.limit]
        ratios.append(statistics.median(past) / statistics.median(below))
        shown = ", ".join(f"{cost:.2f}" for cost in costs)
        print(
            f"round {number}: µs per action by block of {args.block}: {shown}; past / below {ratios[-1]:.2f}x"
        )
    print(f"median past / below the limit: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
