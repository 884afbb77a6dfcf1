"""The sidecar's ingest: throughput against a discard receiver, alert latency, memory.

Several modes; each server runs in a child process of its own, the load generator in this
one, so the two do not share a GIL (they do share the machine's CPUs).

``throughput``
    OTLP/gRPC ``Export`` requests (``--spans-per-request`` action spans each, fresh
    trace/span ids every round, several sessions per request, a few sessions with
    violations) are sent by ``--clients`` concurrent callers on raw channels, first to a
    *discard receiver* — a grpcio server like the sidecar's (same worker pool and message
    limits) whose handler parses the ``ExportTraceServiceRequest`` and answers an empty
    response — then to the sidecar on a SQLite store with every rule on
    (``evaluation.strict: true``) and the log alert channel writing to /dev/null. For
    context a third server parses *and* turns every span into Python objects with the
    sidecar's own OTLP decoder (``spans_of``), then discards them. Rounds alternate; the
    median round of each is reported, and the ratios.

    ``--baseline TREE`` adds a fourth server: the sidecar of another source tree (its
    ``collector/src``, and its ``src`` when the tree has one, extensions built in place;
    e.g. an earlier commit exported with ``git archive``), so that before and after are
    measured in the same run.

``latency``
    Sessions arrive at a steady rate; each has one span with an ingest-time violation
    (``unbounded-retry``) and one that leaves an end-of-session violation
    (``unresolved-side-effect``, found once the session has been idle ``--idle-s``). For
    each alert: the time from the Export call that carried its span to (a) the webhook
    POST arriving at a local HTTP receiver and (b) the alert arriving on a
    ``WatchAlerts`` stream. p50/p99/max are reported per kind.

``rss``
    ``--sessions`` single-span sessions (default 1,000,000) sent through OTLP/gRPC in
    batches; the sidecar's RSS (``VmRSS``, and the peak ``VmHWM``) after each quarter.

``store-floor``
    What SQLite alone costs per action row, for the throughput target's arithmetic: the
    records of ``throughput``'s requests, mapped and encoded as the sidecar stores them
    (all of that done beforehand), inserted with ``executemany`` (no Python per row) in
    transactions of one write batch (``--spans-per-request`` × ``--clients`` rows), WAL,
    ``synchronous=FULL``: into the sidecar's ``actions`` table, and into a copy without
    its index (which drops duplicate spans and finds a session's rows); with
    ``--baseline TREE``, also into the ``actions`` table of that tree's schema; and, for a
    layout the store does not have, one row per session per request holding that
    request's records of the session (``packed_actions``), per span. The tables
    grow over the rounds. The discard receiver runs in the same run: half its throughput
    is the per-span budget of the 50% target.

``steps``
    The CPU time of each step of a span's way through the sidecar, per span, on one
    thread with nothing else running in the process: ``throughput``'s requests parsed as
    the discard receiver parses them (``FromString``), decoded by the sidecar (``_wire``),
    received (mapped, scrubbed and made into rows, as ``TraceReceiver.export`` does before
    it queues them), and written (checked by every rule, stored and committed, as the
    writer thread writes batches of ``--clients`` requests to a SQLite store). Each tree
    runs in a spawned child process, rounds alternating with ``--baseline TREE`` (its
    ``src`` and ``collector/src``, extensions built in place); the best round of each
    step. Unlike ``throughput`` it leaves out gRPC, threads and the GIL, so a change to a
    step shows above this shared machine's noise.

``http-port``
    The HTTP port's own cost per request, without the store: ``--clients`` threads send
    ``GET`` requests for a path that is not routed (404) as fast as they are answered,
    ``--requests`` each, on one keep-alive connection per client, then on a new connection
    per request (``Connection: close``). With ``--baseline TREE``, that tree's sidecar in
    alternating rounds; requests per second and the ratio per round.

Run::

    .venv/bin/python benchmarks/collector_ingest.py throughput [--rounds 5] [--baseline TREE]
    .venv/bin/python benchmarks/collector_ingest.py latency [--sessions 300 --rate 20 --idle-s 2]
    .venv/bin/python benchmarks/collector_ingest.py rss [--sessions 1000000]
    .venv/bin/python benchmarks/collector_ingest.py store-floor [--rounds 5] [--baseline TREE]
    .venv/bin/python benchmarks/collector_ingest.py scrape [--sessions 1000000] [--store postgresql://…] [--baseline TREE]
    .venv/bin/python benchmarks/collector_ingest.py http-port [--rounds 5] [--baseline TREE]
    .venv/bin/python benchmarks/collector_ingest.py steps [--rounds 5] [--baseline TREE]
    .venv/bin/python benchmarks/collector_ingest.py pages [--sessions 1000000] [--store postgresql://…] [--baseline TREE]

``scrape``
    How long ``GET /metrics`` takes on a store of ``--sessions`` sessions (default
    1,000,000; 80% ok, 10% at_risk, 10% unrecoverable, one delivered ``log`` alert per
    session that is not ok), inserted straight into a SQLite file — or, with ``--store
    postgresql://…``, into a fresh schema there, dropped afterwards. ``--scrapes`` scrapes
    ``--interval`` seconds apart (as Prometheus scrapes), against the sidecar and, with
    ``--baseline TREE``, that tree's sidecar on the same store; first, median and max.

``pages``
    How long a page of the session list takes, walking ``--pages`` pages of ``--page-size``
    through the gRPC API's ``ListSessions`` (every session, then only ``unrecoverable``
    ones) on the store of ``scrape`` (``--sessions``, SQLite or ``--store``), against the
    sidecar and, with ``--baseline TREE``, that tree's sidecar on the same store; first
    page, median and max.

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, ClassVar

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MIB = 1024 * 1024


# --- requests -----------------------------------------------------------------------------


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _span(trace_id: bytes, span_id: bytes, name: str, attributes: dict[str, Any], start_ns: int) -> Span:
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        name=name,
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=start_ns + 1_000_000,
        attributes=[_kv(k, v) for k, v in attributes.items()],
    )


def _request(spans: list[Span], instance: str) -> bytes:
    resource = Resource(attributes=[_kv("service.name", "bench-agent"), _kv("service.instance.id", instance)])
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=spans)])]
    ).SerializeToString()


def session_steps(session: str, n: int, bad: bool) -> list[tuple[str, dict[str, Any]]]:
    """``n`` action spans of one session: prompts, model calls, tool calls, a payment."""
    steps: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        base = {"session.id": session, "agent.action.id": f"a{i}"}
        match i % 4:
            case 0:
                attrs = {"agent.action.kind": "user_prompt", "agent.action.result": '{"answer": "yes"}'}
            case 1:
                attrs = {"agent.action.kind": "llm_call", "agent.action.result": '{"text": "ok"}'}
            case 2:
                attrs = {
                    "agent.action.kind": "tool_call",
                    "agent.action.name": "search",
                    "agent.action.retryable": True,
                    "agent.action.max_attempts": 3,
                }
            case _:
                attrs = {"agent.action.kind": "payment", "agent.action.idempotency_key": f"{session}/a{i}"}
        steps.append((f"{attrs['agent.action.kind']} a{i}", base | attrs))
    if bad:  # an unbounded retry: one error violation, one alert
        steps[-1] = (
            "tool flaky",
            {
                "session.id": session,
                "agent.action.id": "bad",
                "agent.action.kind": "tool_call",
                "agent.action.retryable": True,
            },
        )
    return steps


def build_round(tag: str, requests: int, spans_per_request: int, sessions_per_request: int) -> list[bytes]:
    """Export requests with fresh ids; every 50th session has one violation."""
    rng = random.Random(tag)
    out = []
    per_session = spans_per_request // sessions_per_request
    now = time.time_ns()
    count = 0
    for r in range(requests):
        spans: list[Span] = []
        for s in range(sessions_per_request):
            session = f"{tag}-{r}-{s}"
            trace_id = rng.randbytes(16)
            for name, attrs in session_steps(session, per_session, bad=count % 50 == 0):
                spans.append(_span(trace_id, rng.randbytes(8), name, attrs, now))
            count += 1
        out.append(_request(spans, f"inc-{tag}"))
    return out


# --- servers (child processes) --------------------------------------------------------------


def _rss_kib() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _discard_server(conn: Any, walk: bool = False) -> None:
    from durable_sessions_collector.otlp.decode import spans_of

    def export(body: bytes, context: grpc.ServicerContext) -> ExportTraceServiceResponse:
        request = ExportTraceServiceRequest.FromString(body)
        if walk:  # also turn every span into Python objects, as the sidecar's decoder does
            spans_of(request)
        return ExportTraceServiceResponse()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[("grpc.max_receive_message_length", 64 * MIB), ("grpc.so_reuseport", 0)],
    )
    handler = grpc.unary_unary_rpc_method_handler(
        export, request_deserializer=None, response_serializer=ExportTraceServiceResponse.SerializeToString
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": handler}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _serve(conn, port, lambda: None)
    server.stop(1)


def _sidecar_server(conn: Any, settings: dict[str, Any], collector_src: str | None = None) -> None:
    if collector_src is not None:  # another version of the sidecar, for before/after figures
        sys.path.insert(0, collector_src)
        library = Path(collector_src).parent.parent / "src"
        if (library / "durable_sessions").is_dir():  # and its durable_sessions, which maps spans
            sys.path.insert(0, str(library))
    from durable_sessions_collector import service as sidecar
    from durable_sessions_collector.config import load

    overrides = {
        "receivers.grpc.endpoint": "127.0.0.1:0",
        "receivers.http.endpoint": "127.0.0.1:0",
        **settings,
    }
    service = sidecar.Service(load(None, env={}, overrides=overrides), log_stream=open(os.devnull, "w"))  # noqa: SIM115
    service.start()
    # As serve_forever does; a baseline tree from before it did may lack the function.
    getattr(sidecar, "tune_garbage_collector", lambda: None)()
    _serve(conn, service.grpc_port, service.stop, http_port=service.http_port)


def _serve(conn: Any, port: int, stop: Callable[[], None], **extra: Any) -> None:
    conn.send({"port": port, **extra})
    while True:
        message = conn.recv()
        if message == "rss":
            conn.send(_rss_kib())
        elif message == "stop":
            stop()
            conn.send("stopped")
            return


class Child:
    """A server in a spawned process; ``port`` once it listens."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=target, args=(child_conn, *args), daemon=True)
        self.process.start()
        info = self.conn.recv()
        self.port: int = info["port"]
        self.http_port: int | None = info.get("http_port")

    def cpu_s(self) -> float:
        """CPU seconds the server's threads have run so far (Linux ``/proc``, in ns: a round
        of the discard receiver lasts a few clock ticks). A thread gone is not counted."""
        total = 0
        for thread in os.listdir(f"/proc/{self.process.pid}/task"):
            with (
                contextlib.suppress(OSError),
                open(f"/proc/{self.process.pid}/task/{thread}/schedstat") as stat,
            ):
                total += int(stat.read().split()[0])
        return total / 1e9

    def rss_mib(self) -> tuple[float, float]:
        self.conn.send("rss")
        rss, peak = self.conn.recv()
        return rss / 1024, peak / 1024

    def stop(self) -> None:
        self.conn.send("stop")
        self.conn.recv()
        self.process.join(10)


