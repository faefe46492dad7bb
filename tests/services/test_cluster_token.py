"""The cluster token on a RoleServer: calls of every kind without it (or with a wrong one)
are refused UNAUTHENTICATED, calls through kvfleet's channels (blocking and asyncio)
carry it, and health checks stay open for probes."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.transport.channel import open_async_channel, open_channel
from services.transport.cluster_token import METADATA_KEY, TOKEN_ENV, TOKEN_FILE_ENV, cluster_token
from services.transport.server import RoleServer

TOKEN = "s3cret-token"


def _register(server: grpc.Server) -> None:
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Repeat": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request, request])),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),))


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[RoleServer]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    role = RoleServer("127.0.0.1:0", "test.Echo", _register, max_workers=2)
    role.start()
    yield role
    role.stop(0)


def _calls(channel: grpc.Channel, **kwargs) -> tuple[bytes, list[bytes]]:
    echo = channel.unary_unary("/test.Echo/Echo")(b"x", timeout=10, **kwargs)
    repeat = list(channel.unary_stream("/test.Echo/Repeat")(b"y", timeout=10, **kwargs))
    return echo, repeat


@pytest.mark.parametrize("metadata", [None, [(METADATA_KEY, "wrong")], [(METADATA_KEY, TOKEN + "x")]])
def test_calls_without_the_token_are_refused(server: RoleServer, metadata) -> None:
    with grpc.insecure_channel(server.address) as channel:
        for call in (lambda: channel.unary_unary("/test.Echo/Echo")(b"x", timeout=10, metadata=metadata),
                     lambda: list(channel.unary_stream("/test.Echo/Repeat")(b"y", timeout=10, metadata=metadata))):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN_ENV in refused.value.details() and TOKEN not in refused.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_kvfleet_channels_carry_the_token(server: RoleServer) -> None:
    with open_channel(server.address) as channel:
        assert _calls(channel) == (b"x", [b"y", b"y"])

    async def through_asyncio() -> tuple[bytes, list[bytes]]:
        async with open_async_channel(server.address) as channel:
            echo = await channel.unary_unary("/test.Echo/Echo")(b"x", timeout=10)
            repeat = [item async for item in channel.unary_stream("/test.Echo/Repeat")(b"y", timeout=10)]
            return echo, repeat

    assert asyncio.run(through_asyncio()) == (b"x", [b"y", b"y"])


def test_the_token_may_come_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    monkeypatch.setenv(TOKEN_ENV, "ignored when a file is named")
    assert cluster_token() == TOKEN


def test_a_public_server_takes_calls_without_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    role = RoleServer("127.0.0.1:0", "test.Echo", _register, max_workers=2, internal=False)
    role.start()
    try:
        with grpc.insecure_channel(role.address) as channel:
            assert _calls(channel) == (b"x", [b"y", b"y"])
    finally:
        role.stop(0)
