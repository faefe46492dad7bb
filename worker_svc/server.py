"""The worker role's gRPC service over a Worker: Describe, ExecuteStep (one step at a
time), and beside the steps CompileGrammar and FetchKvBlocks (another replica's worker
fetching KV held for it)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from services.kv_transfer_messages import KvBlock, KvFetchRequest
from services.lora_request import LoRARequest
from services.messages import Empty, StepPlan, StepResult, WorkerDescription
from services.scheduler_messages import RemoveLoraRequest
from services.structured_outputs import StructuredOutputsParams
from services.transport.role_services import WORKER
from services.transport.server import RoleServer
from worker_svc.runtime.kv_transfer import MAX_SERVED_FETCHES
from worker_svc.runtime.plan_check import InvalidPlan, WrongWorkerInstance
from worker_svc.runtime.worker import SCHEDULER_GONE_S, Worker

logger = logging.getLogger(__name__)

SERVICE_NAME = WORKER.name
TURN_TIMEOUT_S = 2.0


class StepOrder:
    """Hands a pipelined worker its plans in step order: a scheduler keeps several in
    flight, and the server's threads may see them in any order. A plan whose turn has
    not come waits (up to TURN_TIMEOUT_S, in case the one before it never arrives). A plan
    of a scheduler instance not seen yet starts its sequence, unless it continues requests
    that an earlier step of it must have added here (its step 1 can arrive before its step
    0). A plan for another worker instance, refused anyway, never waits for that."""

    def __init__(self, worker_instance_id: str) -> None:
        self._worker_instance_id = worker_instance_id
        self._turns = threading.Condition()
        self._scheduler_instance_id = ""
        self._next_step_id = 0

    @contextmanager
    def turn(self, plan: StepPlan) -> Iterator[None]:
        """Holds the plan's turn while it is handed over; the next plan's comes after."""
        def its_turn() -> bool:
            if plan.worker_instance_id != self._worker_instance_id:
                return True
            if plan.scheduler_instance_id != self._scheduler_instance_id:
                return plan.step_id == 0 or not plan.cached_requests
            return plan.step_id <= self._next_step_id

        with self._turns:
            if not self._turns.wait_for(its_turn, TURN_TIMEOUT_S):
                logger.warning("step %d ran without step %d before it", plan.step_id, self._next_step_id)
        try:
            yield
        finally:
            with self._turns:
                if plan.scheduler_instance_id != self._scheduler_instance_id:
                    self._scheduler_instance_id, self._next_step_id = plan.scheduler_instance_id, 0
                self._next_step_id = max(self._next_step_id, plan.step_id + 1)
                self._turns.notify_all()


class WorkerServicer:
    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        # The worker's per-request state assumes one step at a time (a pipeline's leader
        # holds it while its own stage runs the plan).
        self.lock = threading.Lock()
        self._order = StepOrder(worker.instance_id)

    def Describe(self, request: Empty, context: grpc.ServicerContext) -> WorkerDescription:
        return self._worker.describe()

    def ExecuteStep(self, plan: StepPlan, context: grpc.ServicerContext) -> StepResult:
        try:
            with self._order.turn(plan), self.lock:
                outcome = self._worker.submit(plan)
            result = outcome.result()
        except WrongWorkerInstance as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidPlan as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            logger.exception("step %d failed", plan.step_id)
            context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {exc!r}")
        return result

    def FetchKvBlocks(self, request: KvFetchRequest, context: grpc.ServicerContext) -> Iterator[KvBlock]:
        """Another replica's worker fetching the blocks this one's scheduler holds for it
        (docs/disaggregation.md); beside the steps, on a server thread of its own."""
        transfer = self._worker.kv_transfer
        if transfer is None or transfer.peer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker hands no KV over: a worker of "
                          "several ranks (-tp, -pp) does not yet")
        ended_here = threading.Event()  # by this worker: the consumer may still read what it was lent
        context.add_callback(lambda: ended_here.is_set() or transfer.abandon(request.request_id))
        try:
            yield from transfer.serve(request)
        except ValueError as exc:
            ended_here.set()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        ended_here.set()

    def CompileGrammar(self, params: StructuredOutputsParams, context: grpc.ServicerContext) -> Empty:
        try:
            self._worker.compile_grammar(params)
        except ValueError as exc:  # InvalidParameter: "field: the compiler's message"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return Empty()


    def AddLora(self, lora_request: LoRARequest, context: grpc.ServicerContext) -> Empty:
        try:
            self._worker.add_lora(lora_request)
        except ValueError as exc:  # LoraAdapterError: what is wrong with the adapter
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return Empty()

    def RemoveLora(self, request: RemoveLoraRequest, context: grpc.ServicerContext) -> Empty:
        self._worker.remove_lora(request.lora_int_id)
        return Empty()


def start_worker_server(worker: Worker, address: str) -> RoleServer:
    """Serves `worker` on `address` ("host:port"; port 0 picks a free one). Stopping the
    server drains it: steps keep running until its scheduler has ended every request
    the worker holds (or the grace runs out)."""
    # Steps run one at a time; the other threads answer Describe, CompileGrammar and health
    # checks; and others serve other replicas' KV fetches (docs/disaggregation.md).
    servicer = WorkerServicer(worker)
    server = RoleServer(
        address, SERVICE_NAME, lambda s: s.add_generic_rpc_handlers([WORKER.handler(servicer)]),
        max_workers=4 + MAX_SERVED_FETCHES, drain=lambda timeout_s: _wait_until_released(worker, servicer.lock, timeout_s),
    )
    server.start()
    return server


def _wait_until_released(worker: Worker, steps: threading.Lock, timeout_s: float) -> bool:
    """Waits until the scheduler has ended every request the worker holds (the drops
    ride on its plans). Health says NOT_SERVING meanwhile, so the worker's lease lapses
    and gateways send its scheduler no new requests. A scheduler with requests here
    steps without pause, so one silent for SCHEDULER_GONE_S is gone: its requests are
    dropped rather than waited for. Returns whether that happened in time."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while held := worker.num_requests:
        with steps:  # no step runs meanwhile
            if worker.scheduler_gone():
                worker.drop_scheduler_state(f"its scheduler sent no step for {SCHEDULER_GONE_S} s")
                break
        if time.monotonic() >= deadline:
            logger.warning("shutdown timeout: the worker still holds %d requests", held)
            return False
        if not logged:
            logger.info("waiting for the scheduler to end the %d requests this worker holds", held)
            logged = True
        time.sleep(0.05)
    return True