# --- the load generator ---------------------------------------------------------------------


def send_all(port: int, requests: list[bytes], clients: int) -> float:
    """Send every request (each once, ``clients`` at a time); seconds taken."""
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MIB)])
        for _ in range(clients)
    ]
    calls = [channel.unary_unary(EXPORT) for channel in channels]
    index = iter(range(len(requests)))
    lock = threading.Lock()
    failures: list[str] = []

    def worker(call: Any) -> None:
        while True:
            with lock:
                i = next(index, None)
            if i is None:
                return
            while True:
                try:
                    call(requests[i], timeout=120)
                    break
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.UNAVAILABLE:
                        failures.append(f"{error.code()}: {error.details()}")
                        return
                    time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(call,)) for call in calls]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for channel in channels:
        channel.close()
    if failures:
        raise SystemExit(f"Export failed: {failures[:3]}")
    return elapsed


def throughput(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ds-bench-")
    discard = Child(_discard_server)
    walker = Child(_discard_server, True)
    settings = {"evaluation.strict": True, "evaluation.idle_s": args.idle_s}
    sidecar = Child(_sidecar_server, {"store": f"sqlite:///{work}/sessions.db", **settings})
    servers = [("discard", discard), ("decode", walker), ("sidecar", sidecar)]
    if args.baseline:
        os.makedirs(f"{work}/baseline")
        baseline = Child(
            _sidecar_server,
            {"store": f"sqlite:///{work}/baseline/sessions.db", **settings},
            str(Path(args.baseline, "collector", "src")),
        )
        servers.append(("baseline", baseline))
    spans = args.requests * args.spans_per_request
    print(
        f"{args.requests} requests x {args.spans_per_request} spans ({args.sessions_per_request} sessions per "
        f"request), {args.clients} clients, {args.rounds} rounds"
    )
    warm = build_round("warm", 8, args.spans_per_request, args.sessions_per_request)
    for _, child in servers:
        send_all(child.port, warm, args.clients)
    rates: dict[str, list[float]] = {name: [] for name, _ in servers}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in servers}  # (server, load generator)
    for round_no in range(args.rounds):
        batch = build_round(f"r{round_no}", args.requests, args.spans_per_request, args.sessions_per_request)
        for name, child in servers:
            server_before, client_before = child.cpu_s(), time.process_time()
            elapsed = send_all(child.port, batch, args.clients)
            rates[name].append(spans / elapsed)
            cpu[name].append((child.cpu_s() - server_before, time.process_time() - client_before))
        baseline_note = (
            f", baseline sidecar {rates['baseline'][-1]:,.0f} spans/s "
            f"(sidecar / baseline {rates['sidecar'][-1] / rates['baseline'][-1]:.2f}x)"
            if args.baseline
            else ""
        )
        print(
            f"round {round_no + 1}: discard {rates['discard'][-1]:,.0f} spans/s, "
            f"decode-to-Python {rates['decode'][-1]:,.0f} spans/s, sidecar {rates['sidecar'][-1]:,.0f} spans/s ({rates['sidecar'][-1] / rates['discard'][-1]:.1%}){baseline_note}"
        )
    base, side = statistics.median(rates["discard"]), statistics.median(rates["sidecar"])
    walked = statistics.median(rates["decode"])
    rss, peak = sidecar.rss_mib()
    print(f"median: discard {base:,.0f} spans/s, sidecar {side:,.0f} spans/s, ratio {side / base:.1%}")
    print(f"median: decode-to-Python {walked:,.0f} spans/s, sidecar / decode-to-Python {side / walked:.1%}")
    print(f"sidecar RSS {rss:.0f} MiB (peak {peak:.0f} MiB)")
    print(_cpu_line(cpu, rates, spans))
    if args.baseline:
        before = statistics.median(rates["baseline"])
        # the servers take turns within a round: a round's own ratio is the fairer comparison
        gains = sorted(now / then for now, then in zip(rates["sidecar"], rates["baseline"], strict=True))
        print(
            f"median: baseline sidecar {before:,.0f} spans/s ({before / base:.1%} of discard, "
            f"{before / walked:.1%} of decode-to-Python); sidecar / baseline per round "
            f"{statistics.median(gains):.2f}x (rounds {gains[0]:.2f}-{gains[-1]:.2f}x)"
        )
    for _, child in servers:
        child.stop()


