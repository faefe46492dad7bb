"""Stop a request's work when its client goes away before the response starts.

Uvicorn does not cancel a handler whose client disconnected; without this a
non-streaming request (or a stream still waiting for its first token) would keep
generating for nobody. Once a StreamingResponse runs, Starlette itself cancels the
body on disconnect.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

# nginx's code for "client closed request"; nobody receives it, it only shows in logs.
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Runs `work`; if the client disconnects first, cancels it (its finally blocks abort
    the engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=CLIENT_CLOSED_REQUEST)
