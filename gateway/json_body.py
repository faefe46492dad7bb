"""Request bodies parsed off the event loop once they are large, so a multi-megabyte
prompt never stalls the streams and health checks the loop serves meanwhile (FastAPI
parses JSON on the loop). Small bodies, nearly all of them, skip the thread hop."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

# Parsing 64 KiB of JSON takes well under a millisecond: below this, the hop costs more.
OFF_LOOP_BYTES = 64 * 1024


class _OffLoopJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body) if len(body) > OFF_LOOP_BYTES else json.loads(body)
        return self._json


class OffLoopJsonRoute(APIRoute):
    """A route class for the routers that take JSON bodies."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await handle(_OffLoopJsonRequest(request.scope, request.receive))

        return handler
