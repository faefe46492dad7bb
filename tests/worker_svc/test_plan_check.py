"""The worker refuses a step plan it cannot run as it stands, before touching any state:
one made for another instance (or none), block ids or copies outside its pools, steps
for requests it does not hold. Over gRPC, to the worker role: the refusals are clear
status codes and the worker serves the next valid plan."""
from __future__ import annotations

import re

import grpc
import pytest

from kvfleet.processes import free_port
from services.messages import CachedRequestData, Empty, NewRequestData, StepPlan
from services.sampling_params import SamplingParams
from services.transport.role_services import WORKER
from worker_svc.runtime.plan_check import InvalidPlan, WrongWorkerInstance, check_plan

from servers import RoleProcess

ID = "w1"


def _new(request_id: str, block_ids: list[int]) -> NewRequestData:
    return NewRequestData(request_id, [1, 504, 3458, 314], 4, block_ids, 0, SamplingParams(temperature=0, max_tokens=4))


@pytest.mark.parametrize("plan, message", [
    (StepPlan(1), "planned for worker instance (none)"),
    (StepPlan(1, worker_instance_id="w0"), "planned for worker instance w0"),
])
def test_a_plan_for_another_instance_is_refused(plan: StepPlan, message: str) -> None:
    with pytest.raises(WrongWorkerInstance, match=re.escape(message)):
        check_plan(plan, ID, 10, 0, set())


@pytest.mark.parametrize("plan, message", [
    (StepPlan(1, [_new("a", [3, 10])], num_scheduled_tokens={"a": 4}), "a block id 10 is outside this worker's pool of 10"),
    (StepPlan(1, [_new("a", [-1])], num_scheduled_tokens={"a": 4}), "a block id -1"),
    (StepPlan(1, cached_requests=[CachedRequestData("held", [11], 4)]), "a block id 11"),
    (StepPlan(1, blocks_to_copy=[(2, 12)]), "a copied block 12"),
    (StepPlan(1, blocks_to_swap_out=[(2, 4)]), "a host block 4 is outside this worker's pool of 4"),
    (StepPlan(1, blocks_to_swap_in=[(1, 10)]), "a swapped-in device block 10"),
    (StepPlan(1, cached_requests=[CachedRequestData("ghost", [], 4)]), "'ghost' is not held here"),
    (StepPlan(1, num_scheduled_tokens={"ghost": 1}), "'ghost' is scheduled but not held here"),
    (StepPlan(1, num_scheduled_tokens={"held": 0}), "0 tokens scheduled for 'held'"),
    (StepPlan(1, num_scheduled_tokens={"held": 2}, scheduled_spec_decode_tokens={"held": [5, 6]}),
     "2 drafts for 'held', which is scheduled 2 tokens"),
    (StepPlan(1, scheduled_spec_decode_tokens={"held": [5]}), "1 drafts for 'held', which is scheduled 0 tokens"),
])
def test_a_plan_outside_the_pools_or_the_held_requests_is_refused(plan: StepPlan, message: str) -> None:
    plan.worker_instance_id = ID
    with pytest.raises(InvalidPlan, match=re.escape(message)):
        check_plan(plan, ID, 10, 4, {"held"})


def test_the_worker_role_refuses_bad_plans_with_clear_codes_and_serves_on() -> None:
    port = free_port()
    worker = RoleProcess("worker", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "32",
                         "--port", str(port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = WORKER.stub(channel)
            described = stub.Describe(Empty(), wait_for_ready=True, timeout=120)
            refusals = {
                "none": StepPlan(1, [_new("a", [0])], num_scheduled_tokens={"a": 4}),
                "out of range": StepPlan(1, [_new("a", [0, 32])], num_scheduled_tokens={"a": 4},
                                         worker_instance_id=described.instance_id),
            }
            codes = {}
            for name, plan in refusals.items():
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ExecuteStep(plan, timeout=30)
                codes[name] = (refused.value.code(), refused.value.details())
            assert codes["none"][0] is grpc.StatusCode.FAILED_PRECONDITION
            assert codes["out of range"] == (grpc.StatusCode.INVALID_ARGUMENT,
                                             "a block id 32 is outside this worker's pool of 32")
            good = StepPlan(1, [_new("a", [0])], num_scheduled_tokens={"a": 4}, worker_instance_id=described.instance_id)
            result = stub.ExecuteStep(good, timeout=60)
            assert len(result.sampled_token_ids["a"]) == 1
    finally:
        worker.kill()
