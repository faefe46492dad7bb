"""One request's stream of deltas, from an engine thread or a NATS thread to the
asyncio consumer that opened it.

Producers on other threads batch their items with `post`: one
`call_soon_threadsafe` per event loop per batch, never one per token. The consumer
iterates `deltas()`: with n or best_of > 1 the request runs as child requests
whose deltas keep their child ids, and the stream ends once every child has ended
(each ends with exactly one delta that has a finish_reason) or an exception arrives.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence

from services.messages import TokenDelta

# What a stream carries: deltas, or the exception that ends the request.
Item = TokenDelta | BaseException


class RequestStream:
    def __init__(self, request_id: str, num_children: int = 1) -> None:
        """Call on the consumer's event loop."""
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self.unfinished = num_children  # engine requests that have not ended yet

    async def get(self) -> Item:
        """The next item as it came: a delta or an exception (deltas() raises the latter)."""
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        while self.unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.unfinished = 0
                raise item
            self.unfinished -= item.finish_reason is not None
            yield item

    def _put(self, items: Sequence[Item]) -> None:
        for item in items:
            self._queue.put_nowait(item)


def _deliver(batch: list[tuple[RequestStream, Sequence[Item]]]) -> None:
    """Runs on the consumers' event loop."""
    for stream, items in batch:
        stream._put(items)


def post(items: Mapping[RequestStream, Sequence[Item]]) -> set[asyncio.AbstractEventLoop]:
    """Hands each stream its items on its own loop; any thread. Returns the loops that
    have closed: nobody reads their streams any more."""
    by_loop: defaultdict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Sequence[Item]]]] = defaultdict(list)
    for stream, stream_items in items.items():
        by_loop[stream.loop].append((stream, stream_items))
    closed = set()
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            closed.add(loop)
    return closed
