"""A role's gRPC server: its service plus the standard grpc.health.v1 service.

Health reports SERVING for "" (the whole server) and for the role's service name
from start(), and NOT_SERVING from the moment stop() begins, so load balancers and
readiness probes drain the server before it goes.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.transport.channel import MESSAGE_OPTIONS

logger = logging.getLogger(__name__)


class RoleServer:
    def __init__(
        self,
        address: str,
        service_name: str,
        register: Callable[[grpc.Server], None],
        max_workers: int,
        before_stop: Callable[[], None] | None = None,
    ) -> None:
        """`register` adds the role's servicer; `before_stop` runs once health says
        NOT_SERVING and before the server stops (e.g. to end streams cleanly)."""
        self.service_name = service_name
        self._before_stop = before_stop
        self._health = health.HealthServicer()
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=service_name)
        self._server = grpc.server(self._executor, options=MESSAGE_OPTIONS)
        register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        # Port 0 picks a free port; the bound one is in self.port.
        self.port = self._server.add_insecure_port(address)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    def start(self) -> None:
        self._server.start()
        for name in ("", self.service_name):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving on %s", self.service_name, self.address)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops taking calls; calls in flight get `grace_s` seconds to finish, then are
        cancelled. Returns once no handler runs any more (a cancelled call's handler
        may still be inside, e.g., a worker step)."""
        self._health.enter_graceful_shutdown()
        if self._before_stop is not None:
            self._before_stop()
        self._server.stop(grace_s).wait()
        self._executor.shutdown(wait=True)
        logger.info("%s on %s stopped", self.service_name, self.address)