def _cpu_line(cpu: dict[str, list[tuple[float, float]]], rates: dict[str, list[float]], spans: int) -> str:
    """Each server's CPU per span and the cores it kept busy, and the load generator's,
    medians over the rounds: what bounds a server that does not fill the machine's cores
    (one GIL, waits) shows as fewer cores than the machine has."""
    cells = []
    for name, used in cpu.items():
        per_span = statistics.median(server / spans * 1e6 for server, _ in used)
        cores = statistics.median(
            server * rate / spans for (server, _), rate in zip(used, rates[name], strict=True)
        )
        client = statistics.median(client / spans * 1e6 for _, client in used)
        cells.append(
            f"{name} {per_span:.2f} µs per span on {cores:.2f} cores (load generator {client:.2f} µs)"
        )
    return "median CPU: " + "; ".join(cells)


# --- alert latency --------------------------------------------------------------------------


class _Hook(http.server.BaseHTTPRequestHandler):
    arrivals: ClassVar[dict[str, float]] = {}
    lock = threading.Lock()

    def do_POST(self) -> None:
        at = time.time()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        key = body.get("violation_key") or body.get("key") or self.headers.get("Idempotency-Key")
        with self.lock:
            self.arrivals.setdefault(str(key), at)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def latency(args: argparse.Namespace) -> None:
    from durable_sessions_collector.api.v1 import sessions_pb2 as pb
    from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    work = tempfile.mkdtemp(prefix="ds-bench-")
    sidecar = Child(
        _sidecar_server,
        {
            "store": f"sqlite:///{work}/sessions.db",
            "evaluation.strict": True,
            "evaluation.idle_s": args.idle_s,
            "alerts.webhook.url": f"http://127.0.0.1:{hook.server_address[1]}/hook",
        },
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.port}")
    watch = pb_grpc.SessionServiceStub(channel).WatchAlerts(pb.WatchAlertsRequest())
    watch.initial_metadata()
    watched: dict[tuple[str, str], float] = {}
    keys: dict[tuple[str, str], str] = {}

    def read_watch() -> None:
        try:
            for alert in watch:
                pair = (alert.violation.session_id, alert.violation.rule)
                watched.setdefault(pair, time.time())
                keys[pair] = alert.violation.key
        except grpc.RpcError:
            pass

    threading.Thread(target=read_watch, daemon=True).start()
    export = channel.unary_unary(EXPORT)
    sent: dict[tuple[str, str], float] = {}
    rng = random.Random(1)
    interval = 1 / args.rate
    start = time.perf_counter()
    for n in range(args.sessions):
        session = f"lat-{n}"
        trace_id = rng.randbytes(16)
        now_ns = time.time_ns()
        spans = [
            _span(trace_id, rng.randbytes(8), "tool flaky",
                  {"session.id": session, "agent.action.id": "t", "agent.action.kind": "tool_call",
                   "agent.action.retryable": True}, now_ns),
            _span(trace_id, rng.randbytes(8), "email",
                  {"session.id": session, "agent.action.id": "e", "agent.action.kind": "email",
                   "agent.action.status": "started"}, now_ns),
        ]  # fmt: skip
        at = time.time()
        export(_request(spans, "inc-lat"), timeout=30)
        sent[(session, "unbounded-retry")] = at
        sent[(session, "unresolved-side-effect")] = at
        delay = start + (n + 1) * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    deadline = time.time() + args.idle_s + 30
    while time.time() < deadline and (len(watched) < len(sent) or len(_Hook.arrivals) < len(sent)):
        time.sleep(0.1)
    watch.cancel()
    print(
        f"{args.sessions} sessions at {args.rate}/s, idle_s {args.idle_s}; alerts: {len(sent)} expected, "
        f"{len(watched)} on WatchAlerts, {len(_Hook.arrivals)} at the webhook"
    )
    for rule in ("unbounded-retry", "unresolved-side-effect"):
        for channel_name, arrived in (
            ("webhook", {pair: _Hook.arrivals.get(keys.get(pair, "")) for pair in sent}),
            ("WatchAlerts", watched),
        ):
            delays = sorted(
                arrived[pair] - sent[pair]
                for pair in sent
                if pair[1] == rule and arrived.get(pair) is not None
            )
            if not delays:
                print(f"{rule:24} {channel_name:12} no alerts arrived")
                continue
            p50 = delays[len(delays) // 2]
            p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
            print(
                f"{rule:24} {channel_name:12} n={len(delays):4}  p50 {p50 * 1000:7.0f} ms  "
                f"p99 {p99 * 1000:7.0f} ms  max {delays[-1] * 1000:7.0f} ms"
            )
    channel.close()
    sidecar.stop()
    hook.shutdown()


# --- memory ---------------------------------------------------------------------------------


def rss(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ds-bench-")
    sidecar = Child(
        _sidecar_server,
        {
            "store": f"sqlite:///{work}/sessions.db",
            "evaluation.strict": True,
            "evaluation.idle_s": args.idle_s,
        },
    )
    rss0, _ = sidecar.rss_mib()
    print(f"{args.sessions:,} single-span sessions over OTLP/gRPC, {args.batch} per request; "
          f"idle_s {args.idle_s}; RSS at start {rss0:.0f} MiB")  # fmt: skip
    quarter = args.sessions // 4
    done = 0
    start = time.perf_counter()
    rng = random.Random(2)
    channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.port}")
    export = channel.unary_unary(EXPORT)
    now_ns = time.time_ns()
    pending: list[futures.Future[Any]] = []
    pool = futures.ThreadPoolExecutor(args.clients)

    def send(body: bytes) -> None:
        while True:
            try:
                export(body, timeout=120)
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(0.05)

    while done < args.sessions:
        count = min(args.batch, args.sessions - done)
        spans = [
            _span(rng.randbytes(16), rng.randbytes(8), "tool search",
                  {"session.id": f"m-{done + i}", "agent.action.id": "a0", "agent.action.kind": "tool_call",
                   "agent.action.retryable": True, "agent.action.max_attempts": 3}, now_ns)
            for i in range(count)
        ]  # fmt: skip
        pending.append(pool.submit(send, _request(spans, "inc-m")))
        if len(pending) >= args.clients * 2:
            pending.pop(0).result()
        before = done
        done += count
        if done // quarter != before // quarter or done == args.sessions:
            for future in pending:
                future.result()
            pending.clear()
            now_rss, peak = sidecar.rss_mib()
            elapsed = time.perf_counter() - start
            print(f"{done:>9,} sessions  {elapsed:6.0f} s  ({done / elapsed:,.0f}/s)  "
                  f"RSS {now_rss:5.0f} MiB  peak {peak:5.0f} MiB")  # fmt: skip
    pool.shutdown()
    channel.close()
    time.sleep(args.idle_s + 2)
    now_rss, peak = sidecar.rss_mib()
    print(f"after the idle sweep: RSS {now_rss:.0f} MiB, peak {peak:.0f} MiB")
    size = sum(f.stat().st_size for f in Path(work).iterdir())
    print(f"store on disk: {size / MIB:.0f} MiB")
    sidecar.stop()


def action_rows(requests: list[bytes], received_at: float) -> list[tuple[Any, ...]]:
    """The rows the SQLite store writes for these requests' action spans."""
    from durable_sessions_collector.otlp.decode import protobuf_span_parts
    from durable_sessions_collector.otlp.receiver import scrub
    from durable_sessions_collector.store import action_row
    from durable_sessions_collector.store.statements import action_params

    from durable_sessions.mapping import map_attributes

    rows = []
    for body in requests:
        for _name, attributes, resource, error, start, trace_id, span_id, end in protobuf_span_parts(
            body, []
        ):
            mapped = map_attributes(attributes, resource, error, start, trace_id, span_id, None, False, end)
            if mapped is None:
                continue
            record = mapped[0]
            scrub(record)
            rows.append(action_params(action_row(record, trace_id, span_id), received_at))
    return rows


def _create_store(url: str, collector_src: str | None = None) -> None:
    """An empty store at ``url`` (its schema: a SQLite file's, or a PostgreSQL schema's) of
    the sidecar of ``collector_src`` (this tree's when None), in a child process so that
    another tree's ``durable_sessions_collector`` can be imported."""
    code = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from durable_sessions_collector.store import open_store\n"
        "open_store(sys.argv[1]).close()"
    )
    subprocess.run([sys.executable, "-c", code, url, *([collector_src] if collector_src else [])], check=True)


