"""One engine request seen as text, and the stream plumbing the endpoints share.

The gateway owns detokenization and stop strings (the engine speaks token ids): each
request gets a TextStream, and a stop-string hit finishes the response here and
aborts the request in the engine so its blocks are freed at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TypeVar

from gateway.metrics import GatewayMetrics
from services.engine_client import EngineClient
from services.output_processor import TextDelta, TextStream
from services.sampling_params import SamplingParams
from tokenizer_svc.tokenizer import Tokenizer

T = TypeVar("T")


async def generate_text(
    engine: EngineClient,
    tokenizer: Tokenizer,
    metrics: GatewayMetrics,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> AsyncGenerator[TextDelta, None]:
    text = TextStream(tokenizer, prompt_token_ids, params)
    meter = metrics.request(len(prompt_token_ids))
    # Whatever ends the stream before a finish_reason (disconnect, engine failure) is an abort.
    finish_reason: str | None = "abort"
    try:
        async with aclosing(engine.generate(request_id, prompt_token_ids, params)) as deltas:
            async for delta in deltas:
                update = text.apply(delta)
                meter.tokens(len(delta.new_token_ids))
                if update.hit_stop_string:
                    await engine.abort(request_id)
                if update.finish_reason is not None:
                    finish_reason = update.finish_reason
                yield update
                if update.finish_reason is not None:
                    return
    except ValueError:
        finish_reason = None  # rejected input: the request never started
        raise
    finally:
        if finish_reason is not None:
            meter.finished(finish_reason)


async def prime(stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Waits for the stream's first item, so that a rejected request raises here,
    before a streaming response has sent its 200 status."""
    first = await anext(stream)
    return _chain(first, stream)


async def _chain(first: T, stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    async with aclosing(stream):
        yield first
        async for item in stream:
            yield item


async def prime_all(streams: list[AsyncGenerator[T, None]]) -> list[AsyncGenerator[T, None]]:
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


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
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
