"""Bridges from gRPC's thread-run calls to asyncio, and back from gRPC status to kvfleet's errors."""
from __future__ import annotations

import asyncio

import grpc

from services.invalid_parameter import InvalidParameter


async def finished(call: grpc.Future) -> None:
    """Waits on the caller's loop for a gRPC future run by gRPC's threads (never blocking the loop)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(_: grpc.Future) -> None:
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop is closed; nobody waits any more
            pass

    call.add_done_callback(settle)
    await done


def invalid_argument(details: str) -> ValueError:
    """An INVALID_ARGUMENT's details as the error raised in-process: the roles write
    them as "param: message", which becomes InvalidParameter(param, message)."""
    param, sep, message = details.partition(": ")
    return InvalidParameter(param, message) if sep and param.isidentifier() else ValueError(details)
