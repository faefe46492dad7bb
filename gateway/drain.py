"""Graceful shutdown of the gateway: on SIGTERM or SIGINT, drain before exiting.

Draining means: /health answers 503 at once (readiness fails, load balancers let go),
every new request but the operational ones (/health, /metrics, /version, /load, /ping) gets an
OpenAI-style 503, and requests in flight, SSE streams included, run to their end.
Once none is left, or --shutdown-timeout has passed, uvicorn shuts down. Requests
still running at the deadline end with an explicit error: the engine client shuts
down, which fails their streams ("the ... is shutting down" as an error event), and
they get a few seconds to send it.

uvicorn's own signal handling does not do this: it closes the listening socket at
once (new clients get "connection refused", never a 503), and after shutting down
re-raises the signal, so the process dies by it instead of exiting 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_response
from gateway.root_path import route_path
from services.config import ConfigError
from services.engine_client import EngineClient

logger = logging.getLogger(__name__)

# Answered while draining: probes and scrapers must see the server as it goes.
OPERATIONAL_PATHS = frozenset({"/health", "/metrics", "/version", "/load", "/ping"})
# After the deadline: how long the requests the engine's shutdown failed get to send their error.
FLUSH_S = 5.0
# How often a server that waits to be ready before it takes connections looks again.
READY_POLL_S = 0.1


class Drain:
    """One server's shutdown state. Touched only on its event loop's thread (the
    signal handler runs there too, between two steps of the loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # HTTP requests being answered; a stream counts until its last byte


class DrainMiddleware:
    """Counts the requests in flight and, once draining, refuses new ones with 503.

    A pure ASGI middleware: the app call returns only once the response is sent, so a
    StreamingResponse counts until its generator has ended."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and route_path(scope) not in OPERATIONAL_PATHS:
            response = error_response(503, "the server is shutting down; retry on another replica")
            # A client on keep-alive reconnects, through its load balancer, to a live replica.
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see the module docstring). A
    second one shuts down without waiting for the drain (open requests get FLUSH_S, then
    are cancelled), and a third at once, as uvicorn's own second Ctrl-C does."""

    def __init__(self, config: uvicorn.Config, drain: Drain, engine: EngineClient, shutdown_timeout_s: float,
                 ready: Callable[[], bool] | None = None) -> None:
        super().__init__(config)
        self._drain = drain
        self._engine = engine
        self._shutdown_timeout_s = shutdown_timeout_s
        self._ready = ready
        self._deadline: float | None = None  # monotonic; set by the first signal

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # With `ready`, no connection is taken before it says so (or a signal comes).
        while self._ready is not None and not self._ready() and self._deadline is None:
            await asyncio.sleep(READY_POLL_S)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is not None:  # a second signal: stop waiting for anyone
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        logger.info(
            "%s: draining %d requests in flight (up to %g s); new ones get 503",
            signal.Signals(sig).name, self._drain.in_flight, self._shutdown_timeout_s,
        )
        self._drain.draining = True
        self._deadline = time.monotonic() + self._shutdown_timeout_s

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop asks this every 0.1 s whether to shut down.
        if self._deadline is not None and not self.should_exit:
            if self._drain.in_flight == 0:
                logger.info("drained: no request in flight")
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                logger.warning("shutdown timeout: ending the %d requests still in flight", self._drain.in_flight)
                # Fails every open stream with an explicit error; not on this loop, which
                # has to deliver those errors meanwhile.
                await asyncio.to_thread(self._engine.shutdown)
                self.should_exit = True
        return await super().on_tick(counter)


def _without_probes(record: logging.LogRecord) -> bool:
    """Probes and scrapers call every few seconds: their access lines would bury the rest."""
    # uvicorn's access record: (client, method, path with query, HTTP version, status)
    return not (isinstance(record.args, tuple) and len(record.args) == 5
                and str(record.args[2]).split("?")[0] in OPERATIONAL_PATHS)


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads, as vLLM does: a port
    already in use is a ConfigError at once, not after a minute of loading."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None
    return listener


def serve(app: FastAPI, listener: socket.socket, shutdown_timeout_s: float, log_level: str = "info",
          access_log: bool = True, accept_when_ready: bool = False) -> None:
    """Serves `app` (from gateway.app.build_app) on `listener` (from gateway.listener.listen)
    until a signal, then drains; returns once the server is down. The engine client stays
    the caller's to shut down. `accept_when_ready`: take connections only once the app can
    serve them, for a socket other servers share (cluster up's), which take them meanwhile."""
    ctx = app.state.gateway
    paths = app.openapi()["paths"]
    logger.info("routes: %s", ", ".join(f"{'|'.join(m.upper() for m in methods)} {path}"
                                        for path, methods in paths.items()))
    names = ", ".join(ctx.served_model_names)
    if listener.family == socket.AF_UNIX:
        uds = listener.getsockname()
        logger.info("serving %s on unix:%s (OpenAI API at /v1)", names, uds)
        where: dict = {"uds": uds}
    else:
        host, port = listener.getsockname()[:2]
        logger.info("serving %s on http://%s:%d (OpenAI API: http://%s:%d/v1)", names, host, port, host, port)
        where = {"host": host, "port": port}
    config = uvicorn.Config(app, **where, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=FLUSH_S)
    logging.getLogger("uvicorn.access").addFilter(_without_probes)
    DrainingServer(config, ctx.drain, ctx.engine, shutdown_timeout_s, ctx.is_ready if accept_when_ready else None).run(
        sockets=[listener])