def _postgres_schema(dsn: str, name: str) -> tuple[str, Callable[[], None]]:
    """A store URL on the PostgreSQL server ``dsn`` with a schema of its own, and how to
    drop that schema."""
    import psycopg

    schema = f"{name}_{os.getpid()}"

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute(f"DROP SCHEMA {schema} CASCADE")

    return dsn + ("&" if "?" in dsn else "?") + f"schema={schema}", drop


def store_floor(args: argparse.Namespace) -> None:
    import sqlite3

    work = tempfile.mkdtemp(prefix="ds-floor-")
    stores = {"actions": f"{work}/sessions.db"}
    _create_store(f"sqlite:///{stores['actions']}")
    if args.baseline:
        stores["baseline"] = f"{work}/baseline.db"
        _create_store(f"sqlite:///{stores['baseline']}", str(Path(args.baseline, "collector", "src")))
    connections = {name: sqlite3.connect(path, isolation_level=None) for name, path in stores.items()}
    plain = connections["actions"]
    plain.execute("CREATE TABLE plain_actions AS SELECT * FROM actions WHERE 0")  # no constraints
    for connection in connections.values():
        connection.execute("PRAGMA synchronous = FULL")
    tables = [(name, connection, "actions") for name, connection in connections.items()]
    tables.append(("plain_actions", plain, "plain_actions"))
    plain.execute(PACKED_TABLE)
    plain.execute(SPAN_KEYS_TABLE)
    discard = Child(_discard_server)
    batch = args.spans_per_request * args.clients
    timings: dict[str, list[float]] = {
        "discard": [],
        **{name: [] for name, _, _ in tables},
        "packed": [],
        "packed_keyed": [],
    }
    for round_ in range(args.rounds):
        requests = build_round(
            f"floor{round_}", args.requests, args.spans_per_request, args.sessions_per_request
        )
        spans = args.requests * args.spans_per_request
        timings["discard"].append(send_all(discard.port, requests, args.clients) / spans)
        rows = action_rows(requests, time.time())
        for name, connection, table in tables:
            sql = f"INSERT INTO {table} (session_id, trace_id, span_id, status, action_id, kind, seq, received_at, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
            start = time.perf_counter()
            for i in range(0, len(rows), batch):
                connection.execute("BEGIN IMMEDIATE")
                connection.executemany(sql, rows[i : i + batch])
                connection.execute("COMMIT")
            timings[name].append((time.perf_counter() - start) / len(rows))
        timings["packed"].append(_insert_packed(plain, requests, args.clients) / len(rows))
        timings["packed_keyed"].append(_insert_packed(plain, requests, args.clients, keyed=True) / len(rows))
        print(
            f"round {round_ + 1} ({(round_ + 1) * len(rows):,} rows): discard {timings['discard'][-1] * 1e6:.2f} µs/span; "
            + _floor_line({name: values[-1] * 1e6 for name, values in timings.items()})
        )
    discard.stop()
    median = {name: statistics.median(values) * 1e6 for name, values in timings.items()}
    print(
        f"median: discard {median['discard']:.2f} µs/span, so the 50% target leaves {2 * median['discard']:.2f} µs "
        f"per span for everything; " + _floor_line(median)
    )


