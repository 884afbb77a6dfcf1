"""durable-sessions-collector: the sidecar that judges whole agent sessions from OTLP traces.

The sidecar is shaped like an OpenTelemetry Collector pipeline::

    otlp receivers (gRPC, HTTP)  ->  pipeline (bounded write queue, one writer)
                                 ->  evaluator (the shared rule engine)  ->  store
                                 ->  alerts (log line, metrics, webhook)

Each component lives in its own package with its configuration and construction.
"""

__version__ = "0.1.0"
