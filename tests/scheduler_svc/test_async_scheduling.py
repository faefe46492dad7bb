"""Async scheduling (--async-scheduling): step N+1 is planned and handed to the worker
while step N runs, its decodes reading the tokens step N samples on the worker. The
scheduler's contract, step by step; then, on the real model, every output equals the
synchronous engine's: greedy, seeded sampling, stops, parallel samples, penalties
(which never run ahead), under preemption and prefix caching."""
from __future__ import annotations

import pytest
from test_scheduler import add, make_scheduler

from kvfleet import LLM, SamplingParams
from kvfleet.processes import free_port
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.worker_client import RemoteWorker
from services.config import EngineConfig
from services.messages import StepResult

from servers import RoleProcess


def test_a_decode_is_planned_a_step_ahead_once_and_its_result_lands_in_order() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, "a", 6, max_tokens=4)
    first = scheduler.schedule()  # the prompt, which samples token 1
    ahead = scheduler.schedule()  # token 1's decode, before token 1 is known
    assert first.num_scheduled_tokens == {"a": 6} and ahead.num_scheduled_tokens == {"a": 1}
    [cached] = ahead.cached_requests
    assert cached.num_computed_tokens == 6 and cached.new_token_ids == []  # the worker fills token 1 in
    assert not scheduler.schedule().num_scheduled_tokens  # never two steps ahead
    scheduler.update(first, StepResult(first.step_id, {"a": [11]}))
    third = scheduler.schedule()  # token 2's decode, carrying token 1 to the worker
    assert third.cached_requests[0].new_token_ids == [11] and third.cached_requests[0].num_computed_tokens == 7
    scheduler.update(ahead, StepResult(ahead.step_id, {"a": [12]}))
    # Token 4's step is the last: once token 3 has landed, nothing is planned past it.
    fourth = scheduler.schedule()
    assert fourth.num_scheduled_tokens == {"a": 1}
    scheduler.update(third, StepResult(third.step_id, {"a": [13]}))
    assert not scheduler.schedule().num_scheduled_tokens
    [delta] = scheduler.update(fourth, StepResult(fourth.step_id, {"a": [14]}))
    assert delta.finish_reason == "length" and scheduler.requests == {}


def test_a_request_that_stops_while_its_next_step_runs_ends_there() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, "a", 5, max_tokens=20, stop_token_ids=[99])
    first, ahead = scheduler.schedule(), scheduler.schedule()
    [delta] = scheduler.update(first, StepResult(first.step_id, {"a": [99]}))
    assert delta.finish_reason == "stop" and delta.new_token_ids == [99]
    assert scheduler.update(ahead, StepResult(ahead.step_id, {"a": [5]})) == []  # computed in vain, dropped
    assert scheduler.schedule().finished_request_ids == ["a"] and scheduler.block_pool.num_free_blocks == 64


def test_penalised_sampling_waits_for_its_last_token() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, "a", 5, repetition_penalty=1.2)
    scheduler.schedule()
    assert not scheduler.schedule().num_scheduled_tokens


PRESSURE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=20, max_num_batched_tokens=128,
                enable_prefix_caching=True)


def _workload(llm) -> list[tuple[list[int], SamplingParams]]:
    tokenizer = llm.get_tokenizer()
    shared = "You are a careful assistant. Answer in one short paragraph, plainly. "
    texts = ["Why is the sky blue?", "Name three rivers.", "What is 17 times 3?", "Tell me about owls.",
             "Write a haiku about rain.", "How do magnets work?", "What is a prime number?", "Describe Paris."]
    prompts = [tokenizer.encode(shared * (1 + i % 3) + text) for i, text in enumerate(texts)]
    greedy = [SamplingParams(temperature=0, max_tokens=12 + 5 * i, ignore_eos=True) for i in range(4)]
    others = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokenizer.encode(".")[-1]]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=2),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=25, min_tokens=5),
    ]
    return list(zip(prompts, greedy + others))


def _run(llm, workload) -> list:
    """Tokens, finish reasons, and logprobs rounded: batches differ in make-up between the
    two schedules, which may move a float's last bits."""
    outputs = llm.generate([prompt for prompt, _ in workload], [params for _, params in workload], use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, _rounded(c.logprobs)) for c in output.outputs] for output in outputs]


def _rounded(logprobs: list | None) -> list | None:
    if logprobs is None:
        return None
    return [{token: round(value, 3) for token, value in position.items()} for position in logprobs]


@pytest.fixture(scope="module")
def sync_outputs() -> tuple[list, list]:
    llm = LLM("smollm2", **PRESSURE)
    workload = _workload(llm)
    return workload, _run(llm, workload)


def test_outputs_equal_the_synchronous_engine_s(sync_outputs, make_llm) -> None:
    workload, expected = sync_outputs
    llm = make_llm(async_scheduling=True, **PRESSURE)
    engine = llm.engine
    assert engine.runs_ahead
    in_flight_at_submit = []
    submit = engine.worker.submit
    engine.worker.submit = lambda plan: in_flight_at_submit.append(engine.num_plans_in_flight) or submit(plan)
    assert _run(llm, workload) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache_hits > 0
    # Most plans were handed over while the one before them ran.
    assert in_flight_at_submit.count(1) > len(in_flight_at_submit) / 2, in_flight_at_submit


def test_a_worker_role_over_grpc_takes_plans_ahead_with_the_same_outputs(sync_outputs) -> None:
    """The scheduler hands the worker role its next plan while the current one runs; the
    worker's server takes them in step order and its step thread runs them."""
    workload, expected = sync_outputs
    single = [(i, prompt, params) for i, (prompt, params) in enumerate(workload) if params.n == 1]
    port = free_port()
    flags = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "20",
             "--max-num-batched-tokens", "128", "--async-scheduling"]
    worker = RoleProcess("worker", *flags, "--port", str(port))
    try:
        config = EngineConfig(async_scheduling=True, **{k: v for k, v in PRESSURE.items() if k != "dtype"})
        core = EngineCore(config, RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=120))
        assert core.runs_ahead
        for i, prompt, params in single:
            core.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i, _, _ in single}
        most_in_flight = 0
        while core.has_work:
            for delta in core.step():
                tokens[delta.request_id] += delta.new_token_ids
            most_in_flight = max(most_in_flight, core.num_plans_in_flight)
        assert [tokens[str(i)] for i, _, _ in single] == [expected[i][0][0] for i, _, _ in single]
        assert most_in_flight == 1  # after each step, the plan ahead of it is still running
    finally:
        worker.kill()
