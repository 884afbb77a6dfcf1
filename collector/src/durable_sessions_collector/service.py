"""Assembling the sidecar from its configuration, and running it."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import ssl
import sys
import threading
from collections.abc import Callable
from typing import TextIO

import grpc

from durable_sessions.native import SWITCH, UNKNOWN_SWITCH, unknown_switch
from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import LOG, OTLP, WEBHOOK
from durable_sessions_collector.alerts.log import LogAlerts, WrittenJournal
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.alerts.otlp import OtlpAlerts
from durable_sessions_collector.alerts.outbox import DeliveryPolicy
from durable_sessions_collector.alerts.webhook import WebhookAlerts
from durable_sessions_collector.api.grpc_api import MAX_WATCHERS, SessionApi
from durable_sessions_collector.api.health import MAX_HEALTH_WATCHERS, GrpcHealth, StoreCheck
from durable_sessions_collector.api.http_api import HttpApi
from durable_sessions_collector.config import Config, is_loopback, redact_store_url
from durable_sessions_collector.credentials import BearerToken, TlsFiles
from durable_sessions_collector.environment import NOT_READ, unknown_variables
from durable_sessions_collector.evaluator import Evaluator
from durable_sessions_collector.httpserver import HttpServer, Router
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.otlp.budget import DecodingBudget
from durable_sessions_collector.otlp.grpc_receiver import GrpcReceiver, worker_count
from durable_sessions_collector.otlp.http_receiver import PATH, HttpTraceReceiver
from durable_sessions_collector.otlp.receiver import TraceReceiver
from durable_sessions_collector.pipeline import Pipeline
from durable_sessions_collector.security import GrpcAuthInterceptor, HttpAuth, RedactingStream
from durable_sessions_collector.store import INDEX_FAILED, SqliteStore, open_store
from durable_sessions_collector.verdict_rules import adopt, log_adopted

JOURNAL_SUFFIX = ".log-written"
"""Beside a SQLite store: the keys of alert lines written and not yet marked delivered."""

EXIT_FLUSH_S = 5.0
"""Longest ``serve`` waits at exit for log lines still queued to be written."""

GC_THRESHOLDS = (100_000, 50, 1000)
"""CPython's cyclic collector thresholds in a sidecar process (the defaults: 700, 10, 10)."""


