"""Submits to one scheduler that arrive in one pass of the gateway's event loop go out
as one SubmitBatch call (gateway/cluster/pass_batcher.py): a beam search round of 128
candidates, or a burst of clients, costs the scheduler one handler thread and one pass
of its loop, not one of each per request, so its health checks and Stats never queue
behind them."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from services.scheduler_messages import SubmitBatchRequest, SubmitRequest
from services.transport.futures import finished
from services.transport.rpc import Stub

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SubmitRefused(Exception):
    """The scheduler answered a submit with this status (or the whole call failed so)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


# A scheduler: its stub (services/transport/role_services.py's SCHEDULER), and the
# instance (process) the caller means there.
Scheduler = tuple[Stub, str]


def submit_batch(
    timeout_s: float,
) -> Callable[[Scheduler, list[SubmitRequest]], Awaitable[list[None | BaseException]]]:
    """PassBatcher's send for SubmitBatch, keyed by the scheduler."""

    async def send(scheduler: Scheduler, requests: list[SubmitRequest]) -> list[None | BaseException]:
        stub, instance_id = scheduler
        try:
            call = stub.SubmitBatch.future(SubmitBatchRequest(requests, instance_id), timeout=timeout_s)
        except ValueError as exc:  # its channel is closed: the scheduler was retired
            raise SubmitRefused(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        await finished(call)
        try:
            reply = call.result()
        except grpc.RpcError as exc:
            raise SubmitRefused(exc.code(), exc.details() or "") from exc
        return [SubmitRefused(_CODES[r.code], r.message) if r.code else None for r in reply.results]

    return send
