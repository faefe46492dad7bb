"""A service described in Python (services/transport/rpc.py) over real gRPC: the stub
and the server built from one description exchange the Structs themselves; a payload
that does not decode is INVALID_ARGUMENT naming the field, and never reaches the
servicer; the servicer's own status codes reach the caller as they are."""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import msgspec
import pytest

from services.messages import Empty, TokenDelta
from services.sampling_params import SamplingParams
from services.scheduler_messages import StepOutputs, StreamOutputsRequest, SubmitRequest
from services.transport.rpc import Method, Service, encode
from services.transport.server import RoleServer

ECHO = Service("test.v1.Echo", (
    Method("Submit", SubmitRequest, Empty),
    Method("Stream", StreamOutputsRequest, StepOutputs, server_streaming=True),
))
OUTPUTS = [StepOutputs([TokenDelta("r", [1, 2])], "s1", 1), StepOutputs([TokenDelta("r", [3], "length")], "s1", 2)]


class EchoServicer:
    def __init__(self) -> None:
        self.received: list[object] = []

    def Submit(self, request: SubmitRequest, context: grpc.ServicerContext) -> Empty:
        self.received.append(request)
        if request.gateway_id == "nobody":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "gateway_id: no stream is open")
        return Empty()

    def Stream(self, request: StreamOutputsRequest, context: grpc.ServicerContext) -> Iterator[StepOutputs | msgspec.Raw]:
        self.received.append(request)
        yield OUTPUTS[0]
        yield msgspec.Raw(encode(OUTPUTS[1]))  # as the replay window keeps them: encoded once


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[EchoServicer, grpc.Channel]]:
    servicer = EchoServicer()
    server = RoleServer("127.0.0.1:0", ECHO.name, lambda s: s.add_generic_rpc_handlers([ECHO.handler(servicer)]),
                        max_workers=2)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield servicer, channel
    finally:
        channel.close()
        server.stop(0)


def test_the_stub_and_the_servicer_exchange_the_structs(served) -> None:
    servicer, channel = served
    stub = ECHO.stub(channel)
    request = SubmitRequest("r", [1, 2], SamplingParams(temperature=0.0, stop=["\n"]), "g", output_token_ids=[7])
    assert stub.Submit(request, timeout=10) == Empty()
    assert servicer.received[-1] == request
    assert list(stub.Stream(StreamOutputsRequest("g"), timeout=10)) == OUTPUTS


def test_the_servicer_s_status_reaches_the_caller(served) -> None:
    _, channel = served
    with pytest.raises(grpc.RpcError) as caught:
        ECHO.stub(channel).Submit(SubmitRequest("r", [1], SamplingParams(), "nobody"), timeout=10)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == "gateway_id: no stream is open"


@pytest.mark.parametrize(
    ("method", "payload", "details"),
    [
        ("Submit", b"\xc1", "payload: MessagePack data is malformed"),
        ("Submit", {"request_id": "r", "prompt_token_ids": [1], "gateway_id": "g", "sampling_params": {"n": "2"}},
         "sampling_params.n: Expected `int`, got `str`"),
        ("Submit", {"request_id": "r", "prompt_token_ids": [1], "gateway_id": "g",
                    "sampling_params": {"temperature": -1.0}}, "temperature: must be >= 0"),
        ("Stream", {"gateway_id": ""}, "gateway_id: must not be empty"),
        ("Stream", {}, "gateway_id: is required"),
    ],
)
def test_a_payload_that_does_not_decode_is_invalid_argument_naming_the_field(
    served, method: str, payload: bytes | dict, details: str
) -> None:
    servicer, channel = served
    before = len(servicer.received)
    raw = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    call = channel.unary_stream if method == "Stream" else channel.unary_unary
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(f"/{ECHO.name}/{method}")(raw, timeout=10)
        if method == "Stream":
            list(reply)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(details), caught.value.details()
    assert len(servicer.received) == before
