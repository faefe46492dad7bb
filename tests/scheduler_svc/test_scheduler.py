"""Scheduler and block pool contracts, driven step by step with explicit step results."""
from __future__ import annotations

import pytest

from scheduler_svc.block_pool import BlockPool, NoFreeBlocks
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from services.invalid_parameter import InvalidParameter
from services.lora_request import LoRARequest
from services.messages import StepResult
from services.sampling_params import SamplingParams

EOS = 2


def make_scheduler(**overrides) -> Scheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_blocks=64,
                  vocab_size=1000)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def add(scheduler: Scheduler, request_id: str, prompt_len: int, **params) -> Request:
    params.setdefault("max_tokens", 8)
    request = Request(request_id, list(range(10, 10 + prompt_len)), SamplingParams(**params), (EOS,))
    scheduler.add_request(request)
    return request


def run_step(scheduler: Scheduler, token: int = 7):
    plan = scheduler.schedule()
    # Every request whose scheduled tokens reach its last known token gets `token`.
    sampled = {
        rid: [token]
        for rid, n in plan.num_scheduled_tokens.items()
        if scheduler.requests[rid].num_computed_tokens + n == scheduler.requests[rid].num_tokens
    }
    return plan, scheduler.update(plan, StepResult(plan.step_id, sampled))


def test_block_pool_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.share(blocks[:1])
    pool.free(blocks)
    assert pool.num_free_blocks == 3  # the shared block has one holder left
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5)
    with pytest.raises(AssertionError):
        pool.free(blocks[:1])


def test_first_plan_sends_full_data_then_deltas():
    scheduler = make_scheduler()
    add(scheduler, "a", 6)
    plan, _ = run_step(scheduler)
    assert [r.request_id for r in plan.new_requests] == ["a"] and not plan.cached_requests
    assert plan.new_requests[0].token_ids == list(range(10, 16)) and len(plan.new_requests[0].block_ids) == 2
    plan, _ = run_step(scheduler)  # token 7 at position 6: still in block 2
    assert not plan.new_requests and plan.cached_requests[0].new_block_ids == []
    assert plan.num_scheduled_tokens == {"a": 1}
    plan, _ = run_step(scheduler)  # position 7 fills block 2; position 8 needs a new block next step
    plan, _ = run_step(scheduler)
    assert len(plan.cached_requests[0].new_block_ids) == 1


def test_token_budget_chunks_long_prompts_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "short", 3)
    run_step(scheduler)
    add(scheduler, "long", 40)
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"short": 1, "long": 15}
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"short": 1, "long": 15}


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(scheduler, str(i), 4)
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["0", "1"]


def test_newest_request_is_preempted_and_recomputed():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24)
    add(scheduler, "old", 8, max_tokens=12)
    add(scheduler, "new", 8, max_tokens=12)
    run_step(scheduler)  # 2 + 2 blocks
    while scheduler.num_preemptions == 0:
        plan, _ = run_step(scheduler)
    assert scheduler.requests["new"].num_computed_tokens == 0 and scheduler.waiting[0].request_id == "new"
    assert plan.finished_request_ids == ["new"]  # the worker drops the preempted state
    assert list(plan.num_scheduled_tokens) == ["old"]


def test_finish_reasons_and_blocks_return():
    scheduler = make_scheduler()
    add(scheduler, "eos", 4)
    add(scheduler, "ignore", 4, ignore_eos=True, max_tokens=3)
    add(scheduler, "stop_id", 4, stop_token_ids=[EOS], ignore_eos=True)
    finished = {}
    while scheduler.has_unfinished_requests:
        _, deltas = run_step(scheduler, token=EOS)
        finished.update({d.request_id: (d.finish_reason, d.stop_reason) for d in deltas if d.finish_reason})
    assert finished == {"eos": ("stop", None), "ignore": ("length", None), "stop_id": ("stop", EOS)}
    assert scheduler.block_pool.num_free_blocks == 64


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler = make_scheduler()
    add(scheduler, "a", 10)
    add(scheduler, "b", 10)
    run_step(scheduler)
    delta = scheduler.abort_request("a")
    assert delta.finish_reason == "abort"
    assert scheduler.abort_request("a") is None
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["a"]
    assert scheduler.block_pool.num_used_blocks == 3


def test_max_model_len_ends_generation():
    scheduler = make_scheduler(max_model_len=10)
    add(scheduler, "a", 8, max_tokens=None)
    reasons = []
    while scheduler.has_unfinished_requests:
        _, deltas = run_step(scheduler)
        reasons += [d.finish_reason for d in deltas if d.finish_reason]
    assert reasons == ["length"]


