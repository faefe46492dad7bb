"""StepOrder: the worker server hands a pipelined scheduler's plans over in step order,
including a scheduler's first two plans arriving the wrong way round."""
from __future__ import annotations

import threading
import time

from services.messages import CachedRequestData, StepPlan
from worker_svc.server import TURN_TIMEOUT_S, StepOrder

WORKER = "worker-a"


def plan(step_id: int, continues: bool, worker: str = WORKER) -> StepPlan:
    cached = [CachedRequestData("r0", [], 4)] if continues else []
    return StepPlan(step_id, cached_requests=cached, worker_instance_id=worker, scheduler_instance_id="sched-1")


def run_in_thread(order: StepOrder, step: StepPlan, handed: list[int]) -> threading.Thread:
    def take_turn() -> None:
        with order.turn(step):
            handed.append(step.step_id)

    thread = threading.Thread(target=take_turn)
    thread.start()
    return thread


def test_a_first_seen_step_1_that_continues_step_0_waits_for_it():
    order, handed = StepOrder(WORKER), []
    second = run_in_thread(order, plan(1, continues=True), handed)
    time.sleep(0.2)
    assert handed == []  # a new scheduler's step 1 holds requests step 0 adds: it waits
    run_in_thread(order, plan(0, continues=False), handed).join()
    second.join()
    assert handed == [0, 1]


def test_plans_that_need_no_earlier_step_start_at_once():
    order, handed = StepOrder(WORKER), []
    began = time.monotonic()
    run_in_thread(order, plan(5, continues=False), handed).join()  # new requests only
    run_in_thread(order, plan(9, continues=True, worker="worker-old"), handed).join()  # refused later anyway
    assert handed == [5, 9] and time.monotonic() - began < TURN_TIMEOUT_S / 2
