"""The scheduler role's gRPC service: Submit / Abort / Stats, and each gateway's
StreamOutputs, over a StepLoop (which owns the EngineCore) and its OutputHub."""
from __future__ import annotations

from collections.abc import Iterator

import grpc

from scheduler_svc.output_hub import OutputHub
from scheduler_svc.step_loop import StepLoop
from services.engine_client import EngineUnavailable
from services.pb.kvfleet.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.transport.convert import sampling_params_from_proto, stats_to_proto
from services.transport.server import RoleServer

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Each open StreamOutputs holds a server thread for its lifetime (one or a few per
# gateway replica); the rest serve Submit, Abort, Stats and health checks.
MAX_WORKERS = 64


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: StepLoop, hub: OutputHub) -> None:
        self._loop = loop
        self._hub = hub

    def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        for name in ("request_id", "gateway_id"):
            if not getattr(request, name):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must not be empty")
        if not self._hub.has_subscriber(request.gateway_id):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"gateway_id: no StreamOutputs is open for gateway {request.gateway_id!r}; open one first",
            )
        try:
            self._loop.submit(
                request.request_id,
                request.prompt_token_ids,
                sampling_params_from_proto(request.sampling_params),
                request.cache_salt if request.HasField("cache_salt") else None,
                request.gateway_id,
            )
        except ValueError as exc:  # InvalidParameter's message starts with the parameter
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return scheduler_pb2.SubmitResponse()

    def Abort(self, request: scheduler_pb2.AbortRequest, context: grpc.ServicerContext) -> scheduler_pb2.AbortResponse:
        self._loop.abort(request.request_id)
        return scheduler_pb2.AbortResponse()

    def Stats(self, request: scheduler_pb2.StatsRequest, context: grpc.ServicerContext) -> common_pb2.EngineStats:
        return stats_to_proto(self._loop.stats())

    def StreamOutputs(
        self, request: scheduler_pb2.StreamOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[scheduler_pb2.StepOutputs]:
        if not request.gateway_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gateway_id: must not be empty")
        try:
            subscription = self._hub.subscribe(request.gateway_id)
        except EngineUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Wakes the reader below when the client goes away.
        if not context.add_callback(subscription.close):
            subscription.close()
        try:
            yield scheduler_pb2.StepOutputs()  # subscribed: this gateway's Submits are accepted from now on
            while (batch := subscription.next_batch()) is not None:
                yield scheduler_pb2.StepOutputs(deltas=batch)
        finally:
            self._hub.unsubscribe(subscription)


def start_scheduler_server(loop: StepLoop, hub: OutputHub, address: str) -> RoleServer:
    """Starts `loop` and serves it on `address` ("host:port"; port 0 picks a free one).
    Stopping the server drains the loop first (Submit answers UNAVAILABLE, running
    requests step on until they end or the grace runs out), then stops it, so every
    stream gets its final deltas."""
    server = RoleServer(
        address,
        SERVICE_NAME,
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop, hub), s),
        max_workers=MAX_WORKERS,
        drain=loop.drain,
    )
    loop.start()
    server.start()
    return server
