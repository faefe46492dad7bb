"""RemoteWorker: a WorkerHandle over gRPC, so EngineCore drives a worker in another
process exactly as it drives an in-process one. Synchronous, like EngineCore's loop."""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from services.messages import StepPlan, StepResult, WorkerDescription
from services.pb.kvfleet.v1 import worker_pb2, worker_pb2_grpc
from services.transport.channel import open_channel
from services.transport.convert import description_from_proto, plan_to_proto, result_from_proto


class WorkerError(RuntimeError):
    """The worker could not be reached, or failed the call; the message says which."""


class RemoteWorker:
    def __init__(self, address: str, ready_timeout_s: float = 600.0) -> None:
        """`ready_timeout_s`: how long describe() waits for the worker to listen (it
        opens its port once its weights are loaded)."""
        self.address = address
        self._ready_timeout_s = ready_timeout_s
        self._channel = open_channel(address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def describe(self) -> WorkerDescription:
        request = worker_pb2.DescribeWorkerRequest()
        return description_from_proto(
            self._call(self._stub.Describe, request, wait_for_ready=True, timeout=self._ready_timeout_s)
        )

    def execute(self, plan: StepPlan) -> StepResult:
        # No waiting for a lost worker: its requests' KV is gone with it, so the step
        # fails at once and the scheduler ends them with this error.
        return result_from_proto(self._call(self._stub.ExecuteStep, plan_to_proto(plan)))

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: Message, **kwargs: Any) -> Any:
        try:
            return method(request, **kwargs)
        except grpc.RpcError as exc:
            code = exc.code()
            # We never cancel a call ourselves: CANCELLED is the worker's server going away.
            lost = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            what = "is unreachable" if lost else "failed"
            raise WorkerError(f"worker at {self.address} {what}: {code.name}: {exc.details()}") from exc
