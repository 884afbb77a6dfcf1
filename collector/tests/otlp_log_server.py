"""A real OTLP/gRPC logs receiver for the tests: ``LogsService/Export`` on a loopback port.

Each Export is recorded with its metadata. ``fail_first`` answers that many calls with
``fail_code`` (and ``fail_details`` as its message) before it starts accepting;
``fail_first=None`` fails forever. It can be
started on a port chosen in advance (a receiver that is down, then comes up).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc


@dataclass
class Export:
    request: logs_service_pb2.ExportLogsServiceRequest
    metadata: dict[str, str]


class OtlpLogServer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(
        self,
        port: int = 0,
        *,
        fail_first: int | None = 0,
        fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        fail_details: str = "try later",
    ) -> None:
        self.port = port
        self.fail_first = fail_first
        self.fail_code = fail_code
        self.fail_details = fail_details
        self.requests: list[Export] = []
        self.accepted: list[Export] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        received = Export(request, {k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        with self._lock:
            self.requests.append(received)
            failing = self.fail_first is None or len(self.requests) <= self.fail_first
            if not failing:
                self.accepted.append(received)
        if failing:
            context.abort(self.fail_code, self.fail_details)
        return logs_service_pb2.ExportLogsServiceResponse()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpLogServer:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
