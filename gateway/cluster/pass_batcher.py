"""Calls made under one key in one pass of an event loop go out as one batch: the
first call schedules the send for when the loop has run everything else that was
ready, so the requests that arrive together travel together. Used for the tokenizer
role's TokenizeBatch and each scheduler's SubmitBatch."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Item = TypeVar("Item")
Result = TypeVar("Result")

# Sends one batch; returns each item's result or the exception that item gets.
Send = Callable[[Key, list[Item]], Awaitable[list[Result | BaseException]]]


class PassBatcher(Generic[Key, Item, Result]):
    def __init__(self, send: Send) -> None:
        self._send = send
        self._pending: defaultdict[tuple[asyncio.AbstractEventLoop, Key], list[tuple[Item, asyncio.Future]]] = (
            defaultdict(list))
        self._sending: set[asyncio.Task] = set()  # held until done, so none is collected midway

    def submit(self, key: Key, item: Item) -> asyncio.Future[Result]:
        """The item's result, or its exception. The future settles whether or not its
        caller still waits (shield it if the caller must know the outcome after leaving)."""
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[Result] = loop.create_future()
        pending = self._pending[(loop, key)]
        pending.append((item, settled))
        if len(pending) == 1:  # the first of this pass: the batch leaves once the loop has taken the others
            loop.call_soon(self._start, loop, key)
        return settled

    def _start(self, loop: asyncio.AbstractEventLoop, key: Key) -> None:
        task = loop.create_task(self._flush(key, self._pending.pop((loop, key))))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _flush(self, key: Key, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            results = await self._send(key, [item for item, _ in batch])
        except Exception as exc:  # the whole call failed: every item fails with it
            results = [exc] * len(batch)
        for (_, settled), result in zip(batch, results):
            if settled.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                settled.set_exception(result)
            else:
                settled.set_result(result)
