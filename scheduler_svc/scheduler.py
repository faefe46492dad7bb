"""Iteration-level scheduling over a paged KV pool.

Each step gives every scheduled request a token count: a decode is one token, a
prompt (or a chunk of it) is many. There are no prefill and decode phases. Running
requests go first, oldest first, so streams keep flowing; waiting requests fill the
remaining token budget. When blocks run out the newest running request is preempted
and later recomputed from its tokens.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import FinishReason, Request, RequestStatus
from services.messages import CachedRequestData, NewRequestData, StepPlan, StepResult, TokenDelta
from services.sampling_params import InvalidParameter


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_pool = BlockPool(config.num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._step_ids = itertools.count()
        # Ended or preempted since the last plan; the next plan tells the worker.
        self._dropped_ids: list[str] = []

    # -- admission -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._validate(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        prompt_len = len(request.prompt_token_ids)
        limit = self.config.max_model_len
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if prompt_len == 0:
            raise InvalidParameter("prompt", "the prompt is empty")
        if prompt_len > limit:
            raise InvalidParameter(
                "prompt",
                f"the prompt is {prompt_len} tokens long, more than the maximum model length of {limit}",
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidParameter(
                "prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})"
            )

    def abort_request(self, request_id: str) -> TokenDelta | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return TokenDelta(request_id, [], FinishReason.ABORT.value)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        """Requests to run, or ended ones the worker has not been told to drop yet."""
        return bool(self.requests or self._dropped_ids)

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(step_id=next(self._step_ids))
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        budget = self._schedule_running(plan, budget)
        # After a preemption memory is short: admitting new work would only thrash.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(plan, budget)
        plan.finished_request_ids, self._dropped_ids = self._dropped_ids, []
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self._allocate_slots(request, num_tokens)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    return budget
                new_blocks = self._allocate_slots(request, num_tokens)
            self._add_to_plan(plan, request, num_tokens, new_blocks)
            budget -= num_tokens
            index += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self._allocate_slots(request, num_tokens)
            if new_blocks is None:
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_plan(plan, request, num_tokens, new_blocks)
            budget -= num_tokens

    def _allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` more tokens of KV, or None when the pool is short."""
        needed = -(-(request.num_computed_tokens + num_tokens) // self.config.block_size)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return []
        if missing > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.allocate(missing)
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _add_to_plan(self, plan: StepPlan, request: Request, num_tokens: int, new_blocks: list[int]) -> None:
        plan.num_scheduled_tokens[request.request_id] = num_tokens
        if request.known_to_worker:
            plan.cached_requests.append(
                CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
            )
            return
        request.known_to_worker = True
        plan.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=request.all_token_ids,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params,
            )
        )

    def _preempt(self, request: Request) -> None:
        """Recompute-mode preemption: drop the KV, requeue at the front."""
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._forget_on_worker(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _forget_on_worker(self, request: Request) -> None:
        if request.known_to_worker:
            request.known_to_worker = False
            self._dropped_ids.append(request.request_id)

    # -- results ---------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenDelta]:
        deltas = []
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_tokens
            sampled = result.sampled_token_ids.get(request_id)
            if not sampled:
                continue  # a prompt chunk that did not reach the end of the prompt
            accepted = []
            for token in sampled:
                request.output_token_ids.append(token)
                accepted.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    self.running.remove(request)
                    self._finish(request, reason)
                    break
            logprobs = result.logprobs.get(request_id)
            deltas.append(
                TokenDelta(
                    request_id,
                    accepted,
                    _value(request.finish_reason),
                    request.stop_reason,
                    logprobs[: len(accepted)] if logprobs is not None else None,
                )
            )
        return deltas

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                request.stop_reason = token
                return FinishReason.STOP
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._forget_on_worker(request)
        del self.requests[request.request_id]


def _value(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value