PACKED_TABLE = """CREATE TABLE packed_actions (
    session_id TEXT NOT NULL, request INTEGER NOT NULL, records BLOB NOT NULL,
    PRIMARY KEY (session_id, request)
) WITHOUT ROWID"""
"""A layout the store does not have: one row per session per Export request, holding
that request's records of the session. It measures what SQLite would cost per span if
rows batched spans (the rules, mapping and duplicate-dropping such a store would need
are not in the figure)."""


SPAN_KEYS_TABLE = """CREATE TABLE span_keys (
    session_id TEXT NOT NULL, trace_id BLOB NOT NULL, span_id BLOB NOT NULL,
    PRIMARY KEY (session_id, trace_id, span_id)
) WITHOUT ROWID"""
"""What ``packed_actions`` would still need per span to drop a redelivered span: its key,
session first (as the store's one index is), as 16- and 8-byte BLOBs. A duplicate is
refused by the key; the figure counts the keys' inserts beside the packed rows'."""


_PACKED_REQUESTS = itertools.count()


def _insert_packed(connection: Any, requests: list[bytes], clients: int, *, keyed: bool = False) -> float:
    """Seconds to insert ``requests``' records as ``packed_actions`` rows (and, ``keyed``,
    each span's key in ``span_keys``), committing every ``clients`` requests as the writer
    batches them."""
    rows = []
    keys = []
    for body in requests:
        sessions: dict[str, list[bytes]] = {}
        request_keys = []
        for row in action_rows([body], time.time()):
            sessions.setdefault(row[0], []).append(row[8].encode())
            request_keys.append((row[0], bytes.fromhex(row[1]), bytes.fromhex(row[2])))
        request = next(_PACKED_REQUESTS)
        rows.append([(session, request, b"\n".join(records)) for session, records in sessions.items()])
        keys.append(request_keys if keyed else [])
    start = time.perf_counter()
    for i in range(0, len(rows), clients):
        connection.execute("BEGIN IMMEDIATE")
        for grouped, span_keys in zip(rows[i : i + clients], keys[i : i + clients], strict=True):
            connection.executemany("INSERT INTO span_keys VALUES (?, ?, ?) ON CONFLICT DO NOTHING", span_keys)
            connection.executemany("INSERT INTO packed_actions VALUES (?, ?, ?)", grouped)
        connection.execute("COMMIT")
    return time.perf_counter() - start


def _floor_line(micros: dict[str, float]) -> str:
    line = f"SQLite {micros['actions']:.2f} µs/row as stored, {micros['plain_actions']:.2f} without indexes"
    line += f", {micros['packed']:.2f} µs/span packed by session and request"
    line += f" ({micros['packed_keyed']:.2f} with each span's key)"
    if "baseline" in micros:
        line += f", {micros['baseline']:.2f} in the baseline's schema"
    return line


# --- retention passes -------------------------------------------------------------------------

PRUNE_CHILD = """
import statistics, sys, time
sys.path[:0] = sys.argv[4:]
from durable_sessions_collector.store import open_store
url, huge, passes = sys.argv[1], sys.argv[2] == "huge", int(sys.argv[3])
now = time.time()
started = time.perf_counter()
store = open_store(url)  # a store made by the other tree gets this tree's schema here
building = getattr(store, "build_indexes", lambda report: None)(lambda *outcome: None)
if building is not None:
    building.join()  # and its indexes (a tree without build_indexes built them when opened)
opened = time.perf_counter() - started
taken = []
while len(taken) < passes or huge:
    started = time.perf_counter()
    with store.writer() as writer:
        pruned = writer.prune(now - 3600, 500, 20_000)
    taken.append(time.perf_counter() - started)
    if huge and not pruned.full:
        break
    assert huge or not (pruned.sessions or pruned.orphans), pruned
store.close()
print(opened, max(taken) if huge else statistics.median(taken), len(taken), sum(taken))
"""


