"""Stream plumbing the endpoints share: wait for a stream's first item before answering,
and merge the streams of a batch of prompts."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Generic, TypeVar

T = TypeVar("T")


class Primed(Generic[T]):
    """A stream whose first item has arrived. Closing it closes the stream (ending its
    engine requests) even if nobody ever iterated it: a client may leave between the
    status line and the first chunk."""

    def __init__(self, first: T, stream: AsyncGenerator[T, None]) -> None:
        self._first: list[T] = [first]
        self._stream = stream

    def __aiter__(self) -> Primed[T]:
        return self

    async def __anext__(self) -> T:
        if self._first:
            return self._first.pop()
        return await anext(self._stream)

    async def aclose(self) -> None:
        await self._stream.aclose()


async def prime(stream: AsyncGenerator[T, None]) -> Primed[T]:
    """Waits for the stream's first item, so that a rejected request raises here,
    before a streaming response has sent its 200 status."""
    return Primed(await anext(stream), stream)


async def prime_all(streams: list[AsyncGenerator[T, None]]) -> list[Primed[T]]:
    """prime() for a batch. The first rejection (or a cancellation) closes every other
    stream at once, so no request of a failed batch keeps running."""
    tasks = [asyncio.ensure_future(prime(stream)) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        error = next((task.exception() for task in tasks if task.done() and task.exception()), None)
        if error is not None:
            raise error
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        raise


async def merge(streams: list[Primed[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they come, tagged with the stream's index.

    Closing the merged stream cancels the readers, which closes (aborts) every stream."""
    if len(streams) == 1:  # the common case needs no tasks
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    inbox: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    inbox.put_nowait((index, item))
        except Exception as exc:
            inbox.put_nowait(exc)
        inbox.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await inbox.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
