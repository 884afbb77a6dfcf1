"""Throughput of ``durable-sessions check`` against a bare ``json.loads`` loop.

Generates a realistic action log (by default 1,000,000 actions in 10,000 interleaved
sessions, the kind mix of the seed's fixtures, a few percent violations), then times,
alternately and in the same process tree:

- baseline: a bare loop that only ``json.loads`` every line of the file;
- check:    ``durable-sessions check FILE --format json`` with every rule on (and
            its default ``--jobs``: one worker per core for a file this size).

Reports each round, the wall time medians and their ratio, the median of the rounds'
ratios (each check against the baseline run just before it, which cancels slow drifts
in the machine's load), and each child's peak RSS (from ``wait4``).
Target (issue 2): ratio <= 1.5, check peak RSS <= 300 MB.

``--otlp`` checks the same records as OTLP/JSON requests instead (:func:`to_otlp`,
written beside the log), with some requests delivered twice.

``--baseline TREE`` times, in each round, also the check of another source tree (its
``src`` put first on ``PYTHONPATH``; build its C extensions in place first, or it runs
the pure-Python engine), and reports this tree's check against it, paired per round.

    python benchmarks/check_throughput.py [--actions N] [--sessions N] [--rounds N] [--otlp] [--baseline TREE]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import orjson

from durable_sessions.semconv import attribute

BASELINE = "import json,sys\nfor line in open(sys.argv[1],'rb'):\n    json.loads(line)\n"
CHECK = [sys.executable, "-m", "durable_sessions", "check", "--format", "json"]


def session_script(session_id: str, rng: random.Random, violation_rate: float):
    """The actions of one booking-like session, in order, some deliberately broken."""
    n = 0
    incarnation = f"run-{rng.randrange(1_000_000):06d}"

    def rec(kind: str, **fields):
        nonlocal n
        n += 1
        base = {"session_id": session_id, "action_id": f"a{n:03d}", "kind": kind, "status": "ok"}
        base["ts"] = f"2026-11-{1 + n // 50:02d}T{n % 24:02d}:{n % 60:02d}:00Z"
        base["incarnation"] = incarnation
        base.update(fields)
        return base

    def broken() -> bool:
        return rng.random() < violation_rate

    while True:
        yield rec(
            "user_prompt",
            prompt="Where to and what budget?",
            **(
                {}
                if broken()
                else {"result": {"destination": "Kyoto", "budget_gbp": rng.randrange(500, 5000)}}
            ),
        )
        for _ in range(3):
            yield rec(
                "llm_call",
                name="main",
                **({} if broken() else {"result_ref": f"blob://sessions/{session_id}/a{n + 1:03d}.json"}),
            )
            yield rec(
                "external_read",
                name="flightsearch",
                cacheable=True,
                cache_key=f"flights:LHR-KIX:{rng.randrange(30)}",
                ttl_s=86400,
                result={"quotes": rng.randrange(10)},
            )
            attempts = rng.randrange(1, 4)
            yield rec(
                "tool_call",
                name="seat_map",
                status="ok" if attempts < 3 else "error",
                retryable=True,
                max_attempts=3,
                attempts=attempts,
                **({"on_failure": "ask_user"} if attempts == 3 else {}),
                result={"seat_map": "ok"},
            )
        yield rec("clock", result={"now": "2026-11-01T09:14:00Z"})
        key = {} if broken() else {"idempotency_key": f"pay-{session_id}-a{n + 1:03d}"}
        yield rec(
            "payment",
            name="stripe",
            amount_gbp=rng.randrange(100, 3000),
            result={"charge": f"ch_{rng.randrange(1 << 30):x}"},
            **key,
        )
        yield rec("email", replay="skip", to="traveller", result=None)
        yield rec(
            "write", name="itinerary", idempotency_key=f"itinerary-{session_id}-{n + 1}", result={"rows": 1}
        )


def generate(path: str, actions: int, sessions: int, seed: int = 7, violation_rate: float = 0.03) -> None:
    rng = random.Random(seed)
    scripts = [session_script(f"s-{i:06d}", rng, violation_rate) for i in range(sessions)]
    per_session = actions // sessions
    remaining = [per_session] * sessions
    live = list(range(sessions))
    with open(path, "wb") as out:
        while live:
            i = rng.randrange(len(live))
            s = live[i]
            out.write(orjson.dumps(next(scripts[s])) + b"\n")
            remaining[s] -= 1
            if remaining[s] == 0:
                live[i] = live[-1]
                live.pop()


OTLP_BATCH = 100
"""Spans per OTLP/JSON request line, as a Collector's batch processor sends a few."""
OTLP_RETRY_EVERY = 50
"""Every this many requests is written twice: a retried Export."""


