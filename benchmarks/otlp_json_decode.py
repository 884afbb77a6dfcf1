"""What decoding an OTLP/JSON Export costs the sidecar's HTTP receiver, against decoding
the whole request.

The request: ``--spans`` action spans shaped as an instrumented agent's SDK sends them,
each with the mapped attributes (session, action id, kind), ``--foreign`` attributes the
mapping never reads (HTTP headers, say) and ``--events`` events holding prompt text.
Setups, alternating round by round in one process (the median round is reported):

- ``whole`` (the baseline): ``parse_json`` builds the whole ``ExportTraceServiceRequest``
  with ``json_format``, then the mapped attributes are read, as the receiver did until
  2026-12-01;
- ``receiver``: ``json_span_parts``, what the receiver calls: events and unmapped
  attributes are left out before ``json_format`` builds messages of them.

Run::

    .venv/bin/python benchmarks/otlp_json_decode.py [--spans 1000] [--foreign 20] [--events 3] [--rounds 7]

It measures and prints; it asserts nothing. Peak memory is ``tracemalloc``'s, in a pass of its own per setup.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable

from durable_sessions_collector.otlp.decode import (
    json_span_parts,
    mapped_attributes_of,
    parse_json,
    span_parts,
)


def request_body(spans: int, foreign: int, events: int) -> bytes:
    def span(n: int) -> dict[str, object]:
        mapped = {"session.id": "s-1", "agent.action.id": f"a{n}", "agent.action.kind": "llm_call"}
        attributes = [{"key": k, "value": {"stringValue": v}} for k, v in mapped.items()]
        attributes += [
            {"key": f"http.header.h{i}", "value": {"stringValue": "x" * 200}} for i in range(foreign)
        ]
        prompt = {"key": "gen_ai.prompt", "value": {"stringValue": "p" * 2000}}
        return {
            "traceId": f"{n + 1:032x}",
            "spanId": f"{n + 1:016x}",
            "name": f"llm_call a{n}",
            "startTimeUnixNano": str(1_700_000_000_000_000_000 + n),
            "endTimeUnixNano": str(1_700_000_000_000_000_001 + n),
            "attributes": attributes,
            "events": [{"name": "gen_ai.content.prompt", "attributes": [prompt]}] * events,
        }

    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "agent"}}]}
    document = {
        "resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span(n) for n in range(spans)]}]}]
    }
    return json.dumps(document).encode()


def whole(body: bytes) -> object:
    request, problems = parse_json(body)
    return list(span_parts(request, problems, [], mapped_attributes_of))


def receiver(body: bytes) -> object:
    return json_span_parts(body, [])


def timed(decode: Callable[[bytes], object], body: bytes) -> float:
    started = time.perf_counter()
    decode(body)
    return time.perf_counter() - started


def peak_memory(decode: Callable[[bytes], object], body: bytes) -> int:
    """Bytes allocated at the peak (a separate pass: tracemalloc slows what it traces)."""
    tracemalloc.start()
    decode(body)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=1000)
    parser.add_argument("--foreign", type=int, default=20)
    parser.add_argument("--events", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    body = request_body(args.spans, args.foreign, args.events)
    mib = len(body) / 2**20
    print(
        f"request: {args.spans} spans, {args.foreign} foreign attributes and {args.events} events each: {mib:.1f} MiB"
    )
    print(f"Python {platform.python_version()}, {platform.machine()}")
    setups = {"whole": whole, "receiver": receiver}
    times: dict[str, list[float]] = {"whole": [], "receiver": []}
    for number in range(1, args.rounds + 1):
        for name, decode in setups.items():
            times[name].append(timed(decode, body))
        print(
            f"round {number}: whole {times['whole'][-1] * 1000:.0f} ms, receiver {times['receiver'][-1] * 1000:.0f} ms"
        )
    for name, decode in setups.items():
        median, peak = statistics.median(times[name]), peak_memory(decode, body)
        print(
            f"{name:9} median {median * 1000:7.0f} ms ({median / mib * 1000:.0f} ms per MiB), "
            f"peak {peak / 2**20:.0f} MiB ({peak / len(body):.1f}x the body)"
        )
    ratios = [r / w for r, w in zip(times["receiver"], times["whole"], strict=True)]
    print(f"receiver / whole: median of the rounds' ratios {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