def test_a_failed_plan_names_the_requests_whose_kv_it_moved():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24, preemption_mode="swap", num_host_blocks=8)
    add(scheduler, "old", 8, max_tokens=12)
    add(scheduler, "new", 8, max_tokens=12)
    run_step(scheduler)
    plan = scheduler.schedule()
    while not plan.blocks_to_swap_out:  # run until a plan swaps "new" out
        sampled = {rid: [7] for rid in plan.num_scheduled_tokens}
        scheduler.update(plan, StepResult(plan.step_id, sampled))
        plan = scheduler.schedule()
    assert "new" not in plan.num_scheduled_tokens
    assert sorted(scheduler.requests_in(plan)) == ["new", "old"]


def test_tokens_per_step_count_a_prompt_once_with_its_first_token_as_vllm_does():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, "long", 40, max_tokens=3)  # three prefill chunks sample nothing: no observation
    firsts = []
    while scheduler.has_unfinished_requests:
        _, deltas = run_step(scheduler)
        firsts += [d.first_token_times for d in deltas]
    counts = scheduler.iteration_tokens.snapshot()
    assert sum(counts.counts) == 3 and counts.sum == 40 + 3
    first, *rest = firsts
    assert first.queued_s >= 0 and first.prefill_s > 0 and rest == [None, None]


def test_a_preempted_request_reports_its_first_scheduling_and_first_token_only():
    scheduler = make_scheduler(num_blocks=6, max_model_len=24)
    old, new = add(scheduler, "old", 8, max_tokens=12), add(scheduler, "new", 8, max_tokens=12)
    _, deltas = run_step(scheduler)
    assert all(d.first_token_times is not None for d in deltas)
    scheduled = new.scheduled_time
    times = []
    while scheduler.has_unfinished_requests:
        _, deltas = run_step(scheduler)
        times += [d.first_token_times for d in deltas]
    assert scheduler.num_preemptions > 0 and new.scheduled_time == scheduled and times == [None] * len(times)
    assert old.is_finished and new.is_finished


def _sampled(scheduler: Scheduler, plan) -> StepResult:
    return StepResult(plan.step_id, {rid: [7] for rid, n in plan.num_scheduled_tokens.items()
                                     if scheduler.requests[rid].num_computed_tokens + n
                                     == scheduler.requests[rid].num_tokens})


def test_plans_in_flight_share_the_requests_and_never_schedule_one_twice():
    """A pipeline's plans: each takes its share, a request in flight waits for its
    result, and the tokens it sampled reach the worker with its next plan."""
    scheduler = make_scheduler()
    for i in range(4):
        add(scheduler, f"r{i}", 5)
    first = scheduler.schedule(max_requests=2)
    second = scheduler.schedule(max_requests=2)
    assert list(first.num_scheduled_tokens) == ["r0", "r1"] and list(second.num_scheduled_tokens) == ["r2", "r3"]
    assert scheduler.num_schedulable == 0 and not scheduler.schedule().num_scheduled_tokens
    scheduler.update(first, _sampled(scheduler, first))
    third = scheduler.schedule()
    assert list(third.num_scheduled_tokens) == ["r0", "r1"]
    assert [(c.request_id, c.new_token_ids) for c in third.cached_requests] == [("r0", [7]), ("r1", [7])]


def test_a_request_in_flight_is_never_preempted():
    """Its step is computing into its blocks: the newest request not in flight goes instead."""
    scheduler = make_scheduler(num_blocks=2)
    add(scheduler, "old", 4)
    add(scheduler, "new", 4)
    first = scheduler.schedule(max_requests=1)
    second = scheduler.schedule(max_requests=1)
    assert list(first.num_scheduled_tokens) == ["old"] and list(second.num_scheduled_tokens) == ["new"]
    scheduler.update(first, _sampled(scheduler, first))
    third = scheduler.schedule()  # "old" needs a second block; "new", the newest, is in flight
    assert not third.num_scheduled_tokens
    assert scheduler.requests["old"].status.name == "PREEMPTED"
    assert scheduler.requests["new"].status.name == "RUNNING" and scheduler.requests["new"].in_flight


def test_parallel_samples_count_against_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=3)
    leader = Request("p", list(range(10, 16)), SamplingParams(max_tokens=8), (EOS,))
    followers = [Request(f"p-{i}", list(range(10, 16)), SamplingParams(max_tokens=8), (EOS,)) for i in range(1, 4)]
    scheduler.add_request(leader, followers)
    for _ in range(3):
        run_step(scheduler)
        assert len(scheduler.running) <= 3
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 1  # the fourth sample waits its turn


