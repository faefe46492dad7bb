"""kvfleet's own gRPC services, whose messages are msgspec Structs carried as msgpack.

A Service lists its methods (name, request type, response type, unary or server
streaming). The same description registers a servicer's methods on a server (gRPC's
generic handlers) and builds a client's stub (`channel.unary_unary` or `unary_stream`),
so both ends name one type per message and no code converts between forms. The
method paths are gRPC's usual `/<service>/<method>`, so the health service, the
cluster token's interceptors, TLS and status codes work as with any gRPC service.

A request that does not decode to its type (malformed bytes, a field of the wrong
type, a value its __post_init__ refuses) is INVALID_ARGUMENT, whose message starts
with the offending field, as every role's refusals do.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import grpc
import msgspec

from services.invalid_parameter import InvalidParameter

# msgspec's Encoder and Decoder keep no state between calls: one of each serves every thread.
encode = msgspec.msgpack.Encoder().encode

# msgspec's messages end with where in the payload the fault is: "... - at `$.field[0].name`".
_AT = re.compile(r"^(?P<message>.*) - at `\$\.?(?P<path>[^`]*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


@dataclass(frozen=True)
class Method:
    name: str
    request: type
    response: type
    server_streaming: bool = False

    @cached_property
    def decode_request(self) -> Callable[[bytes], Any]:
        return msgspec.msgpack.Decoder(self.request).decode

    @cached_property
    def decode_response(self) -> Callable[[bytes], Any]:
        return msgspec.msgpack.Decoder(self.response).decode


@dataclass(frozen=True)
class Service:
    name: str  # e.g. "kvfleet.v1.Scheduler": method paths and the health service name it
    methods: tuple[Method, ...]

    def handler(self, servicer: object) -> grpc.GenericRpcHandler:
        """Serves `servicer`'s methods of the same names: each takes the decoded request
        and the context, and returns the response (a streaming one yields them)."""
        handlers = {}
        for method in self.methods:
            behaviour = _decoding(method, getattr(servicer, method.name))
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(behaviour, response_serializer=encode)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(behaviour, response_serializer=encode)
        return grpc.method_handlers_generic_handler(self.name, handlers)

    def stub(self, channel: grpc.Channel | grpc.aio.Channel) -> Stub:
        return Stub(self, channel)


class Stub:
    """A client of one Service on one channel (a thread-run or an asyncio one): an
    attribute per method, called as gRPC's multi-callables are (`timeout`, `metadata`,
    `.future` on a thread-run channel)."""

    def __init__(self, service: Service, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for method in service.methods:
            open_call = channel.unary_stream if method.server_streaming else channel.unary_unary
            setattr(self, method.name, open_call(f"/{service.name}/{method.name}", request_serializer=encode,
                                                 response_deserializer=method.decode_response))


def _decoding(method: Method, behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable:
    def handle(payload: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = method.decode_request(payload)
        except msgspec.MsgspecError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, invalid_payload(exc))
        return behaviour(request, context)

    return handle


def invalid_payload(error: msgspec.MsgspecError) -> str:
    """A decoding error as "field: what is wrong", the field as its path in the message
    (e.g. "sampling_params.n"); a value a message's own validation refused keeps the
    parameter its InvalidParameter names."""
    if isinstance(error.__cause__, InvalidParameter):
        return str(error.__cause__)
    text = str(error)
    match = _AT.match(text)
    message, path = (match["message"], match["path"]) if match else (text, "")
    if missing := _MISSING.match(message):
        path, message = ".".join(filter(None, (path, missing["field"]))), "is required"
    return f"{path or 'payload'}: {message}"
