"""A gRPC method's handler answered by another function: what a server interceptor
returns to refuse a call (the bearer token's check, a stopping port's drain)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


def answered_by(
    handler: grpc.RpcMethodHandler, answer: Callable[[Any, grpc.ServicerContext], Any]
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary or streaming, each way) and serializers that
    calls ``answer(request, context)`` instead, which aborts the call: a handler of
    another kind would read a streaming request as a unary one."""
    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(answer, **options)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(answer, **options)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(answer, **options)
    return grpc.stream_stream_rpc_method_handler(answer, **options)
