"""RoleServer: health checks answer while every thread of the role's pool is busy."""
from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.transport.server import RoleServer


def test_health_answers_while_the_role_pool_is_exhausted() -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def block(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.release()
        release.wait(30)
        return request

    def register(server: grpc.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(block)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Block", {"Wait": handler}),))

    server = RoleServer("127.0.0.1:0", "test.Block", register, max_workers=2)
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        wait = channel.unary_unary("/test.Block/Wait")
        held = [wait.future(b"x", timeout=30) for _ in range(4)]  # two run, two queue behind them
        for _ in range(2):
            assert entered.acquire(timeout=10)
        health = health_pb2_grpc.HealthStub(channel)
        began = time.monotonic()
        for service in ("", "test.Block"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - began < 1.0
        release.set()
        assert [call.result() for call in held] == [b"x"] * 4
    finally:
        release.set()
        channel.close()
        server.stop(0)
