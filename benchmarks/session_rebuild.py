"""Rebuilding a long session from the store: time and peak memory per stored action.

A session not in memory (ended at idle, evicted, or from before a restart) is rebuilt by
re-feeding its stored records to the engine, in the writer thread, when its next span
arrives or when the idle sweep ends it. This stores one session of ``--actions`` actions
(one ``llm_call`` span each with its answer's digest, as an agent's long conversation) in a SQLite file — or, with
``--store postgresql://…``, in a fresh schema there, dropped afterwards — then, in a new
child process each round, has the sidecar's evaluator end it (rebuild, then its
end-of-session rules) and reports the time per action and how far the process's peak
RSS (``VmHWM``) rose during the rebuild. Each round measures both ways a session is
rebuilt: ``re-fed`` (every stored record fed to the engine again: no state of the
session is kept in the store, as for a session below 1,000 records, or a state another
release kept) and ``restored`` (the engine's state kept in the store restored, no record
re-fed). ``--baseline TREE`` adds the ``re-fed`` rounds of another source tree's
``collector/src`` (e.g. ``git archive origin/main collector/src | tar -x -C TREE``; one
that reads this store's schema version), alternating, on the same store.

Run::

    .venv/bin/python benchmarks/session_rebuild.py [--actions 300000] [--rounds 3] [--baseline TREE]
        [--store postgresql://…]

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collector_ingest import _postgres_schema  # a fresh schema, as its other modes make
from session_snapshot import SESSION, TRACE, llm_call

HERE = Path(__file__).resolve().parent.parent


def _peak_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1])
    return 0


def fill(store_url: str, actions: int) -> None:
    """Store one session of ``actions`` actions, as the sidecar stores them."""
    from durable_sessions_collector.store import action_row, open_store

    store = open_store(store_url)
    now = time.time()
    for start in range(0, actions, 10_000):
        with store.writer() as writer:
            for n in range(start, min(actions, start + 10_000)):
                writer.add_action(action_row(llm_call(n, now), TRACE, f"{n + 1:016x}"), now)  # type: ignore[arg-type]
            writer.touch_session(SESSION, now, min(actions, start + 10_000) - start)
    store.close()


def keep_state(store_url: str, state: bytes | None) -> bytes:
    """Keep ``state`` as the session's state (None: one no engine restores); return the
    state kept before."""
    from durable_sessions_collector.store import open_store

    store = open_store(store_url)
    with store.writer() as writer:
        kept = writer.kept_state(SESSION)
        writer.keep_state(SESSION, store.count_actions() if state else 0, state or b"")
    store.close()
    return kept.state if kept else b""


def measure(store_url: str, mode: str = "re-fed") -> dict[str, float]:
    """In this (fresh) process: end the stored session through a new evaluator, which keeps
    no state of it (``re-fed``) or restores the state kept (``restored``)."""
    from durable_sessions_collector.evaluator import Evaluator
    from durable_sessions_collector.store import open_store

    store = open_store(store_url)
    evaluator = Evaluator(keep_state_after=2**62) if mode == "re-fed" else Evaluator()
    before = _peak_kib()
    started = time.perf_counter()
    with store.writer() as writer:
        evaluator.end(writer, SESSION)
    elapsed = time.perf_counter() - started
    actions = store.count_actions()
    store.close()
    assert evaluator.restored == (mode == "restored"), "the rebuild was not the one measured"
    return {
        "s": elapsed,
        "us_per_action": elapsed / actions * 1e6,
        "peak_rise_mib": (_peak_kib() - before) / 1024,
    }


def _child(tree: Path, store_url: str, mode: str = "re-fed") -> dict[str, float]:
    """One measurement in a fresh process with ``tree``'s collector; a child that fails
    (a baseline that cannot read this store's schema, say) ends the run with its error
    output shown, which a bare CalledProcessError hid."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "collector" / "src"), str(HERE / "src")])}
    out = subprocess.run(
        [sys.executable, __file__, "--measure", store_url, *(["--mode", mode] if mode != "re-fed" else [])],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(
            f"the {mode} measurement with {tree / 'collector' / 'src'} failed (exit code {out.returncode}):\n"
            f"{out.stderr.rstrip()}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--store", help="a PostgreSQL URL (default: a SQLite file)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="re-fed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.mode)))
        return
    drop = None
    with tempfile.TemporaryDirectory(prefix="rebuild-") as work:
        if args.store:
            store_url, drop = _postgres_schema(args.store, "ds_bench_rebuild")
        else:
            store_url = f"sqlite:///{work}/sessions.db"
        try:
            started = time.perf_counter()
            fill(store_url, args.actions)
            print(f"stored one session of {args.actions:,} actions in {time.perf_counter() - started:.1f} s")
            _child(HERE, store_url, "keep")  # keeps the session's state, as its idle end does
            state = keep_state(store_url, None)
            runs = [("re-fed", HERE, "re-fed"), ("restored", HERE, "restored")]
            runs += [("baseline", args.baseline, "re-fed")] if args.baseline else []
            results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in runs}
            for round_ in range(args.rounds):
                for name, tree, mode in runs:
                    keep_state(store_url, state if mode == "restored" else None)
                    result = _child(tree, store_url, mode)
                    results[name].append(result)
                    print(
                        f"round {round_ + 1} {name:>9}: {result['s']:.2f} s, {result['us_per_action']:.1f} µs/action, "
                        f"peak RSS +{result['peak_rise_mib']:.0f} MiB"
                    )
            for name, rows in results.items():
                print(
                    f"median {name:>9}: {statistics.median(r['us_per_action'] for r in rows):.1f} µs/action, "
                    f"peak RSS +{statistics.median(r['peak_rise_mib'] for r in rows):.0f} MiB "
                    f"({statistics.median(r['peak_rise_mib'] for r in rows) * 1024 * 1024 / args.actions:.0f} B/action)"
                )
        finally:
            if drop is not None:
                drop()


if __name__ == "__main__":
    main()
