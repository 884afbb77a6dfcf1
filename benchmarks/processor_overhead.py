"""Per-span cost of ``DurabilitySpanProcessor``, side by side with the same setup without it.

Each span is: start, 6 attributes, end, on a ``TracerProvider`` with a
``BatchSpanProcessor`` and a no-op exporter (the baseline). The measured setup adds a
``DurabilitySpanProcessor`` to the same kind of provider. Rounds of the two alternate in
one process and the median round is reported, so the ratio is what counts, not the
absolute times.

Scenarios:

- ``action``: the 6 attributes describe an agent action (``session.id`` and five
  ``agent.action.*`` attributes, a clean tool call): the processor maps and checks every span;
- ``plain``: 6 ordinary attributes (HTTP-like): the processor decides "not an action".

Setups: ``baseline`` (no durability processor), ``empty`` (a ``SpanProcessor`` that
does nothing: the floor any added processor pays), ``inline`` (the rules run in
``span.end()``), ``process`` (``checking="process"``: the span is handed to a checker
process by the native sender, ``durable_sessions._native``) and ``process-python`` (the
same with ``DURABLE_SESSIONS_NATIVE=false``: the pure-Python sender and ``on_start``).
"catch-up" is how long ``force_flush`` then took: for the ``process`` setups, the time
the checker process needed after the last span to have checked everything.

Run::

    .venv/bin/python benchmarks/processor_overhead.py [--spans 5000] [--rounds 31] [--scenario action|plain|both] [--breakdown]
    .venv/bin/python benchmarks/processor_overhead.py --instructions   # needs valgrind

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import opentelemetry.sdk
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from durable_sessions.native import SWITCH as NATIVE_SWITCH
from durable_sessions.processor import DurabilitySpanProcessor


class NoOpExporter(SpanExporter):
    def export(self, spans: Sequence[object]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


SESSIONS = 50


SETUPS = ("baseline", "empty", "inline", "process", "process-python")
"""No durability processor; a processor that does nothing (the floor: what the SDK charges
for calling one more processor); one checking in ``span.end()``; one handing spans to a
checker process natively; the same without the native extension."""


def make_provider(setup: str, batching: bool = True) -> TracerProvider:
    """A provider for ``setup``; its exporting processor batches, or exports each span as it
    ends (``batching=False``, for instruction counts: no exporter thread)."""
    provider = TracerProvider()
    exporting = BatchSpanProcessor(NoOpExporter()) if batching else SimpleSpanProcessor(NoOpExporter())
    provider.add_span_processor(exporting)
    if setup == "empty":
        provider.add_span_processor(SpanProcessor())
    elif setup != "baseline":
        checking, _, sender = setup.partition("-")
        os.environ[NATIVE_SWITCH] = "false" if sender == "python" else "true"
        provider.add_span_processor(
            DurabilitySpanProcessor(mode="silent", max_sessions=SESSIONS * 2, checking=checking)  # type: ignore[arg-type]
        )
        del os.environ[NATIVE_SWITCH]
    return provider


def emit(provider: TracerProvider, spans: int, scenario: str, round_no: int) -> float:
    """Start, set 6 attributes on, and end ``spans`` spans; the seconds that took."""
    tracer = provider.get_tracer("bench")
    sessions = [f"s-{round_no}-{i}" for i in range(SESSIONS)]
    ids = [f"a{i}" for i in range(spans)]
    gc.collect()
    start = time.perf_counter()
    if scenario == "action":
        for i in range(spans):
            span = tracer.start_span("tool search")
            span.set_attribute("session.id", sessions[i % SESSIONS])
            span.set_attribute("agent.action.id", ids[i])
            span.set_attribute("agent.action.kind", "tool_call")
            span.set_attribute("agent.action.name", "search")
            span.set_attribute("agent.action.retryable", True)
            span.set_attribute("agent.action.max_attempts", 3)
            span.end()
    else:
        for i in range(spans):
            span = tracer.start_span("GET /items")
            span.set_attribute("http.request.method", "GET")
            span.set_attribute("url.path", "/items")
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("server.address", "api.example.com")
            span.set_attribute("server.port", 443)
            span.set_attribute("user_agent.original", ids[i])
            span.end()
    return time.perf_counter() - start


def run_round(provider: TracerProvider, spans: int, scenario: str, round_no: int) -> tuple[float, float]:
    """Seconds per span for ``spans`` spans, and seconds the processors took to catch up after."""
    elapsed = emit(provider, spans, scenario, round_no)
    start = time.perf_counter()
    provider.force_flush()
    return elapsed / spans, time.perf_counter() - start


CALLGRIND = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")


def instructions(scenario: str, setup: str, spans: tuple[int, int] = (2_000, 12_000)) -> float:
    """Instructions per span in the application's process (callgrind; checker processes are
    not traced), from the difference between two runs, so that start-up cancels out."""
    counts = []
    for n in spans:
        result = subprocess.run(
            [*CALLGRIND, sys.executable, __file__, "--count-run", setup, scenario, str(n)],
            capture_output=True,
            text=True,
            check=True,
        )
        counts.append(int(re.search(r"refs:\s+([\d,]+)", result.stderr).group(1).replace(",", "")))  # type: ignore[union-attr]
    return (counts[1] - counts[0]) / (spans[1] - spans[0])


def count_run(setup: str, scenario: str, spans: int) -> None:
    """The process callgrind counts: ``spans`` spans, exported one by one, then exit at once."""
    provider = make_provider(setup, batching=False)
    emit(provider, spans, scenario, 0)
    provider.force_flush()
    os._exit(0)


def measure(scenario: str, spans: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    """Per setup: median seconds per span, median overhead over the baseline round run
    just before it (paired, so the machine's slow drifts cancel), median catch-up seconds."""
    providers = {setup: make_provider(setup) for setup in SETUPS}
    for provider in providers.values():  # warm up (and let the checker process start)
        run_round(provider, min(spans, 2000), scenario, -1)
    times: dict[str, list[tuple[float, float]]] = {setup: [] for setup in SETUPS}
    for round_no in range(rounds):
        for setup, provider in providers.items():
            times[setup].append(run_round(provider, spans, scenario, round_no))
    for provider in providers.values():
        provider.shutdown()
    base = times["baseline"]
    return {
        setup: (
            statistics.median(t for t, _ in rows),
            statistics.median(t / b[0] - 1 for (t, _), b in zip(rows, base, strict=True)),
            statistics.median(c for _, c in rows),
        )
        for setup, rows in times.items()
    }


def breakdown(spans: int, rounds: int) -> dict[str, float]:
    """Microseconds per action span spent in each part of ``on_end`` (best of ``rounds``)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from durable_sessions.engine import Checker
    from durable_sessions.mapping import map_attributes, sdk_attributes
    from durable_sessions.record import Location

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    for i in range(spans):
        span = tracer.start_span("tool search")
        span.set_attribute("session.id", f"s-{i % SESSIONS}")
        span.set_attribute("agent.action.id", f"a{i}")
        span.set_attribute("agent.action.kind", "tool_call")
        span.set_attribute("agent.action.name", "search")
        span.set_attribute("agent.action.retryable", True)
        span.set_attribute("agent.action.max_attempts", 3)
        span.end()
    finished = exporter.get_finished_spans()
    where = Location(None, None, "0" * 32, "0" * 16)

    def mapping() -> None:
        for span in finished:
            attributes, limit = sdk_attributes(span)
            map_attributes(attributes, {}, False, span.start_time, "0" * 32, "0" * 16, limit, False)

    records = [
        map_attributes(sdk_attributes(s)[0], {}, False, s.start_time, "0" * 32, "0" * 16, None, False)[0]  # type: ignore[index]
        for s in finished
    ]

    def engine() -> None:
        checker = Checker(max_sessions=SESSIONS * 2)
        for record in records:
            checker.feed(record, where)

    def on_end() -> None:
        processor = DurabilitySpanProcessor(mode="silent", max_sessions=SESSIONS * 2)
        for span in finished:
            processor.on_end(span)

    def best(run: object) -> float:
        times = []
        for _ in range(rounds):
            gc.collect()
            start = time.perf_counter()
            run()  # type: ignore[operator]
            times.append((time.perf_counter() - start) / len(finished) * 1e6)
        return min(times)

    return {"mapping": best(mapping), "engine.feed": best(engine), "on_end (all)": best(on_end)}


def print_instructions(scenarios: Sequence[str]) -> None:
    print(f"{'scenario':<8} {'setup':<14} {'instr/span':>11} {'added':>9}")
    for scenario in scenarios:
        base = instructions(scenario, "baseline")
        print(f"{scenario:<8} {'baseline':<14} {base:>11,.0f}")
        for setup in SETUPS[2:]:  # the empty processor is the wall-clock floor; not counted here
            count = instructions(scenario, setup)
            print(f"{scenario:<8} {setup:<14} {count:>11,.0f} {(count / base - 1) * 100:>8.1f}%")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=5_000, help="spans per round (default 5000)")
    parser.add_argument("--rounds", type=int, default=31, help="rounds per setup (default 31)")
    parser.add_argument("--scenario", choices=("action", "plain", "both"), default="both")
    parser.add_argument("--breakdown", action="store_true", help="also time on_end's parts separately")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per span with valgrind's callgrind instead of timing",
    )
    parser.add_argument(
        "--count-run", nargs=3, metavar=("SETUP", "SCENARIO", "SPANS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.count_run:
        count_run(args.count_run[0], args.count_run[1], int(args.count_run[2]))
    scenarios = ("action", "plain") if args.scenario == "both" else (args.scenario,)
    if args.instructions:
        print_instructions(scenarios)
        return 0
    print(
        f"python {platform.python_version()} ({platform.python_implementation()}), "
        f"opentelemetry-sdk {opentelemetry.sdk.version.__version__}, {platform.machine()}; "
        f"{args.spans} spans x {args.rounds} rounds, median round"
    )
    print(f"{'scenario':<8} {'setup':<14} {'us/span':>8} {'overhead':>9} {'catch-up ms':>12}")
    for scenario in scenarios:
        results = measure(scenario, args.spans, args.rounds)
        for setup, (per_span, ratio, catch_up) in results.items():
            overhead = "" if setup == "baseline" else f"{ratio * 100:.1f}%"
            print(f"{scenario:<8} {setup:<14} {per_span * 1e6:>8.2f} {overhead:>9} {catch_up * 1e3:>12.1f}")
    if args.breakdown:
        parts = breakdown(args.spans, 5)
        print(
            "on_end of an action span, us/span (best of 5): "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
