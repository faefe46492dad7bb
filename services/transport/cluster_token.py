"""The internal plane's shared secret: every role's gRPC server takes calls only from
callers that present the cluster token, and every role's channels present it.

Without it any pod that can reach a role could submit past the gateway's API key or
drive a worker with raw block ids. The token comes from the environment
(KVFLEET_CLUSTER_TOKEN, or a file named by KVFLEET_CLUSTER_TOKEN_FILE, e.g. a mounted
Kubernetes Secret), never from the command line, where /proc/<pid>/cmdline shows it to
every local user. Health checks stay open: probes and load balancers carry no secret.
Unset, nothing is checked (a developer's single machine, where roles bind loopback).
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "KVFLEET_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "KVFLEET_CLUSTER_TOKEN_FILE"
METADATA_KEY = "x-kvfleet-cluster-token"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def cluster_token() -> str | None:
    path = os.environ.get(TOKEN_FILE_ENV)
    token = Path(path).read_text().strip() if path else os.environ.get(TOKEN_ENV, "")
    return token or None


class TokenCheck(grpc.ServerInterceptor):
    """Refuses a call without the token (compared in constant time) with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        presented = dict(details.invocation_metadata).get(METADATA_KEY, "")
        if hmac.compare_digest(presented.encode(), self._token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (so gRPC reads the request as it would) that refuses the call."""

    def refuse(request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"this kvfleet role takes calls with the cluster token only "
                                                      f"(metadata {METADATA_KEY}, from {TOKEN_ENV})")

    kind = ("stream" if handler.request_streaming else "unary") + "_" + (
        "stream" if handler.response_streaming else "unary")
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def async_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the token to every call of an asyncio channel (which takes
    one object per kind of call)."""
    entry = (METADATA_KEY, token)

    def with_token(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), entry))

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
            return await continuation(with_token(details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Callable, details: Any, requests: Any) -> Any:
            return await continuation(with_token(details), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
            return await continuation(with_token(details), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


class TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a (blocking API) channel."""

    def __init__(self, token: str) -> None:
        self._entry = (METADATA_KEY, token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=[*(details.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)