def tune_garbage_collector() -> None:
    """Make the cyclic garbage collector rare in a process that runs the sidecar.

    The sidecar makes next to no reference cycles, so reference counting frees nearly all
    it allocates. It does allocate several objects per span, and keeps queued requests
    and held sessions alive while it does. Under the default thresholds, those survivors
    set off full collections, each of which scans the whole heap and finds nothing: in
    ``benchmarks/collector_ingest.py throughput`` these thresholds made the sidecar
    ~1.18× faster. :func:`gc.freeze` also leaves what start-up built (modules,
    descriptors, configuration) out of every later collection.

    Called by :meth:`Service.serve_forever`, which owns its process. A program that
    embeds :class:`Service` keeps its own collector settings.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def who_may_connect(token: str | None, client_ca_file: str | None) -> str:
    """``bearer``, ``client-certificate`` (mutual TLS), both joined by ``+``, or ``none``."""
    return (
        "+".join(name for name, on in (("bearer", token), ("client-certificate", client_ca_file)) if on)
        or "none"
    )


def _warn_unknown_variables(log: JsonLog) -> None:
    """A ``unknown-environment-variable`` line for each ``DURABLE_SESSIONS_*`` variable no
    part of the project reads (``…_IDEL_S``, meant as ``DURABLE_SESSIONS_IDLE_S``, left idle_s at its
    default without a word), with the known one it is closest to. Never its value."""
    for name, close in unknown_variables(os.environ):
        fields = {"did_you_mean": close} if close else {}
        log.warning(
            "unknown-environment-variable",
            variable=name,
            note=NOT_READ,
            **fields,
        )
    if unknown_switch() is not None:  # in place of Python's warning text, which is no JSON line
        log.warning("invalid-environment-variable", variable=SWITCH, note=UNKNOWN_SWITCH)


HANGUP_ACTION = "kept running: TLS and token files are read again when they change; other settings apply at the next start"


class Service:
    """The running sidecar: store, evaluator, pipeline, receivers, API.

    ``start()`` binds both ports (port 0 picks free ones: see :attr:`grpc_port` and
    :attr:`http_port`) and returns once they accept connections; ``stop()`` stops
    accepting, commits what was accepted, and closes the store.
    """

    def __init__(self, config: Config, *, log_stream: TextIO | None = None) -> None:
        self.config = config
        # Every line goes through the redactor: no secret reaches the log, whoever writes it.
        self.redactor = RedactingStream(log_stream, config.secrets())
        self.log = JsonLog(self.redactor, config.log_level)
        self.webhook: WebhookAlerts | None = None
        self.otlp: OtlpAlerts | None = None
        self.store = None
        self.grpc_port = 0
        self.http_port = 0
        self._stopped = threading.Event()
        self._started = False

    def start(self) -> Service:
        config, log = self.config, self.log
        _warn_unknown_variables(log)
        self.store = store = open_store(config.store)
        if store.migrated_from is not None:  # a PostgreSQL URL may hold a password
            log.info("store-migrated", store=redact_store_url(config.store), from_version=store.migrated_from)
        try:
            store.build_indexes(self._index_built)
            self.store_check = StoreCheck(store.check, redact_store_url(config.store))
            self.metrics = metrics = Metrics(store)
            self.evaluator = Evaluator(
                strict=config.evaluation_strict,
                key_window_s=config.evaluation_key_window_s,
                max_sessions=config.evaluation_max_sessions,
                max_actions_per_session=config.evaluation_max_actions_per_session,
            )
            # The verdicts count the rules this sidecar runs: a change since the last start
            # is recorded now, and its recount left to the writer thread (it may be long).
            counted = frozenset(rule.id for rule in self.evaluator.rules)
            adopted = adopt(store, counted)
            log_adopted(log, adopted, counted, shared=store.shared)
            channels = tuple(
                channel
                for channel, enabled in (
                    (LOG, config.alerts_log_enabled),
                    (WEBHOOK, bool(config.alerts_webhook_url)),
                    (OTLP, bool(config.alerts_otlp_endpoint)),
                )
                if enabled
            )
            metrics.expect(channels, self.evaluator.rules)
            journal = WrittenJournal(store.path + JOURNAL_SUFFIX) if isinstance(store, SqliteStore) else None
            self.log_alerts = LogAlerts(
                store,
                log,
                on_delivered=metrics.delivered,
                journal=journal,
            )
            if config.alerts_webhook_url:
                self.webhook = WebhookAlerts(
                    store,
                    log,
                    metrics,
                    config.alerts_webhook_url,
                    policy=DeliveryPolicy(
                        config.alerts_webhook_max_attempts,
                        config.alerts_webhook_timeout_s,
                        config.alerts_webhook_backoff_s,
                        config.alerts_webhook_max_backoff_s,
                    ),
                )
            if config.alerts_otlp_endpoint:
                self.otlp = OtlpAlerts(
                    store,
                    log,
                    metrics,
                    config.alerts_otlp_endpoint,
                    insecure=config.alerts_otlp_insecure,
                    headers=config.alerts_otlp_headers,
                    policy=DeliveryPolicy(
                        config.alerts_otlp_max_attempts,
                        config.alerts_otlp_timeout_s,
                        config.alerts_otlp_backoff_s,
                        config.alerts_otlp_max_backoff_s,
                    ),
                )
            self.pipeline = Pipeline(
                store,
                self.evaluator,
                metrics,
                log,
                queue_size=config.pipeline_queue_size,
                max_batch=config.pipeline_max_batch,
                idle_s=config.evaluation_idle_s,
                retention_s=config.retention_sessions_s,
                ack_timeout_s=config.pipeline_ack_timeout_s,
                retry_after_s=config.pipeline_retry_after_s,
                channels=channels,
                after_commit=self._after_commit if channels else None,
                recounting=adopted.recount is not None,
            )
            if config.alerts_log_enabled:
                self.log_alerts.deliver_pending()  # left pending by a previous run
            # One budget for both ports: the memory of the requests they decode at once.
            self.budget = budget = DecodingBudget(
                config.receivers_max_decoding_bytes, retry_after_s=config.pipeline_retry_after_s
            )
            metrics.decoding_bytes.set_function(lambda: budget.in_use)
            metrics.decoding_bytes_limit.set(budget.limit)
            receiver = TraceReceiver(
                self.pipeline,
                metrics,
                log,
                budget,
                attribute_value_limit=config.evaluation_attribute_value_limit,
            )
            token = config.bearer_token()
            bearer, tls, credentials = self._credentials(token, metrics)
            router = Router()
            router.add(
                "POST",
                PATH,
                HttpTraceReceiver(receiver, max_request_bytes=config.receivers_max_request_bytes, log=log),
            )
            HttpApi(store, metrics, self._health_problem).register(router)
            self.pipeline.start()
            self.grpc = GrpcReceiver(
                receiver,
                config.receivers_grpc_endpoint,
                max_request_bytes=config.receivers_max_request_bytes,
                log=log,
                # A thread for every Export the write pipeline can hold, every watch, and spares.
                workers=worker_count(
                    config.pipeline_queue_size + config.pipeline_max_batch, MAX_WATCHERS, MAX_HEALTH_WATCHERS
                ),
                credentials=credentials,
                interceptors=(GrpcAuthInterceptor(bearer),) if bearer else (),
            )
            self.session_api = SessionApi(store, log=log, token=bearer)  # durable_sessions.v1.SessionService
            self.session_api.register(self.grpc.server)
            # grpc.health.v1.Health: /healthz's answer
            self.health = GrpcHealth(self._health_problem, token=bearer)
            self.health.register(self.grpc.server)
            self.grpc_port = self.grpc.start()
            self.http = HttpServer(
                config.receivers_http_endpoint,
                router,
                log,
                body_limit=config.receivers_max_request_bytes,
                tls=tls,
                auth=HttpAuth(bearer).check if bearer else None,
                max_connections=config.receivers_http_max_connections,
                on_idle_closed=metrics.http_idle_closed.inc,
            )
            metrics.http_connections.set_function(lambda: self.http.connections.open)
            metrics.http_connections_limit.set(config.receivers_http_max_connections)
            self.http_port = self.http.start()
            self.pipeline.accepting()  # idleness counts from now: queued spans may be on their way
            if self.webhook is not None:
                self.webhook.start()  # delivers first what an earlier run left pending
            if self.otlp is not None:
                self.otlp.start()
        except BaseException:
            self._teardown()
            raise
        self._started = True
        auth = who_may_connect(token, config.tls_client_ca_file)
        for name, endpoint in (
            ("receivers.grpc.endpoint", config.receivers_grpc_endpoint),
            ("receivers.http.endpoint", config.receivers_http_endpoint),
        ):
            if not is_loopback(endpoint) and not (auth != "none" and tls):
                missing = " and ".join(
                    what
                    for what, absent in (
                        ("auth.token or tls.client_ca_file", auth == "none"),
                        ("tls.cert_file", tls is None),
                    )
                    if absent
                )
                log.warning("not-loopback", key=name, endpoint=endpoint,
                            note=f"the port is reachable from other hosts; set {missing}")  # fmt: skip
        log.info(
            "started",
            version=__version__,
            grpc_port=self.grpc_port,
            http_port=self.http_port,
            store=redact_store_url(config.store),
            idle_s=config.evaluation_idle_s,
            retention_s=config.retention_sessions_s,
            alert_channels=list(channels),
            tls=tls is not None,
            auth=auth,
        )
        return self

    def _credentials(
        self, token: str | None, metrics: Metrics
    ) -> tuple[BearerToken | None, Callable[[], ssl.SSLContext] | None, grpc.ServerCredentials | None]:
        """The bearer token both ports require, the HTTP port's TLS context (per handshake)
        and the gRPC port's TLS credentials: each followed as its files change."""
        config, reloads = self.config, metrics.credential_reloads.labels
        bearer = None
        if token:
            bearer = BearerToken(
                token,
                path=config.auth_token_file,
                log=self.log,
                on_new_token=self.redactor.add,
                on_reload=lambda outcome: reloads("token", outcome).inc(),
            )
            if config.auth_token_file:
                metrics.expect_reloads("token")
        if not (config.tls_cert_file and config.tls_key_file):
            return bearer, None, None
        tls_files = TlsFiles(
            config.tls_cert_file,
            config.tls_key_file,
            log=self.log,
            on_reload=lambda outcome: reloads("tls", outcome).inc(),
            client_ca_file=config.tls_client_ca_file,
        )
        metrics.expect_reloads("tls")
        metrics.watch_certificate(lambda: tls_files.not_after)
        return bearer, tls_files.ssl_context, tls_files.grpc_credentials()

    def _after_commit(self) -> None:
        """New alerts were committed: the log channel writes them now, the webhook and otlp
        channels are woken."""
        if self.webhook is not None:
            self.webhook.notify()
        if self.otlp is not None:
            self.otlp.notify()
        if self.config.alerts_log_enabled:
            self.log_alerts.deliver_pending()

    def _health_problem(self) -> str | None:
        """Why the sidecar is unhealthy, or None: what ``GET /healthz`` and
        ``grpc.health.v1.Health`` answer, worked out at each call."""
        if not self.pipeline.alive:
            return "the writer thread is not running"
        if self.webhook is not None and self._started and not self.webhook.alive:
            return "the webhook delivery thread is not running"
        if self.otlp is not None and self._started and not self.otlp.alive:
            return "the otlp delivery thread is not running"
        return self.store_check()

    def _index_built(self, index: str, outcome: str, error: str | None) -> None:
        """From the store's index-building thread (see Store.build_indexes)."""
        store = redact_store_url(self.config.store)
        if outcome == INDEX_FAILED:
            self.log.warning("store-index-not-built", store=store, index=index, error=error)
        else:
            self.log.info("store-index", store=store, index=index, outcome=outcome)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._teardown()
        if self._started:
            self.log.info("stopped")

    def _teardown(self) -> None:
        session_api = getattr(self, "session_api", None)
        if session_api is not None:
            session_api.stop()  # open WatchAlerts streams end now, not after the grace period
        health = getattr(self, "health", None)
        if health is not None:
            health.stop()  # NOT_SERVING from now on; open health Watch streams say so and end
        for name in ("http", "grpc"):
            component = getattr(self, name, None)
            if component is not None:
                try:
                    component.stop()
                except Exception as error:
                    self.log.error("stop-failed", component=name, error=str(error))
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.stop()
        log_alerts = getattr(self, "log_alerts", None)
        if log_alerts is not None:
            log_alerts.close()
        channels = [channel for channel in (self.webhook, self.otlp) if channel is not None]
        for channel in channels:  # each may be waiting out an attempt's timeout: together
            channel.request_stop()
        for channel in channels:
            channel.stop()
        if self.store is None:
            return
        if pipeline is not None and pipeline.alive:
            # The writer is still in a write the store does not answer (a PostgreSQL behind
            # a network partition): closing the store would wait for that write for ever.
            # None of it was acknowledged; the process may end without it.
            self.log.error(
                "store-write-stuck",
                note="the writer's write did not end within the stop's bound; the store is left "
                "open, and nothing of that write was acknowledged",
            )
            return
        self.store.close()

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Start, run until SIGTERM or SIGINT, then stop cleanly (a second one, while still
        starting or while stopping, ends the process at once). SIGHUP is logged and changes
        nothing (:data:`HANGUP_ACTION`).

        The stop is bounded whatever reads (or does not read) standard error: no thread
        waits on a blocked log stream (see :mod:`.jsonlog`), and if the log's lines are
        not all written within ``EXIT_FLUSH_S`` once everything is stopped, the process
        exits at once (code 0), as the interpreter's own exit would wait on that stream
        forever.
        """
        done = threading.Event()

        def _signal(signum: int, _frame: object) -> None:
            if done.is_set():
                # Asked twice: do not wait for the start, or for the stop, to end. Everything
                # acknowledged is committed; a write in progress is rolled back by the store.
                os._exit(128 + signum)
            done.set()
            # Waiting here could wait on a lock the interrupted code holds: queue the line only.
            self.log.write("INFO", "signal", wait=False, signal=signal.Signals(signum).name)

        def _hangup(signum: int, _frame: object) -> None:
            # By default SIGHUP ended the process at once, without a line or a clean stop.
            # Daemons, and the Collector, take it as "reload"; here the TLS and token files
            # are read again whenever they change, and nothing else can change while running.
            self.log.write("INFO", "signal", wait=False, signal="SIGHUP", action=HANGUP_ACTION)

        # In place before the start, whose "started" line a supervisor may answer with a
        # signal at once: Python's defaults ended the process, or raised KeyboardInterrupt
        # inside the start. A signal during the start stops the sidecar once it has started;
        # a second one, then or during the stop, ends the process at once (a store that
        # does not answer).
        signal.signal(signal.SIGTERM, _signal)
        signal.signal(signal.SIGINT, _signal)
        signal.signal(signal.SIGHUP, _hangup)
        self.start()
        tune_garbage_collector()
        try:
            while not done.wait(1.0):
                if not self.pipeline.alive:
                    self.log.error("writer-died")
                    break
        finally:
            self.stop()
        if not self.log.flush(EXIT_FLUSH_S):
            # A log line's write is blocked in standard error (nobody reads the pipe) and
            # holds the stream: the interpreter's last flush of standard error at exit would
            # wait for it forever. Everything is stopped and committed: exit now.
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(0)