def _fill_for_prune(url: str, rows: int, huge: bool) -> None:
    """``rows`` actions of no session and as many of 1,000 open sessions, all younger
    than the cutoff: what a pass reads to find that there is nothing to delete. With
    ``huge``, instead one ended session of ``rows`` actions, older than the cutoff."""
    now = time.time()
    insert = "INSERT INTO actions (session_id, trace_id, span_id, status, received_at, record) "
    session = (
        "INSERT INTO sessions (session_id, first_seen, last_seen, open, actions) VALUES ('huge', 1, 1, 0, {})"
    )
    if url.startswith("sqlite:///"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            values = (
                ("huge", os.urandom(16).hex(), "span", 1.0)
                if huge
                else (None if i % 2 else f"s{i % 1000}", os.urandom(16).hex(), "span", now)
                for i in range(rows if huge else 2 * rows)
            )
            db.executemany(insert + "VALUES (?, ?, ?, 'ok', ?, '{}')", values)
            if huge:
                db.execute(session.format(rows))
            db.commit()
        return
    import psycopg
    from durable_sessions_collector.store.postgres import split_url

    dsn, schema = split_url(url)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f"SET search_path = {schema}")
        if huge:
            db.execute(
                insert
                + "SELECT 'huge', md5(i::text), 'span', 'ok', 1, '{}' FROM generate_series(0, %s - 1) i",
                (rows,),
            )
            db.execute(session.format(rows))
        else:
            db.execute(
                insert + "SELECT CASE WHEN i %% 2 = 1 THEN NULL ELSE 's' || i %% 1000 END, md5(i::text), "
                "'span', 'ok', %s, '{}' FROM generate_series(0, %s - 1) i",
                (now, 2 * rows),
            )
        db.execute("VACUUM ANALYZE actions")


