"""The peak memory of decoding one OTLP Export, per byte of its body, as the sidecar's
receivers decode it: OTLP/JSON (``json_span_parts``), and binary protobuf
(``protobuf_span_parts``) through the ``_wire`` extension and through the reference path
(``DURABLE_SESSIONS_NATIVE=false``). These are the factors of
``receivers.max_decoding_bytes`` (``otlp/budget.py``).

Bodies, of about ``--mib`` MiB each, built with the OpenTelemetry SDK's own encoder:

- ``actions``: action spans as an instrumented agent sends them: the mapped attributes
  (session, action id, kind, idempotency key, ...) and a few others, no events;
- ``foreign``: the same with 20 attributes the mapping never reads (200 characters each)
  and 3 events of 2,000 characters of prompt (``benchmarks/otlp_json_decode.py``'s span);
- ``small``: the same with 60 short attributes the mapping never reads (numbers, flags,
  short words) and 5 events of 5 such attributes: the most objects per byte.

Each measurement runs in a child process of its own, which reads the body from a file,
then decodes it once and keeps the result (a receiver holds it until its answer):

- ``rss``: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before) minus its resident size before decoding: what the
  machine sees, allocations in C (protobuf's upb arenas) included;
- ``traced``: ``tracemalloc``'s peak: Python's allocators only.

Run::

    .venv/bin/python benchmarks/otlp_decode_memory.py [--mib 16] [--kinds actions,foreign,small]

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

DECODERS = ("json", "wire", "reference")


def _status(name: str) -> int:
    """A ``/proc/self/status`` line's value, in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None, name
    return int(match.group(1)) * 1024


def child(decoder: str, path: str, mode: str) -> None:
    """Decode the body in ``path`` once; print the peak bytes it added (``mode``: rss, traced)."""
    from durable_sessions_collector.otlp import decode

    if decoder == "wire":
        assert decode.wire_in_use(), "_wire is not built (or DURABLE_SESSIONS_NATIVE is off)"
    if decoder == "reference":
        assert not decode.wire_in_use(), "run with DURABLE_SESSIONS_NATIVE=false"
    function = decode.json_span_parts if decoder == "json" else decode.protobuf_span_parts
    body = Path(path).read_bytes()
    gc.collect()
    if mode == "traced":
        tracemalloc.start()
        result = function(body, [])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    else:
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        result = function(body, [])
        peak = _status("VmHWM") - before
    print(json.dumps({"peak": peak, "spans": len(result)}))


def span_attributes(kind: str, n: int) -> tuple[dict[str, object], list[tuple[str, dict[str, object]]]]:
    """A span's attributes and events, for a body of ``kind``."""
    attributes: dict[str, object] = {
        "session.id": f"session-{n // 50}",
        "agent.action.id": f"a{n}",
        "agent.action.kind": "tool_call",
        "agent.action.name": "search_flights",
        "agent.action.idempotency_key": f"idem-{n:08d}",
        "agent.action.side_effects": "write",
        "agent.action.retryable": True,
        "agent.action.attempts": 1,
        "agent.action.result_digest": f"sha256:{n:064x}",
        "gen_ai.tool.name": "search_flights",
        "gen_ai.operation.name": "execute_tool",
        "code.function": "search_flights",
    }
    events: list[tuple[str, dict[str, object]]] = []
    if kind == "foreign":
        attributes.update({f"http.header.h{i}": "x" * 200 for i in range(20)})
        events = [("gen_ai.content.prompt", {"gen_ai.prompt": "p" * 2000})] * 3
    elif kind == "small":
        for i in range(60):
            attributes[f"app.k{i}"] = (i, i % 2 == 0, f"v{i}", i / 4)[i % 4]
        events = [("log", {f"e{i}": i for i in range(5)})] * 5
    return attributes, events


def request(kind: str, mib: float) -> tuple[bytes, bytes]:
    """A request of ``kind`` of about ``mib`` MiB as protobuf, and the same as OTLP/JSON."""
    from durable_sessions_collector.otlp.decode import to_otlp_json
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    resource = Resource.create({"service.name": "agent", "service.instance.id": "agent-1"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("benchmark")
    sample = 200
    for n in range(sample):
        attributes, events = span_attributes(kind, n)
        with tracer.start_as_current_span(f"tool_call a{n}", attributes=attributes) as span:
            for name, event in events:
                span.add_event(name, event)
    per_span = len(encode_spans(memory.get_finished_spans()).SerializeToString()) / sample
    for n in range(sample, int(mib * 2**20 / per_span)):
        attributes, events = span_attributes(kind, n)
        with tracer.start_as_current_span(f"tool_call a{n}", attributes=attributes) as span:
            for name, event in events:
                span.add_event(name, event)
    message = encode_spans(memory.get_finished_spans())
    provider.shutdown()
    json_format.MessageToDict(message)  # a valid message
    return message.SerializeToString(), to_otlp_json(message)


def measure(decoder: str, path: Path, mode: str) -> dict[str, int]:
    env = dict(os.environ)
    env["DURABLE_SESSIONS_NATIVE"] = "false" if decoder == "reference" else "true"
    done = subprocess.run(
        [sys.executable, __file__, "--child", decoder, str(path), mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--kinds", default="actions,foreign,small")
    parser.add_argument("--child", nargs=3, metavar=("DECODER", "FILE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"Python {platform.python_version()}, {platform.machine()}")
    print(
        f"{'body':8} {'decoder':10} {'MiB':>6} {'spans':>7} {'rss':>8} {'×body':>6} {'traced':>8} {'×body':>6}"
    )
    with tempfile.TemporaryDirectory() as directory:
        for kind in args.kinds.split(","):
            protobuf, otlp_json = request(kind, args.mib)
            for decoder in DECODERS:
                body = otlp_json if decoder == "json" else protobuf
                path = Path(directory) / f"{kind}.{decoder}"
                path.write_bytes(body)
                rss, traced = measure(decoder, path, "rss"), measure(decoder, path, "traced")
                size = len(body)
                print(
                    f"{kind:8} {decoder:10} {size / 2**20:6.1f} {rss['spans']:7} "
                    f"{rss['peak'] / 2**20:7.0f}M {rss['peak'] / size:6.1f} "
                    f"{traced['peak'] / 2**20:7.0f}M {traced['peak'] / size:6.1f}"
                )


if __name__ == "__main__":
    main()
