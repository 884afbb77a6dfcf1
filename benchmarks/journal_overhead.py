"""What the journal and the intent log cost an action, side by side with none.

Each action is a decorated function returning a small dict, run by
``durable_sessions.instrument.action`` on a ``TracerProvider`` with a
``BatchSpanProcessor`` and a no-op exporter. Setups, alternating round by round in one
process (the median round is reported; the ratios are what count on a shared machine):

- ``baseline``: no journal;
- ``journal``: a ``SqliteJournal`` in a temporary directory; each action writes its
  ``started`` entry and its ``ok`` entry, each a transaction with ``synchronous = FULL``;
- ``replay``: the same actions again on the filled journal: one read each, no write,
  the function not called;
- ``intent-log``: no journal, a ``DurabilitySpanProcessor(intent_log=...)`` on the
  provider and side-effecting actions (``payment``): one ``fsync``-ed line each;
- ``processor``: the same processor and actions without the intent log (the baseline of
  ``intent-log``);
- ``result-store``: no journal, each result written to a ``FileResultStore`` (as a result
  too long for a span is): a file written, ``fsync``-ed and renamed into place, and its
  directory ``fsync``-ed.

Run::

    .venv/bin/python benchmarks/journal_overhead.py [--actions 300] [--rounds 7]

It measures and prints; it asserts nothing. Both costs are dominated by ``fsync``, so
they depend on the disk under the temporary directory (``TMPDIR``) more than on the CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from durable_sessions.instrument import FileResultStore, action, session
from durable_sessions.journal import SqliteJournal
from durable_sessions.processor import DurabilitySpanProcessor


class NoOpExporter(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider(*processors: object) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NoOpExporter()))
    for processor in processors:
        provider.add_span_processor(processor)  # type: ignore[arg-type]
    return provider


def _run(
    provider: TracerProvider,
    kind: str,
    count: int,
    session_id: str,
    journal: SqliteJournal | None,
    store: FileResultStore | None = None,
) -> float:
    """Seconds per action for ``count`` actions of ``kind`` in one session; with ``store``,
    each result goes to it (as one too long for a span would)."""
    to_store = {"result_store": store, "max_result_chars": 1} if store is not None else {}
    steps = [
        action(f"a{n}", kind, tracer_provider=provider, idempotency_key=f"k{n}", **to_store)(
            lambda n=n: {"n": n}
        )
        for n in range(count)
    ]
    start = time.perf_counter()
    with session(session_id, journal=journal):
        for step in steps:
            step()
    return (time.perf_counter() - start) / count


def _round(directory: str, number: int, count: int) -> dict[str, float]:
    plain = _provider()
    journal = SqliteJournal(os.path.join(directory, f"journal-{number}.db"))
    intents = DurabilitySpanProcessor(
        mode="silent", intent_log=os.path.join(directory, f"intents-{number}.jsonl")
    )
    checked = DurabilitySpanProcessor(mode="silent")
    store = FileResultStore(os.path.join(directory, "results"))
    setups: list[tuple[str, Callable[[], float]]] = [
        ("baseline", lambda: _run(plain, "llm_call", count, f"b{number}", None)),
        ("journal", lambda: _run(plain, "llm_call", count, f"j{number}", journal)),
        ("replay", lambda: _run(plain, "llm_call", count, f"j{number}", journal)),
        ("processor", lambda: _run(_provider(checked), "payment", count, f"p{number}", None)),
        ("intent-log", lambda: _run(_provider(intents), "payment", count, f"i{number}", None)),
        ("result-store", lambda: _run(plain, "llm_call", count, f"r{number}", None, store)),
    ]
    results = {name: measure() for name, measure in setups}
    journal.close()
    for processor in (intents, checked):
        processor.shutdown()
    plain.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=300, help="actions per setup and round (default 300)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    args = parser.parse_args()
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="journal-bench-") as directory:
        _round(directory, -1, 20)  # warm up: imports, the SQLite library, the disk
        for number in range(args.rounds):
            rounds.append(_round(directory, number, args.actions))
    median = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    print(
        f"python {platform.python_version()}, {args.rounds} rounds of {args.actions} actions, TMPDIR on "
        f"{tempfile.gettempdir()}"
    )
    print(f"{'setup':<12} {'µs per action':>14} {'against':>22}")
    against = {
        "journal": "baseline",
        "replay": "baseline",
        "intent-log": "processor",
        "result-store": "baseline",
    }
    for name, seconds in median.items():
        base = against.get(name)
        ratio = f"{seconds / median[base]:.1f}× {base}" if base else ""
        print(f"{name:<12} {seconds * 1e6:>14.1f} {ratio:>22}")


if __name__ == "__main__":
    main()
