"""The sidecar's APIs. HTTP JSON here; the gRPC service from ``proto/`` is to come."""
