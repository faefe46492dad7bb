"""What every gRPC role process does around its own work: hold a registry lease while
healthy, and serve until SIGTERM or SIGINT, then drain within --shutdown-timeout.

Health says NOT_SERVING at once on a signal; the role's drain hook (RoleServer) lets
its work in flight finish, then the process exits 0. A second signal meanwhile gets
the default handling: it ends the process at once.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.registry import Lease, Member, Registry, new_member_id
from services.transport.channel import RECONNECT_OPTIONS
from services.transport.server import FLUSH_S, RoleServer

logger = logging.getLogger(__name__)


def registered(args: argparse.Namespace, lease: Callable[[], AbstractContextManager]) -> AbstractContextManager:
    """The role's registry lease with --redis-url; without, nothing."""
    return lease() if args.redis_url else contextlib.nullcontext()


def role_lease(role: str, args: argparse.Namespace, port: int, metadata: dict[str, str] | None = None) -> Lease:
    """A lease held while the role's gRPC health says SERVING."""
    member = Member(role, new_member_id(), advertised(args, port), {"model": args.model, **(metadata or {})})
    return Lease(Registry(args.redis_url), member, args.lease_ttl,
                 healthy=grpc_serving(f"127.0.0.1:{port}", args.lease_ttl))


def grpc_serving(address: str, patience_s: float) -> Callable[[], bool]:
    """A check that the gRPC server at `address` reports SERVING (false while it is down).

    A server too busy to answer within a second counts as serving for `patience_s` after
    its last SERVING answer: a late reply is not a lost process (a dead one refuses the
    connection at once), and one slow beat under load must not drop a healthy role from
    the cluster. One that stays silent past its patience (hung) is taken as down."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address, options=RECONNECT_OPTIONS))
    last_serving = -math.inf

    def check() -> bool:
        nonlocal last_serving
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError as exc:
            late = exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            return late and time.monotonic() - last_serving < patience_s
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        if serving:
            last_serving = time.monotonic()
        return serving

    return check


def advertised(args: argparse.Namespace, port: int | None = None) -> str:
    return args.advertise_address or f"{args.host}:{port or args.port}"


def serve_role(args: argparse.Namespace, role: str, server: RoleServer) -> None:
    """Holds the role's lease (with --redis-url) while it serves, until a signal."""
    with registered(args, lambda: role_lease(role, args, server.port)):
        serve_until_signalled(server, args.shutdown_timeout)


def serve_until_signalled(server: RoleServer, grace_s: float) -> None:
    """Serves until SIGTERM or SIGINT, then drains and stops within `grace_s` (plus a
    moment for streams to send their last messages, even with `grace_s` 0)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.wait()
        logger.info("stopping %s", server.service_name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop(grace_s, flush_s=FLUSH_S)
