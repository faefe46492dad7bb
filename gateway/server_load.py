"""vLLM's --enable-server-load-tracking and GET /load: `{"server_load": N}`, the number
of completion and chat requests (/invocations' too) this server is answering now, from
the moment one arrives until its response's last byte (a stream's end). Load balancers
read it to send the next request to the least busy server. Without the flag nothing is
counted and /load says 0, as in vLLM.

It is this process's count: in a cluster each gateway counts its own requests (with
`cluster up --api-server-count N`, whichever of them answers /load)."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.root_path import route_path

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})


class ServerLoad:
    """Touched only on the server's event loop."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    """A pure ASGI middleware: the app call returns once the response has been sent, so
    a streamed answer counts until its end, or until its client leaves."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1
