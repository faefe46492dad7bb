"""RoleServer: health checks answer while every thread of the role's pool is busy; and
grpc_serving, the check that role leases renew by, takes a late answer for a busy role
(within its patience), a refused connection for a dead one."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.role_process import grpc_serving
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


class _SlowHealth(health_pb2_grpc.HealthServicer):
    """Health that answers SERVING, after `delay_s` (a process too busy to answer at once)."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
              ) -> health_pb2.HealthCheckResponse:
        time.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_late_health_answer_is_serving_within_patience_a_refused_connection_never() -> None:
    health = _SlowHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        serving = grpc_serving(f"127.0.0.1:{port}", patience_s=2.5)
        health.delay_s = 1.5  # past the check's 1 s deadline
        assert not serving(), "late before any SERVING answer: not known to serve yet"
        health.delay_s = 0.0
        assert serving()
        health.delay_s = 1.5
        assert serving(), "one late answer within its patience"
        time.sleep(1.0)
        assert not serving(), "silent for longer than its patience: hung"
        health.delay_s = 0.0
        assert serving()
    finally:
        server.stop(0)
    began = time.monotonic()
    assert not serving(), "a stopped server refuses at once, whatever the patience"
    assert time.monotonic() - began < 1.0