def test_a_pooling_request_is_prefill_only_bypasses_mean_s_prefix_cache_and_frees_its_blocks():
    from services.pooling_params import PoolerConfig, PoolingParams

    with pytest.raises(InvalidParameter, match="does not pool"):
        add(make_scheduler(), "p", 8, pooling=PoolingParams())
    with pytest.raises(InvalidParameter, match="generates no text"):
        add(make_scheduler(pooler=PoolerConfig(), generates=False), "g", 8)
    pooled = SamplingParams(pooling=PoolingParams())
    with pytest.raises(InvalidParameter, match="one result"):  # a forked follower would pool its last token only
        make_scheduler(pooler=PoolerConfig()).add_request(Request("p", [10, 11], pooled, (EOS,)),
                                                          [Request("p-1", [10, 11], pooled, (EOS,))])
    scheduler = make_scheduler(pooler=PoolerConfig(pooling_type="MEAN"), max_num_batched_tokens=16)
    add(scheduler, "g", 12)
    scheduler.update(plan := scheduler.schedule(), StepResult(plan.step_id, {"g": [4]}))
    add(scheduler, "p", 24, pooling=PoolingParams())  # its first 12 tokens are cached, but MEAN reads them all
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"g": 1, "p": 15}  # beside the decode, in the same budget
    assert plan.new_requests[0].num_computed_tokens == 0
    scheduler.update(plan, StepResult(plan.step_id, {"g": [5]}))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"g": 1, "p": 9}
    [_, delta] = scheduler.update(plan, StepResult(plan.step_id, {"g": [6]}, pooled={"p": [0.6, 0.8]}))
    assert (delta.request_id, delta.pooled, delta.new_token_ids, delta.finish_reason) == ("p", [0.6, 0.8], [], "stop")
    assert "p" not in scheduler.requests and len(scheduler.running) == 1
    assert scheduler.schedule().finished_request_ids == ["p"]  # the worker drops its state


def test_pooling_tokens_beside_generation_are_paid_for_from_the_streams_allowance():
    """So that a chat stream's turns stay short beside embeddings: while a generation request
    runs, pooling tokens go only into steps planned out of debt, as many as the credit buys
    (a later generation request passes them in the queue); the whole budget once none runs."""
    from services.pooling_params import PoolerConfig, PoolingParams

    scheduler = make_scheduler(pooler=PoolerConfig(), max_num_batched_tokens=64)
    budget = scheduler.pooling_budget
    budget.max_rise = 0.2  # the rise the numbers below are worked out for
    add(scheduler, "g", 4)
    run_step(scheduler)
    # Measured: 100 ms a decode-only turn, 5 ms a prompt token. Turns with no pooling work
    # anywhere bank nothing: only this turn's 20 ms allowance buys tokens.
    for _ in range(3):
        budget.record(0, 1, 0.100, False)
    budget.record(40, 0, 0.300, True)
    assert budget.cap() == 4
    budget.record(0, 1, 0.100, True)  # a decode-only turn while pooling waits earns 20 ms
    assert budget.cap() == 8  # 20 ms of credit and this step's 20 ms buy 8 tokens
    for start, (request_id, length) in enumerate((("p1", 6), ("p2", 12), ("g2", 5))):  # nothing cached
        params = SamplingParams(pooling=PoolingParams()) if request_id[0] == "p" else SamplingParams(max_tokens=8)
        scheduler.add_request(Request(request_id, [100 * (start + 1) + i for i in range(length)], params, (EOS,)))
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"g": 1, "p1": 6, "g2": 5, "p2": 2}
    # That step took 110 ms beyond a decode-only one: 70 ms of debt after its 20 ms allowance.
    budget.record(13, 1, 0.210, True)
    plan, _ = run_step(scheduler)
    assert plan.num_scheduled_tokens == {"g": 1, "g2": 1}  # in debt: no pooling token
    for _ in range(4):  # four decode-only steps repay 80 ms
        budget.record(0, 2, 0.100, True)
    plan, _ = run_step(scheduler)
    # 10 ms of credit and this step's 20 ms buy 6 tokens (this harness samples p1 a token too).
    assert plan.num_scheduled_tokens == {"g": 1, "g2": 1, "p1": 1, "p2": 5}
    for request_id in ("g", "g2", "p1"):
        scheduler.abort_request(request_id)
    assert scheduler.schedule().num_scheduled_tokens == {"p2": 5}  # alone: uncapped


def test_requests_of_adapters_beyond_max_loras_wait_and_the_others_pass_them():
    scheduler = make_scheduler(max_loras=1)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for request_id, lora in (("a1", a), ("b1", b), ("base", None), ("a2", a)):
        scheduler.add_request(Request(request_id, [10, 11, 12], SamplingParams(max_tokens=1), (EOS,),
                                      lora_request=lora))
    plan, _ = run_step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["a1", "base", "a2"]
    assert [new.lora_request for new in plan.new_requests] == [a, None, a]
    assert [request.request_id for request in scheduler.waiting] == ["b1"]
    plan, _ = run_step(scheduler)  # a's requests finished: b's turn
    assert list(plan.num_scheduled_tokens) == ["b1"] and plan.new_requests[0].lora_request == b
