"""The scheduler role's gRPC service: Submit / Abort / Stats, and each gateway's
StreamOutputs, over a StepLoop (which owns the EngineCore) and its OutputHub."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import msgspec

from scheduler_svc.output_hub import OutputHub
from scheduler_svc.step_loop import StepLoop
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.lora_request import LoRARequest
from services.messages import Empty, EngineStats
from services.scheduler_messages import (
    AbortRequest,
    KvSnapshotRequest,
    KvSnapshotResponse,
    RemoveLoraRequest,
    ReplayOutputsRequest,
    StatsRequest,
    StepOutputs,
    StreamOutputsRequest,
    SubmitBatchRequest,
    SubmitBatchResponse,
    SubmitRequest,
    SubmitResult,
)
from services.transport.role_services import SCHEDULER
from services.transport.server import RoleServer

SERVICE_NAME = SCHEDULER.name
# Each open StreamOutputs holds a server thread for its lifetime (one or a few per
# gateway replica); the rest serve Submit, Abort, Stats and health checks.
MAX_WORKERS = 64


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SchedulerServicer:
    def __init__(self, loop: StepLoop, hub: OutputHub) -> None:
        self._loop = loop
        self._hub = hub

    def Submit(self, request: SubmitRequest, context: grpc.ServicerContext) -> Empty:
        [(code, message)] = self._submit([request])
        if code is not grpc.StatusCode.OK:
            context.abort(code, message)
        return Empty()

    def SubmitBatch(self, request: SubmitBatchRequest, context: grpc.ServicerContext) -> SubmitBatchResponse:
        self._check_instance(request.scheduler_instance_id, context)
        results = [SubmitResult(code.value[0], message) for code, message in self._submit(request.requests)]
        return SubmitBatchResponse(results)

    def _submit(self, requests: Sequence[SubmitRequest]) -> list[tuple[grpc.StatusCode, str]]:
        """Each request's status, as Submit answers it; the valid ones go to the loop together."""
        results: list[tuple[grpc.StatusCode, str]] = [(grpc.StatusCode.OK, "")] * len(requests)
        valid: list[tuple[int, SubmitRequest]] = []
        for index, request in enumerate(requests):
            try:
                self._check(request)
            except _Refused as refused:
                results[index] = (refused.code, refused.message)
            else:
                valid.append((index, request))
        try:
            accepted = self._loop.submit([request for _, request in valid])
        except EngineUnavailable as exc:
            return [(grpc.StatusCode.UNAVAILABLE, str(exc)) if code is grpc.StatusCode.OK else (code, message)
                    for code, message in results]
        for (index, _), future in zip(valid, accepted):
            try:
                future.result()
            except ValueError as exc:  # InvalidParameter's message starts with the parameter
                results[index] = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineOverloaded as exc:  # its queue is full: another replica may take it
                results[index] = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except EngineUnavailable as exc:
                results[index] = (grpc.StatusCode.UNAVAILABLE, str(exc))
        return results

    def _check(self, request: SubmitRequest) -> None:
        """What decoding the request could not check (its fields were): raises _Refused."""
        if not self._hub.has_subscriber(request.gateway_id):
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"gateway_id: no StreamOutputs is open for gateway {request.gateway_id!r}; open one first")
        try:
            self._loop.core.compile_grammar(request.sampling_params)  # on this gRPC thread: never on the step loop
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except Exception as exc:  # the worker is away: the request may well succeed later
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"the worker could not compile the constraint: {exc}") from exc

    def AddLora(self, request: LoRARequest, context: grpc.ServicerContext) -> Empty:
        try:
            self._loop.core.add_lora(request)  # on this gRPC thread: reading an adapter must not stall steps
        except ValueError as exc:  # LoraAdapterError: what is wrong with it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return Empty()

    def RemoveLora(self, request: RemoveLoraRequest, context: grpc.ServicerContext) -> Empty:
        self._loop.core.remove_lora(request.lora_int_id)
        return Empty()

    def Abort(self, request: AbortRequest, context: grpc.ServicerContext) -> Empty:
        self._loop.abort(request.request_id)
        return Empty()

    def Stats(self, request: StatsRequest, context: grpc.ServicerContext) -> EngineStats:
        self._check_instance(request.scheduler_instance_id, context)
        return self._loop.stats()

    def _check_instance(self, meant: str, context: grpc.ServicerContext) -> None:
        """A caller that means another process (a dead one whose address this one took
        over) learns so: what it placed there died with that process."""
        if meant and meant != self._loop.core.instance_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is scheduler instance {self._loop.core.instance_id}, not {meant}")

    def StreamOutputs(self, request: StreamOutputsRequest, context: grpc.ServicerContext) -> Iterator[StepOutputs]:
        try:
            subscription = self._hub.subscribe(request.gateway_id)
        except EngineUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Wakes the reader below when the client goes away.
        if not context.add_callback(subscription.close):
            subscription.close()
        try:
            yield StepOutputs()  # subscribed: this gateway's Submits are accepted from now on
            while (batch := subscription.next_batch()) is not None:
                yield StepOutputs(batch)
        finally:
            self._hub.unsubscribe(subscription)

    def ReplayOutputs(
        self, request: ReplayOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[msgspec.Raw]:
        self._check_instance(request.scheduler_instance_id, context)
        window = self._hub.replay_window
        if window is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler publishes no NATS stream to replay")
        payloads = window.after(request.gateway_id, request.after_seq)
        if payloads is None:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"after_seq: message {request.after_seq + 1} to gateway {request.gateway_id!r} "
                          "is no longer held")
        for payload in payloads:  # StepOutputs, as they were sent on NATS
            yield msgspec.Raw(payload)

    def KvSnapshot(self, request: KvSnapshotRequest, context: grpc.ServicerContext) -> KvSnapshotResponse:
        self._check_instance(request.scheduler_instance_id, context)
        if self._hub.kv_events is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler publishes no KV events")
        return self._hub.kv_events.snapshot()


def start_scheduler_server(loop: StepLoop, hub: OutputHub, address: str) -> RoleServer:
    """Starts `loop` and serves it on `address` ("host:port"; port 0 picks a free one).
    Stopping the server drains the loop first (Submit answers UNAVAILABLE, running
    requests step on until they end or the grace runs out), then stops it, so every
    stream gets its final deltas."""
    server = RoleServer(
        address,
        SERVICE_NAME,
        lambda s: s.add_generic_rpc_handlers([SCHEDULER.handler(SchedulerServicer(loop, hub))]),
        max_workers=MAX_WORKERS,
        drain=loop.drain,
    )
    loop.start()
    server.start()
    return server