def to_otlp(path: str, otlp_path: str, seed: int = 7) -> None:
    """The action log at ``path`` as OTLP/JSON requests at ``otlp_path``: each record a span
    carrying its fields as ``agent.action.*`` attributes, its session's trace id and a
    random span id, ``OTLP_BATCH`` spans to a line, every ``OTLP_RETRY_EVERY``-th request
    delivered twice (the redeliveries the reader drops)."""
    rng = random.Random(seed)
    with open(path, "rb") as source, open(otlp_path, "wb") as out:
        batch: list[dict] = []
        requests = 0
        for number, line in enumerate(source):
            batch.append(otlp_span(orjson.loads(line), rng.getrandbits(64), number))
            if len(batch) == OTLP_BATCH:
                request = orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": batch}]}]}) + b"\n"
                requests += 1
                out.write(request * (2 if requests % OTLP_RETRY_EVERY == 0 else 1))
                batch = []
        if batch:
            out.write(orjson.dumps({"resourceSpans": [{"scopeSpans": [{"spans": batch}]}]}) + b"\n")


def otlp_span(record: dict, span_id: int, number: int) -> dict:
    attributes = [{"key": "session.id", "value": {"stringValue": record.pop("session_id")}}]
    for name, value in record.items():
        if name in ("ts", "incarnation"):  # the span's start time dates it; one resource per request
            continue
        if type(value) is bool:
            typed = {"boolValue": value}
        elif type(value) is int:
            typed = {"intValue": str(value)}
        else:
            typed = {"stringValue": value if type(value) is str else orjson.dumps(value).decode()}
        attributes.append({"key": attribute(name), "value": typed})
    return {
        "traceId": f"{zlib.crc32(attributes[0]['value']['stringValue'].encode()):032x}",
        "spanId": f"{span_id:016x}",
        "name": record["kind"],
        "startTimeUnixNano": str(1_767_225_600_000_000_000 + number * 1_000_000),
        "endTimeUnixNano": str(1_767_225_600_000_000_000 + number * 1_000_000 + 500_000),
        "attributes": attributes,
    }


