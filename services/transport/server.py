"""A role's gRPC server: its service plus the standard grpc.health.v1 service.

Health reports SERVING for "" (the whole server) and for the role's service name
from start(), and NOT_SERVING from the moment stop() begins, so load balancers,
readiness probes and registry leases let go of the server while it drains.

Health checks run on threads of their own: a pool busy with the role's work (long
streams, a flood of calls) must never make a live role look dead to its lease,
its probes or its clients.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.transport.channel import MESSAGE_OPTIONS
from services.transport.cluster_token import TokenCheck, cluster_token
from services.transport.tls import server_credentials

logger = logging.getLogger(__name__)

# Checks answer from memory in microseconds: two threads serve any number of pollers.
HEALTH_THREADS = 2

# What a role process gives the calls still open once it has drained (a stream sending
# its last messages), even with no grace left, before they are cancelled.
FLUSH_S = 2.0


def _run_on(pool: futures.ThreadPoolExecutor, method: Callable) -> Callable:
    """`method` as a handler that gRPC runs on `pool` (it reads `experimental_thread_pool`)."""

    def handler(request: object, context: grpc.ServicerContext) -> object:
        return method(request, context)

    handler.experimental_thread_pool = pool
    return handler


class RoleServer:
    def __init__(
        self,
        address: str,
        service_name: str,
        register: Callable[[grpc.Server], None],
        max_workers: int,
        drain: Callable[[float], object] | None = None,
        internal: bool = True,
    ) -> None:
        """`register` adds the role's servicer. `drain(timeout_s)` runs once health says
        NOT_SERVING, while the server still takes calls: it lets the role's work in
        flight finish (the role refuses new work meanwhile), within `timeout_s`, and ends
        what is left explicitly (e.g. streams get their final messages). An `internal`
        server (the cluster's own plane) checks the cluster token when one is set; a
        public door (internal=False) takes calls without it."""
        self.service_name = service_name
        self._drain = drain
        self._health = health.HealthServicer()
        self._health_executor = futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="health")
        self._health.Check = _run_on(self._health_executor, self._health.Check)
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=service_name)
        token = cluster_token() if internal else None
        self._server = grpc.server(self._executor, options=MESSAGE_OPTIONS,
                                   interceptors=[TokenCheck(token)] if token else None)
        register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        # Port 0 picks a free port; the bound one is in self.port.
        credentials = server_credentials()
        self.port = (self._server.add_secure_port(address, credentials) if credentials
                     else self._server.add_insecure_port(address))
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    def start(self) -> None:
        self._server.start()
        for name in ("", self.service_name):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving on %s", self.service_name, self.address)

    def set_serving(self, serving: bool) -> None:
        """The role's own readiness (e.g. a scheduler whose worker link is down is not
        ready), reported for its service name; the whole server ("") stays SERVING while
        it runs, so its registry lease holds. Ignored once stop() has begun."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(self.service_name, status)

    def stop(self, grace_s: float = 5.0, flush_s: float = 0.0) -> None:
        """Drains, then stops: health says NOT_SERVING at once, the role's drain hook gets
        up to `grace_s`, then the server stops taking calls and those in flight get the
        rest of `grace_s`, and `flush_s` at least, to finish before they are cancelled.
        Returns once no handler runs any more (a cancelled call's handler may still be
        inside, e.g., a worker step)."""
        deadline = time.monotonic() + grace_s
        self._health.enter_graceful_shutdown()
        if self._drain is not None:
            logger.info("%s draining (up to %g s)", self.service_name, grace_s)
            self._drain(grace_s)
        self._server.stop(max(deadline - time.monotonic(), flush_s)).wait()
        self._executor.shutdown(wait=True)
        self._health_executor.shutdown(wait=True)
        logger.info("%s on %s stopped", self.service_name, self.address)
