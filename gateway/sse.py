"""Server-sent events as OpenAI streams them: `data: <json>` per chunk, then `data: [DONE]`."""
from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from gateway.errors import error_body, error_for

DONE = "data: [DONE]\n\n"


class Closable(Protocol):
    async def aclose(self) -> None: ...


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def error_event(exc: Exception) -> str:
    """A failure after the 200 status went out; the openai client raises APIError on it."""
    error = error_for(exc)
    return event(error_body(error.status, error.message, error.param, error.code))


async def _with_errors(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(events) as items:
            async for item in items:
                yield item
    except Exception as exc:
        yield error_event(exc)
        yield DONE


class _EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[str, None], owned: Sequence[Closable]) -> None:
        self._events = _with_errors(events)
        self._owned = owned
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Under ASGI 2.4 Starlette learns of a disconnect from a failed send and
            # leaves the body suspended; closing it here aborts the engine requests now
            # rather than whenever the garbage collector gets to it. A body that never
            # started closes nothing of its own: the streams it was given are closed too.
            await self._events.aclose()
            for stream in self._owned:
                await stream.aclose()


def sse_response(events: AsyncGenerator[str, None], *owned: Closable) -> StreamingResponse:
    """`events` as an SSE response that closes `owned` (the request's primed streams),
    whatever ends it: the last event, an error, or a client that left."""
    return _EventStreamResponse(events, owned)