def prune(args: argparse.Namespace) -> None:
    """Time retention passes in this tree and the baseline's: with nothing old to delete
    (and this tree's first start on a store the baseline made, which adds its indexes), or
    with ``--huge``, deleting one session of ``--rows`` actions."""
    this, baseline = None, str(Path(args.baseline, "collector", "src")) if args.baseline else None
    cases = [("sidecar", this, this)]
    if baseline:
        cases += [("baseline", baseline, baseline)]
        if not args.huge:
            cases += [("sidecar on the baseline's store", this, baseline)]
    work = tempfile.mkdtemp(prefix="ds-prune-")
    if args.huge:
        print(f"one ended session of {args.rows:,} actions, older than the cutoff: passes until it is gone, "
              f"{'PostgreSQL' if args.store else 'SQLite'}")  # fmt: skip
    else:
        print(f"{args.rows:,} actions of no session and {args.rows:,} of sessions, all younger than the cutoff; "
              f"median of {args.passes} passes, {'PostgreSQL' if args.store else 'SQLite'}")  # fmt: skip
    for number, (name, tree, made_by) in enumerate(cases):
        url, drop = _prune_store(args, work, str(number))
        _create_store(url, made_by)
        _fill_for_prune(url, args.rows, args.huge)
        mode = "huge" if args.huge else "idle"
        result = subprocess.run(
            [sys.executable, "-c", PRUNE_CHILD, url, mode, str(args.passes), *([tree] if tree else [])],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        opened, per_pass, passes, total = result.stdout.split()
        if args.huge:
            print(
                f"{name}: {passes} passes, the longest {float(per_pass) * 1e3:.0f} ms, {float(total):.2f} s in all"
            )
        else:
            print(f"{name}: opened in {float(opened):.2f} s, a pass {float(per_pass) * 1e3:.2f} ms")
        drop()


def _prune_store(args: argparse.Namespace, work: str, tag: str) -> tuple[str, Callable[[], None]]:
    if not args.store:
        return f"sqlite:///{work}/{tag}.db", lambda: None
    return _postgres_schema(args.store, f"ds_bench_prune_{tag}")


# --- scraping /metrics ----------------------------------------------------------------------


def _filled_store(args: argparse.Namespace, work: str) -> tuple[str, Callable[[], None]]:
    """A store URL holding ``args.sessions`` sessions, and how to drop it."""
    now = time.time()
    verdicts = ("ok",) * 8 + ("at_risk", "unrecoverable")
    if not args.store:
        import sqlite3

        path = f"{work}/sessions.db"
        _create_store(f"sqlite:///{path}")
        with sqlite3.connect(path) as db:
            db.executemany(
                "INSERT INTO sessions (session_id, first_seen, last_seen, open, actions, verdict) VALUES (?, ?, ?, 0, 1, ?)",
                ((f"s-{i:09d}", now - i, now - i, verdicts[i % 10]) for i in range(args.sessions)),
            )
            db.executemany(
                "INSERT INTO outbox (channel, violation_key, payload, state, next_attempt_at, created_at) "
                "VALUES ('log', ?, '{}', 'delivered', ?, ?)",
                ((f"v-{i:09d}", now, now) for i in range(args.sessions) if i % 10 >= 8),
            )
        return f"sqlite:///{path}", lambda: None
    import psycopg
    from durable_sessions_collector.store.postgres import split_url

    url, drop = _postgres_schema(args.store, "ds_bench_scrape")
    _create_store(url)
    with psycopg.connect(args.store, autocommit=True) as db:
        db.execute(f"SET search_path = {split_url(url)[1]}")
        db.execute(
            "INSERT INTO sessions (session_id, first_seen, last_seen, open, actions, verdict) "
            "SELECT 's-' || lpad(i::text, 9, '0'), %s - i, %s - i, 0, 1, "
            "(ARRAY['ok','ok','ok','ok','ok','ok','ok','ok','at_risk','unrecoverable'])[i %% 10 + 1] "
            "FROM generate_series(0, %s - 1) i",
            (now, now, args.sessions),
        )
        db.execute(
            "INSERT INTO outbox (channel, violation_key, payload, state, next_attempt_at, created_at) "
            "SELECT 'log', 'v-' || i, '{}', 'delivered', %s, %s FROM generate_series(0, %s - 1) i WHERE i %% 10 >= 8",
            (now, now, args.sessions),
        )
        db.execute("VACUUM ANALYZE sessions")
        db.execute("VACUUM ANALYZE outbox")
    return url, drop


def _sidecars_on_a_filled_store(args: argparse.Namespace, what: str) -> Iterator[tuple[str, Child]]:
    """The store of ``args.sessions`` sessions (:func:`_filled_store`), and on it this
    tree's sidecar, then with ``args.baseline`` that tree's, each stopped after its turn;
    the store is dropped at the end."""
    work = tempfile.mkdtemp(prefix="ds-filled-")
    start = time.perf_counter()
    url, drop = _filled_store(args, work)
    print(f"{args.sessions:,} sessions in {'PostgreSQL' if args.store else 'SQLite'} "
          f"({time.perf_counter() - start:.0f} s to fill); {what}")  # fmt: skip
    trees = {
        "sidecar": None,
        **({"baseline": str(Path(args.baseline, "collector", "src"))} if args.baseline else {}),
    }
    try:
        for name, tree in trees.items():
            sidecar = Child(_sidecar_server, {"store": url}, tree)
            try:
                yield name, sidecar
            finally:
                sidecar.stop()
    finally:
        drop()


def scrape(args: argparse.Namespace) -> None:
    import urllib.request

    what = f"{args.scrapes} scrapes {args.interval:g} s apart"
    for name, sidecar in _sidecars_on_a_filled_store(args, what):
        times = []
        for n in range(args.scrapes):
            if n:
                time.sleep(args.interval)
            begin = time.perf_counter()
            with urllib.request.urlopen(
                f"http://127.0.0.1:{sidecar.http_port}/metrics", timeout=60
            ) as response:
                response.read()
            times.append((time.perf_counter() - begin) * 1000)
        print(f"{name}: first {times[0]:.0f} ms, then median {statistics.median(times[1:]):.0f} ms, "
              f"max {max(times[1:]):.0f} ms")  # fmt: skip


def pages(args: argparse.Namespace) -> None:
    from durable_sessions_collector.api.v1 import sessions_pb2 as pb
    from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc

    for name, sidecar in _sidecars_on_a_filled_store(args, f"{args.pages} pages of {args.page_size}"):
        channel = grpc.insecure_channel(f"127.0.0.1:{sidecar.port}")
        api = pb_grpc.SessionServiceStub(channel)
        for verdict in (pb.VERDICT_UNSPECIFIED, pb.VERDICT_UNRECOVERABLE):
            times, token = [], ""
            for _ in range(args.pages):
                begin = time.perf_counter()
                page = api.ListSessions(
                    pb.ListSessionsRequest(verdict=verdict, page_size=args.page_size, page_token=token),
                    timeout=120,
                )
                times.append((time.perf_counter() - begin) * 1000)
                token = page.next_page_token
                if not token:
                    break
            if len(times) == 1:  # every session of this verdict fits on one page (a small --sessions)
                print(f"{name}, {pb.Verdict.Name(verdict)}: one page {times[0]:.1f} ms")
                continue
            print(f"{name}, {pb.Verdict.Name(verdict)}: first page {times[0]:.1f} ms, then median "
                  f"{statistics.median(times[1:]):.1f} ms, max {max(times[1:]):.1f} ms ({len(times)} pages)")  # fmt: skip
        channel.close()


def _http_requests(port: int, clients: int, requests: int, keep_alive: bool) -> float:
    """Requests per second: ``clients`` threads, ``requests`` unrouted GETs each."""
    import http.client

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {} if keep_alive else {"Connection": "close"}
        for _ in range(requests):
            connection.request("GET", "/bench-not-routed", headers=headers)
            response = connection.getresponse()
            response.read()
            if response.status != 404:
                raise SystemExit(f"unexpected answer {response.status}")
            if not keep_alive:
                connection.close()
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return clients * requests / (time.perf_counter() - start)


def http_port(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ds-http-")
    trees = {
        "sidecar": None,
        **({"baseline": str(Path(args.baseline, "collector", "src"))} if args.baseline else {}),
    }
    servers = {
        name: Child(_sidecar_server, {"store": f"sqlite:///{work}/{name}.db"}, tree)
        for name, tree in trees.items()
    }
    rates: dict[tuple[str, bool], list[float]] = {(name, ka): [] for name in servers for ka in (True, False)}
    try:
        for n in range(args.rounds):
            for keep_alive in (True, False):
                for name, server in servers.items() if n % 2 == 0 else reversed(servers.items()):
                    assert server.http_port is not None
                    rates[name, keep_alive].append(
                        _http_requests(server.http_port, args.clients, args.requests, keep_alive)
                    )
            line = ", ".join(f"{name} {'keep-alive' if ka else 'new connections'} {rate[-1]:,.0f}/s"
                             for (name, ka), rate in rates.items())  # fmt: skip
            print(f"round {n}: {line}")
        for keep_alive in (True, False):
            what = "keep-alive" if keep_alive else "new connection per request"
            now = rates["sidecar", keep_alive]
            line = f"{what}: sidecar median {statistics.median(now):,.0f} requests/s"
            if args.baseline:
                then = rates["baseline", keep_alive]
                ratios = sorted(a / b for a, b in zip(now, then, strict=True))
                line += (f", baseline {statistics.median(then):,.0f}; sidecar / baseline median per round "
                         f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)")  # fmt: skip
            print(line)
    finally:
        for server in servers.values():
            server.stop()


# --- steps ----------------------------------------------------------------------------------


STEPS = ("parse (discard receiver)", "decode", "receive: map, scrub, row", "write: check, store, commit")


class _Collecting:
    """The receivers' side of a pipeline that only keeps the jobs it is given."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def submit(self, items: list[Any], transport: str) -> Any:
        from durable_sessions_collector.pipeline import Job

        self.jobs.append(Job(items, transport))
        return self.jobs[-1]

    def wait(self, job: Any) -> Any:
        return job


def _steps_child(conn: Any, tree: str | None, work: str, clients: int) -> None:
    """Time :data:`STEPS` for each round of requests ``conn`` sends, in the tree's code."""
    if tree is not None:
        sys.path[:0] = [str(Path(tree, "src")), str(Path(tree, "collector", "src"))]
    from durable_sessions_collector import service
    from durable_sessions_collector.alerts.metrics import Metrics
    from durable_sessions_collector.evaluator import Evaluator
    from durable_sessions_collector.jsonlog import JsonLog
    from durable_sessions_collector.otlp.decode import wire_span_parts
    from durable_sessions_collector.otlp.receiver import TraceReceiver
    from durable_sessions_collector.pipeline import Pipeline
    from durable_sessions_collector.store import open_store

    store = open_store(f"sqlite:///{work}/sessions.db")
    log = JsonLog(open(os.devnull, "w"))  # noqa: SIM115
    metrics = Metrics(store)
    pipeline = Pipeline(store, Evaluator(strict=True), metrics, log)
    service.tune_garbage_collector()  # as serve does
    while (requests := conn.recv()) is not None:
        collecting = _Collecting()
        receiver = TraceReceiver(collecting, metrics, log, None)  # type: ignore[arg-type]
        times = [time.process_time()]
        for body in requests:
            ExportTraceServiceRequest.FromString(body)
        times.append(time.process_time())
        decoded = [wire_span_parts(body) for body in requests]
        times.append(time.process_time())
        for parts in decoded:
            receiver.export(parts, [], "grpc")
        times.append(time.process_time())
        for start in range(0, len(collecting.jobs), clients):
            pipeline._write(collecting.jobs[start : start + clients])
        times.append(time.process_time())
        conn.send([after - before for before, after in itertools.pairwise(times)])
    store.close()


def steps(args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ds-bench-")
    trees = {"sidecar": None, **({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})}
    context = multiprocessing.get_context("spawn")
    children = {}
    for name, tree in trees.items():
        os.makedirs(f"{work}/{name}")
        conn, child_conn = context.Pipe()
        context.Process(
            target=_steps_child, args=(child_conn, tree, f"{work}/{name}", args.clients), daemon=True
        ).start()
        children[name] = conn
    spans = args.requests * args.spans_per_request
    print(
        f"{args.requests} requests x {args.spans_per_request} spans, batches of {args.clients} requests, {args.rounds} rounds; CPU µs per span, best round"
    )
    best = {name: [float("inf")] * len(STEPS) for name in trees}
    for round_no in range(args.rounds + 1):  # the first round warms up, and is not counted
        batch = build_round(f"s{round_no}", args.requests, args.spans_per_request, args.sessions_per_request)
        order = list(children.items())
        for name, conn in order if round_no % 2 else order[::-1]:  # neither tree always goes first
            conn.send(batch)
            seconds = conn.recv()
            if round_no:
                best[name] = [min(b, t / spans * 1e6) for b, t in zip(best[name], seconds, strict=True)]
    for conn in children.values():
        conn.send(None)
    width = max(map(len, STEPS))
    print(
        f"{'step':{width}}  "
        + "  ".join(f"{name:>9}" for name in trees)
        + ("  sidecar / baseline" if args.baseline else "")
    )
    for index, step in enumerate(STEPS):
        cells = "  ".join(f"{best[name][index]:9.2f}" for name in trees)
        ratio = f"  {best['sidecar'][index] / best['baseline'][index]:.2f}x" if args.baseline else ""
        print(f"{step:{width}}  {cells}{ratio}")
    totals = {name: sum(best[name][1:]) for name in trees}
    cells = "  ".join(f"{totals[name]:9.2f}" for name in trees)
    ratio = f"  {totals['sidecar'] / totals['baseline']:.2f}x" if args.baseline else ""
    print(f"{'the sidecar (all but parse)':{width}}  {cells}{ratio}")


def workload_parser(modes: Any, name: str) -> argparse.ArgumentParser:
    """A mode sending ``throughput``'s requests, in rounds."""
    parser: argparse.ArgumentParser = modes.add_parser(name)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--spans-per-request", type=int, default=512)
    parser.add_argument("--sessions-per-request", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--baseline",
        metavar="TREE",
        help="also measure the source tree TREE (e.g. `git archive REV collector/src | tar -x -C TREE`): its "
        "sidecar as a fourth server (throughput), its store's schema (store-floor), for before/after figures "
        "from one run",
    )
    return parser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    one = workload_parser(modes, "throughput")
    one.add_argument("--idle-s", type=float, default=30.0)
    two = modes.add_parser("latency")
    two.add_argument("--sessions", type=int, default=300)
    two.add_argument("--rate", type=float, default=20.0, help="sessions per second")
    two.add_argument("--idle-s", type=float, default=2.0)
    three = modes.add_parser("rss")
    three.add_argument("--sessions", type=int, default=1_000_000)
    three.add_argument("--batch", type=int, default=1000, help="sessions (spans) per Export request")
    three.add_argument("--clients", type=int, default=4)
    three.add_argument("--idle-s", type=float, default=30.0)
    workload_parser(modes, "store-floor")
    workload_parser(modes, "steps")
    five = modes.add_parser("scrape")
    five.add_argument("--sessions", type=int, default=1_000_000)
    five.add_argument(
        "--store", metavar="DSN", help="a PostgreSQL URL (a fresh schema is made there); SQLite if unset"
    )
    five.add_argument("--scrapes", type=int, default=11)
    five.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    five.add_argument("--baseline", metavar="TREE", help="also scrape the sidecar of the source tree TREE")
    six = modes.add_parser("http-port")
    six.add_argument("--requests", type=int, default=2000, help="requests per client per round")
    six.add_argument("--clients", type=int, default=4)
    six.add_argument("--rounds", type=int, default=5)
    six.add_argument("--baseline", metavar="TREE", help="also measure the sidecar of the source tree TREE")
    seven = modes.add_parser("prune")
    seven.add_argument("--rows", type=int, default=1_000_000)
    seven.add_argument("--passes", type=int, default=5)
    seven.add_argument("--huge", action="store_true", help="time deleting one session of --rows actions")
    seven.add_argument(
        "--store", metavar="DSN", help="a PostgreSQL URL (a fresh schema is made there); SQLite if unset"
    )
    seven.add_argument(
        "--baseline",
        metavar="TREE",
        help="also time the store of the source tree TREE, and this tree on a store it made",
    )
    eight = modes.add_parser("pages")
    eight.add_argument("--sessions", type=int, default=1_000_000)
    eight.add_argument(
        "--store", metavar="DSN", help="a PostgreSQL URL (a fresh schema is made there); SQLite if unset"
    )
    eight.add_argument("--pages", type=int, default=100)
    eight.add_argument("--page-size", type=int, default=1000)
    eight.add_argument(
        "--baseline", metavar="TREE", help="also walk the pages of the sidecar of the source tree TREE"
    )
    args = parser.parse_args()
    print(
        f"Python {platform.python_version()}, grpcio {grpc.__version__}, {os.cpu_count()} CPUs, {platform.machine()}"
    )
    modes_run = {
        "throughput": throughput,
        "latency": latency,
        "rss": rss,
        "store-floor": store_floor,
        "steps": steps,
        "scrape": scrape,
        "http-port": http_port,
        "prune": prune,
        "pages": pages,
    }
    modes_run[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