def tree_rss_kb(pid: int) -> int:
    """Resident memory of a process and all its descendants, from /proc (0 if gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


def timed(
    argv: list[str], env: dict[str, str] | None = None, output: str | None = None
) -> tuple[float, float, int]:
    """Wall seconds, peak RSS of the whole process tree in MB, and exit code of one command
    (run in ``env``, by default this process's environment; its standard output written
    to the file ``output``, by default dropped).

    The tree's resident memory is sampled every 20 ms (the command and the workers it
    starts); the peak is never below the command's own ``ru_maxrss`` from ``wait4``.
    """
    start = time.perf_counter()
    with open(output or os.devnull, "wb") as out:
        child = subprocess.Popen(argv, stdout=out, env=env)
    peak_kb = 0
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        peak_kb = max(peak_kb, tree_rss_kb(child.pid))
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    return elapsed, max(peak_kb, usage.ru_maxrss) / 1024, os.waitstatus_to_exitcode(status)


def checked_actions(report: str) -> int | None:
    """The ``actions`` a ``check --format json`` report counts, or None when it holds none."""
    try:
        with open(report, "rb") as file:
            return orjson.loads(file.read())["actions"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actions", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", metavar="FILE", help="write the log here and keep it")
    parser.add_argument("--jobs", type=int, help="pass --jobs N to the check (default: its own default)")
    parser.add_argument("--baseline", metavar="TREE", help="also time the check of this source tree")
    parser.add_argument("--otlp", action="store_true", help="check the log as OTLP/JSON requests (to_otlp)")
    args = parser.parse_args()
    tree_env = None
    if args.baseline:
        tree_src = os.path.join(os.path.abspath(args.baseline), "src")
        if not os.path.isfile(os.path.join(tree_src, "durable_sessions", "__init__.py")):
            parser.error(f"--baseline {args.baseline}: no src/durable_sessions/__init__.py in that tree")
        tree_env = {**os.environ, "PYTHONPATH": tree_src}
    path = args.keep or os.path.join(tempfile.mkdtemp(), "actions.jsonl")
    if not os.path.exists(path):
        generate(path, args.actions, args.sessions)
    if args.otlp:
        path = path + ".otlp.jsonl"
        if not os.path.exists(path):
            to_otlp(path.removesuffix(".otlp.jsonl"), path)
    size_mb = os.path.getsize(path) / 1e6
    base, check, tree = [], [], []
    check_argv = [*CHECK, *(["--jobs", str(args.jobs)] if args.jobs else []), path]
    for round_ in range(1, args.rounds + 1):
        base.append(timed([sys.executable, "-c", BASELINE, path]))
        check.append(timed(check_argv))
        (tb, _, _), (tc, _, _) = base[-1], check[-1]
        line = f"round {round_}: baseline {tb:.2f} s, check {tc:.2f} s, ratio {tc / tb:.2f}"
        if tree_env is not None:
            tree.append(timed(check_argv, tree_env, output=f"{path}.tree.json"))
            tt = tree[-1][0]
            if checked_actions(f"{path}.tree.json") != args.actions:  # it failed: its time measures nothing
                sys.exit(f"the baseline tree's check did not report {args.actions:,} actions: run it by hand")
            line += f"; baseline tree's check {tt:.2f} s, check / tree's {tc / tt:.2f}"
        print(line, flush=True)
    b = statistics.median(t for t, _, _ in base)
    c = statistics.median(t for t, _, _ in check)
    paired = statistics.median(tc / tb for (tb, _, _), (tc, _, _) in zip(base, check, strict=True))
    rss_b = max(r for _, r, _ in base)
    rss_c = max(r for _, r, _ in check)
    codes = {code for _, _, code in check}
    print(
        f"input: {args.actions:,} actions, {args.sessions:,} sessions, {size_mb:.0f} MB, {args.rounds} rounds"
    )
    print(
        f"baseline json.loads loop: {b:.2f} s  ({args.actions / b:,.0f} records/s), peak RSS {rss_b:.0f} MB"
    )
    print(
        f"durable-sessions check:   {c:.2f} s  ({args.actions / c:,.0f} actions/s), peak RSS {rss_c:.0f} MB, exit {codes}"
    )
    print(f"ratio check / baseline:   {c / b:.2f}  (target <= 1.5)")
    print(f"median of round ratios:   {paired:.2f}  (each check against the baseline just before it)")
    print(f"peak RSS of check:        {rss_c:.0f} MB (target <= 300)")
    if tree:
        t = statistics.median(t for t, _, _ in tree)
        against = statistics.median(tc / tt for (tc, _, _), (tt, _, _) in zip(check, tree, strict=True))
        print(f"baseline tree's check:    {t:.2f} s, peak RSS {max(r for _, r, _ in tree):.0f} MB")
        print(f"check / tree's check:     {against:.2f} median of round ratios")
    if tree:
        os.remove(f"{path}.tree.json")
    if args.otlp and not args.keep:
        os.remove(path)
        path = path.removesuffix(".otlp.jsonl")
    if not args.keep:
        os.remove(path)


if __name__ == "__main__":
    main()
