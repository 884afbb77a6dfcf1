"""The sidecar's APIs: HTTP JSON (:mod:`.http_api`) and gRPC (:mod:`.grpc_api`, from ``proto/``)."""
