"""Submits to one scheduler that arrive in one pass of the gateway's event loop go out
as one SubmitBatch call: a beam search round of 128 candidates, or a burst of clients,
costs the scheduler one handler thread and one pass of its loop, not one of each per
request, so its health checks and Stats never queue behind them."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Hashable

import grpc

from services.pb.kvfleet.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.transport.futures import finished

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SubmitRefused(Exception):
    """The scheduler answered a submit with this status (or the whole call failed so)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_Pending = list[tuple[scheduler_pb2.SubmitRequest, asyncio.Future[None]]]


class SubmitBatcher:
    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._pending: defaultdict[tuple[asyncio.AbstractEventLoop, Hashable], _Pending] = defaultdict(list)
        self._sending: set[asyncio.Task] = set()  # held until done, so none is collected midway

    def submit(
        self, scheduler: Hashable, stub: scheduler_pb2_grpc.SchedulerStub, request: scheduler_pb2.SubmitRequest
    ) -> asyncio.Future[None]:
        """A future that resolves once `scheduler` accepted the request, or raises
        SubmitRefused. It settles whether or not its caller still waits (shield it):
        who leaves early must still know whether to abort what was submitted."""
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[None] = loop.create_future()
        pending = self._pending[(loop, scheduler)]
        pending.append((request, settled))
        if len(pending) == 1:  # the first of this pass: the batch leaves once the loop has taken the others
            loop.call_soon(self._start, loop, scheduler, stub)
        return settled

    def _start(self, loop: asyncio.AbstractEventLoop, scheduler: Hashable, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        task = loop.create_task(self._send(self._pending.pop((loop, scheduler)), stub))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: _Pending, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        try:
            call = stub.SubmitBatch.future(
                scheduler_pb2.SubmitBatchRequest(requests=[request for request, _ in batch]), timeout=self._timeout_s
            )
        except ValueError as exc:  # its channel is closed: the scheduler was retired
            call = None
            error = SubmitRefused(grpc.StatusCode.UNAVAILABLE, str(exc))
        if call is not None:
            await finished(call)
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                error = SubmitRefused(exc.code(), exc.details() or "")
            else:
                for (_, settled), result in zip(batch, reply.results):
                    if result.code:
                        settled.set_exception(SubmitRefused(_CODES[result.code], result.message))
                    else:
                        settled.set_result(None)
                return
        for _, settled in batch:
            settled.set_exception(error)
