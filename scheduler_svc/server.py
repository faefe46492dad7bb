"""The scheduler role's gRPC service: Submit / Abort / Stats, and each gateway's
StreamOutputs, over a StepLoop (which owns the EngineCore) and its OutputHub."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from scheduler_svc.output_hub import OutputHub
from scheduler_svc.step_loop import StepLoop, Submission
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.pb.kvfleet.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.transport.convert import sampling_params_from_proto, stats_to_proto
from services.transport.server import RoleServer

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Each open StreamOutputs holds a server thread for its lifetime (one or a few per
# gateway replica); the rest serve Submit, Abort, Stats and health checks.
MAX_WORKERS = 64


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: StepLoop, hub: OutputHub) -> None:
        self._loop = loop
        self._hub = hub

    def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        [(code, message)] = self._submit([request])
        if code is not grpc.StatusCode.OK:
            context.abort(code, message)
        return scheduler_pb2.SubmitResponse()

    def SubmitBatch(
        self, request: scheduler_pb2.SubmitBatchRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SubmitBatchResponse:
        self._check_instance(request.scheduler_instance_id, context)
        results = [scheduler_pb2.SubmitResult(code=code.value[0], message=message)
                   for code, message in self._submit(request.requests)]
        return scheduler_pb2.SubmitBatchResponse(results=results)

    def _submit(self, requests: Sequence[scheduler_pb2.SubmitRequest]) -> list[tuple[grpc.StatusCode, str]]:
        """Each request's status, as Submit answers it; the valid ones go to the loop together."""
        results: list[tuple[grpc.StatusCode, str]] = [(grpc.StatusCode.OK, "")] * len(requests)
        valid: list[tuple[int, Submission]] = []
        for index, request in enumerate(requests):
            try:
                valid.append((index, self._submission(request)))
            except _Refused as refused:
                results[index] = (refused.code, refused.message)
        try:
            accepted = self._loop.submit([submission for _, submission in valid])
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

    def _submission(self, request: scheduler_pb2.SubmitRequest) -> Submission:
        for name in ("request_id", "gateway_id"):
            if not getattr(request, name):
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: must not be empty")
        if not self._hub.has_subscriber(request.gateway_id):
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"gateway_id: no StreamOutputs is open for gateway {request.gateway_id!r}; open one first")
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        try:
            self._loop.core.compile_grammar(params)  # on this gRPC thread: never on the step loop
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except Exception as exc:  # the worker is away: the request may well succeed later
            raise _Refused(grpc.StatusCode.UNAVAILABLE, f"the worker could not compile the constraint: {exc}") from exc
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        return Submission(request.request_id, list(request.prompt_token_ids), params, cache_salt, request.gateway_id,
                          list(request.output_token_ids))

    def Abort(self, request: scheduler_pb2.AbortRequest, context: grpc.ServicerContext) -> scheduler_pb2.AbortResponse:
        self._loop.abort(request.request_id)
        return scheduler_pb2.AbortResponse()

    def Stats(self, request: scheduler_pb2.StatsRequest, context: grpc.ServicerContext) -> common_pb2.EngineStats:
        self._check_instance(request.scheduler_instance_id, context)
        return stats_to_proto(self._loop.stats())

    def _check_instance(self, meant: str, context: grpc.ServicerContext) -> None:
        """A caller that means another process (a dead one whose address this one took
        over) learns so: what it placed there died with that process."""
        if meant and meant != self._loop.core.instance_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is scheduler instance {self._loop.core.instance_id}, not {meant}")

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

    def ReplayOutputs(
        self, request: scheduler_pb2.ReplayOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[scheduler_pb2.StepOutputs]:
        self._check_instance(request.scheduler_instance_id, context)
        window = self._hub.replay_window
        if window is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler publishes no NATS stream to replay")
        payloads = window.after(request.gateway_id, request.after_seq)
        if payloads is None:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"after_seq: message {request.after_seq + 1} to gateway {request.gateway_id!r} "
                          "is no longer held")
        for payload in payloads:
            yield scheduler_pb2.StepOutputs.FromString(payload)


    def KvSnapshot(
        self, request: scheduler_pb2.KvSnapshotRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.KvSnapshotResponse:
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
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop, hub), s),
        max_workers=MAX_WORKERS,
        drain=loop.drain,
    )
    loop.start()
    server.start()
    return server
