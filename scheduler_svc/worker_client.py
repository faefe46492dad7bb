"""RemoteWorker: a WorkerHandle over gRPC, so EngineCore drives a worker in another
process exactly as it drives an in-process one. Synchronous, like EngineCore's loop."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from scheduler_svc.engine_core import WorkerLost
from services.lora_request import LoRARequest
from services.messages import Empty, StepPlan, StepResult, WorkerDescription
from services.scheduler_messages import RemoveLoraRequest
from services.structured_outputs import StructuredOutputsParams
from services.transport.channel import open_channel
from services.transport.futures import invalid_argument
from services.transport.role_services import WORKER


class WorkerError(RuntimeError):
    """The worker failed the call; the message says how."""


# We never cancel a call ourselves: CANCELLED is the worker's server going away.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# Describe checks on a worker that was lost are quick: requests wait on them.
_RECHECK_TIMEOUT_S = 2.0
# A step's deadline grows with its size: the base for each this many scheduled tokens.
DEADLINE_TOKENS = 512
DEFAULT_STEP_TIMEOUT_S = 30.0


def step_deadline_s(base_s: float, num_tokens: int) -> float:
    """How long a step of `num_tokens` may take before its worker counts as hung: a
    worker stopped (SIGSTOP, a wedged device) answers nothing, and without a deadline
    its scheduler would wait forever with every request."""
    return base_s * (1 + num_tokens / DEADLINE_TOKENS)


class RemoteWorker:
    def __init__(self, address: str, ready_timeout_s: float = 600.0,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        """`ready_timeout_s`: how long describe() waits for the worker to listen (it
        opens its port once its weights are loaded); `step_timeout_s`: the deadline of a
        step, per DEADLINE_TOKENS scheduled tokens (step_deadline_s)."""
        self.address = address
        self._ready_timeout_s = ready_timeout_s
        self._step_timeout_s = step_timeout_s
        self._described = False
        self._plans_in_flight = 1  # as the worker describes itself
        self._channel = open_channel(address)
        self._stub = WORKER.stub(self._channel)

    def describe(self) -> WorkerDescription:
        """The first call waits for the worker to come up; later ones (checking on a
        worker that was lost) answer within seconds."""
        if self._described:
            described = self._call(self._stub.Describe, Empty(), timeout=_RECHECK_TIMEOUT_S)
        else:
            described = self._call(self._stub.Describe, Empty(), wait_for_ready=True, timeout=self._ready_timeout_s)
            self._described = True
        self._plans_in_flight = described.max_plans_in_flight
        return described

    def execute(self, plan: StepPlan) -> StepResult:
        # No waiting for a lost worker: every request's KV is gone with it, so the
        # step fails at once and the scheduler ends them all with this error.
        deadline_s = step_deadline_s(self._step_timeout_s, sum(plan.num_scheduled_tokens.values()))
        return self._call(self._stub.ExecuteStep, plan, timeout=deadline_s)

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """For plans in flight (a pipelined group, or async scheduling's one ahead): the
        worker takes plans in step order, whatever order its server threads see them in. A
        plan's deadline covers the ones ahead of it."""
        deadline_s = step_deadline_s(self._step_timeout_s, sum(plan.num_scheduled_tokens.values()))
        call = self._stub.ExecuteStep.future(plan, timeout=deadline_s * max(self._plans_in_flight, 2))
        result: Future[StepResult] = Future()

        def settle(done: grpc.Future) -> None:
            try:
                result.set_result(done.result())
            except grpc.RpcError as exc:
                result.set_exception(self._error(exc))

        call.add_done_callback(settle)
        return result

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        self._call_checked(self._stub.CompileGrammar, params, invalid_argument)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._call_checked(self._stub.AddLora, lora_request, ValueError)

    def _call_checked(self, method: grpc.UnaryUnaryMultiCallable, request: object,
                      refused: Callable[[str], Exception]) -> None:
        """A call whose INVALID_ARGUMENT is the request's fault: raised as `refused(details)`,
        not as the worker's failure."""
        try:
            self._call(method, request)
        except WorkerError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise refused(cause.details()) from None
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        self._call(self._stub.RemoveLora, RemoveLoraRequest(lora_int_id))
        return True

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object, **kwargs: Any) -> Any:
        try:
            return method(request, **kwargs)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: grpc.RpcError) -> Exception:
        code = exc.code()
        if code in _LOST:
            error: Exception = WorkerLost(f"worker at {self.address} is unreachable: {code.name}: {exc.details()}")
        elif code is grpc.StatusCode.FAILED_PRECONDITION:  # a restarted worker refusing an old plan
            error = WorkerLost(f"worker at {self.address} restarted: {exc.details()}")
        else:
            error = WorkerError(f"worker at {self.address} failed: {code.name}: {exc.details()}")
        error.__cause__ = exc
        return error
