"""Applying a worker step's results to the scheduler's requests (vLLM's
`Scheduler.update_from_output`): the tokens each sampled (drafts accepted or rejected),
stop checks, pooled vectors, prompt logprobs, the blocks its step filled cached and
saved, parallel samples forked from their leader once its prompt is computed, ended
requests' blocks freed (or held for a decode replica), and the deltas that stream out."""
from __future__ import annotations

import time
from collections import deque

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.kv_cache_manager import KvCacheManager
from scheduler_svc.kv_handoff import PROMPT_TOKEN_SOURCES, KvHandoff, count_prompt_tokens
from scheduler_svc.preemption import Preemption
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.request_checks import stop_reason
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.spec_decode_counts import SpecDecodingCounts
from scheduler_svc.speculation import Speculation
from scheduler_svc.worker_drops import WorkerDrops
from services.histogram_counts import BucketCounter
from services.messages import FirstTokenTimes, StepPlan, StepResult, TokenDelta
from services.metric_buckets import ITERATION_TOKENS


class OutputProcessor:
    def __init__(self, config: SchedulerConfig, requests: dict[str, Request], waiting: deque[Request],
                 running: list[Request], block_pool: BlockPool, handoff: KvHandoff | None,
                 kv_cache_manager: KvCacheManager, drops: WorkerDrops, preemption: Preemption,
                 speculation: Speculation | None) -> None:
        """The scheduler's queues and collaborators: a step's results move requests between them."""
        self.config = config
        self.requests = requests
        self.waiting = waiting
        self.running = running
        self.block_pool = block_pool
        self.handoff = handoff
        self.kv_cache_manager = kv_cache_manager
        self.drops = drops
        self.preemption = preemption
        self.speculation = speculation
        # What EngineStats reports of the steps' outputs.
        self.iteration_tokens = BucketCounter(ITERATION_TOKENS)
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        self.spec_decoding = SpecDecodingCounts(config.speculative.num_speculative_tokens
                                                if config.speculative is not None else 0)

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenDelta]:
        """Each scheduled request's part of the step's results; the deltas to stream."""
        deltas = []
        now = time.monotonic()
        step_tokens = 0
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_in_flight_tokens -= num_tokens
            sampled = result.sampled_token_ids.get(request_id)
            if drafts := plan.scheduled_spec_decode_tokens.get(request_id):
                # Only the last token and the accepted drafts are computed: the rejected
                # drafts' positions are written again next step, into the blocks it keeps.
                num_accepted = len(sampled) - 1 if sampled else 0
                self.spec_decoding.observe(len(drafts), num_accepted)
                num_tokens -= len(drafts) - num_accepted
            if self.speculation is not None and sampled:
                self.speculation.gate.observe(request_id, len(drafts or ()), sampled)
            request.num_computed_tokens += num_tokens
            if self.handoff is not None and (announced := self.handoff.publish(request, self.config.block_size)):
                # Its blocks move as its prefill computes them: where they wait, before its token.
                deltas.append(TokenDelta(request_id, [], kv_transfer_params=announced))
            if self.config.enable_prefix_caching:
                # Before its tokens are accepted: a request that ends in this step (one
                # token asked for) frees its blocks, which must go back cached, as vLLM's do.
                # (Accepted drafts are not its tokens yet: their blocks are cached below.)
                self.kv_cache_manager.cache_computed(request)
            if request_id in result.prompt_logprobs:
                request.prompt_logprobs += result.prompt_logprobs[request_id]
            if (pooled := result.pooled.get(request_id)) is not None:
                deltas.append(self._pooled(request, pooled, now))
                step_tokens += len(request.prompt_token_ids)
            if sampled:
                request.num_ahead_samples -= 1
                delta = self._accept(request, sampled, result.logprobs.get(request_id), now)
                request.draft_token_ids = result.draft_token_ids.get(request_id, [])
                deltas.append(delta)
                step_tokens += len(delta.new_token_ids)
                if delta.first_token_times is not None:
                    step_tokens += len(request.prompt_token_ids)
            if request.followers and request.num_computed_tokens >= len(request.prompt_token_ids):
                self._fork_followers(request)
            if drafts and self.config.enable_prefix_caching and not request.is_finished:
                self.kv_cache_manager.cache_computed(request)  # the blocks its accepted drafts filled
        if deltas:  # as vLLM, which records a step's stats only when it has outputs
            self.iteration_tokens.observe(step_tokens)
        return deltas

    def _fork_followers(self, leader: Request) -> None:
        """Start each follower from the leader's prompt KV: the full blocks of all but
        the last prompt token are shared; the partly filled one is copied, since both
        will write into it. Each follower then computes the last prompt token itself
        and samples its own first token. Without a free block for the copy, or past
        max_num_seqs, a follower is admitted like any request (its prefix still comes
        from the cache)."""
        fork_len = len(leader.prompt_token_ids) - 1
        num_shared, partial = divmod(fork_len, self.config.block_size)
        shared = leader.block_ids[:num_shared]
        for follower in leader.followers:
            # Each parallel sample is a sequence of its own: max_num_seqs counts it.
            if len(self.running) >= self.config.max_num_seqs or (partial and self.block_pool.num_free_blocks == 0):
                follower.status = RequestStatus.WAITING
                self.waiting.appendleft(follower)
                continue
            self.block_pool.share(shared)
            follower.block_ids = list(shared)
            if partial:
                [copy] = self.block_pool.allocate(1)
                self.drops.copies.append((leader.block_ids[num_shared], copy))
                follower.block_ids.append(copy)
            follower.num_computed_tokens = fork_len
            follower.num_cached_blocks = num_shared
            follower.num_cached_tokens = leader.num_cached_tokens
            follower.scheduled_time = time.monotonic()
            follower.status = RequestStatus.RUNNING
            self.running.append(follower)
        leader.followers = []

    def _accept(
        self, request: Request, sampled: list[int], logprobs: list[dict[int, float]] | None, now: float
    ) -> TokenDelta:
        accepted = []
        for token in sampled:
            request.output_token_ids.append(token)
            accepted.append(token)
            reason = stop_reason(request, token, self.config.max_model_len)
            if reason is not None:
                self.running.remove(request)
                self.finish(request, reason)
                break
        prompt_logprobs = first_token_times = None
        num_cached_tokens = 0
        if len(request.output_token_ids) == len(accepted):  # the first delta: the prompt is done
            num_cached_tokens = request.num_cached_tokens or 0
            count_prompt_tokens(self.prompt_tokens_by_source, request)
            if request.sampling_params.prompt_logprobs is not None:
                prompt_logprobs = request.prompt_logprobs
            first_token_times = FirstTokenTimes(request.scheduled_time - request.arrival_time,
                                                now - request.scheduled_time, request.kv_transfer_s)
        return TokenDelta(
            request.request_id,
            accepted,
            _value(request.finish_reason),
            request.stop_reason,
            logprobs[: len(accepted)] if logprobs is not None else None,
            prompt_logprobs,
            first_token_times,
            num_cached_tokens,
            kv_transfer_params=request.kv_transfer_params_out,
        )

    def _pooled(self, request: Request, pooled: list[float], now: float) -> TokenDelta:
        """A pooling request's prompt is computed: it ends with its vector, its blocks freed
        (into the prefix cache, when it keeps them)."""
        request.num_ahead_samples -= 1
        self.running.remove(request)
        self.finish(request, FinishReason.STOP)
        times = FirstTokenTimes(request.scheduled_time - request.arrival_time, now - request.scheduled_time)
        return TokenDelta(request.request_id, [], FinishReason.STOP.value, first_token_times=times,
                          num_cached_tokens=request.num_cached_tokens or 0, pooled=pooled)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request that holds no place in the queues any more: its blocks go (or wait
        for a decode replica), the worker and the proposer forget it."""
        self.release_followers(request)
        if reason is not FinishReason.ABORT and self.handoff is not None and self.handoff.wants_hold(request):
            request.kv_transfer_params_out = self.handoff.hold(request)  # its blocks wait for a consumer
        else:
            self.block_pool.free(request.block_ids)
        if request.host_block_ids:
            self.preemption.release_host_blocks(request)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.drops.forget(request)
        if self.speculation is not None:
            self.speculation.finish(request)
        del self.requests[request.request_id]

    def release_followers(self, request: Request) -> None:
        """A leader ends before its prompt is computed: its parallel samples queue on their own."""
        for follower in request.followers:  # never forked: they start on their own
            follower.status = RequestStatus.WAITING
            self.waiting.appendleft(follower)
        request.followers = []


def _value(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value
