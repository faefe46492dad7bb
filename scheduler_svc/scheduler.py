"""Iteration-level scheduling over a paged KV pool.

Each step gives every scheduled request a token count: a decode is one token, a
prompt (or a chunk of it) is many. There are no prefill and decode phases. Running
requests go first, oldest first, so streams keep flowing; waiting requests fill the
remaining token budget, starting from their longest cached prefix. When blocks run
out the newest running request is preempted: its KV is dropped and recomputed
later, or (swap mode) copied to a host pool and back.

The Scheduler owns the queues, the step's token budget and admission; it composes one
collaborator per concern, each sharing the queues and pools it needs: a request's
blocks and the prefix cache (kv_cache_manager.py), KV loads from the offload tiers or
a prefill replica (kv_loads.py), preemption and swap (preemption.py), drafts
(speculation.py), what a plan says of each request (plan_entries.py) and what else it
tells the worker (worker_drops.py), and applying a step's results (output_processor.py).
"""
from __future__ import annotations

import itertools
import time
from collections import deque

from scheduler_svc.block_pool import BlockPool, KvEventLog
from scheduler_svc.kv_cache_manager import KvCacheManager
from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.kv_handoff import KvHandoff
from scheduler_svc.kv_loads import KvLoads
from scheduler_svc.output_processor import OutputProcessor
from scheduler_svc.plan_entries import add_to_plan
from scheduler_svc.pooling_budget import PoolingBudget
from scheduler_svc.preemption import Preemption
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.request_checks import check_request
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.spec_decode_counts import SpecDecodingCounts
from scheduler_svc.spec_step_cost import SpecStepCosts
from scheduler_svc.speculation import Speculation
from scheduler_svc.versioned_queues import VersionedDeque, VersionedList
from scheduler_svc.worker_drops import WorkerDrops
from services.histogram_counts import BucketCounter
from services.invalid_parameter import InvalidParameter
from services.messages import StepPlan, StepResult, TokenDelta


class Scheduler:
    def __init__(self, config: SchedulerConfig, connector: KvConnector | None = None,
                 handoff: KvHandoff | None = None) -> None:
        """`connector`: the KV connector's scheduler side, when there are offload tiers or a
        prefill/decode handoff; `handoff`: this replica's side of that (docs/disaggregation.md)."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at "
                f"least max_model_len ({config.max_model_len}): raise --max-num-batched-tokens, lower "
                "--max-model-len, or enable chunked prefill"
            )
        self.config = config
        self.block_pool = BlockPool(config.num_blocks)
        self.connector = connector
        self.handoff = handoff
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = VersionedDeque()  # each counts its changes (versioned_queues.py)
        self.running: list[Request] = VersionedList()
        self.kv_cache_manager = KvCacheManager(config, self.block_pool, connector)
        self.kv_loads = KvLoads(config, self.block_pool, connector, handoff, self.kv_cache_manager,
                                self.running) if connector is not None else None
        self.speculation = Speculation(config) if config.speculative is not None else None
        self.pooling_budget = PoolingBudget()  # pooling tokens per step beside generation
        self._step_ids = itertools.count()
        self.drops = WorkerDrops(handoff)
        self.preemption = Preemption(config, self.block_pool, self.drops, self.waiting)
        self.outputs = OutputProcessor(config, self.requests, self.waiting, self.running, self.block_pool, handoff,
                                       self.kv_cache_manager, self.drops, self.preemption, self.speculation)

    # -- admission -----------------------------------------------------------------

    def add_request(self, request: Request, followers: list[Request] = ()) -> None:
        """Queue a request; `followers` are its parallel samples, forked from it once
        its prompt is computed, so the prompt's KV is computed and held once."""
        for candidate in (request, *followers):
            check_request(candidate, self.config, in_use=candidate.request_id in self.requests)
        if followers and request.sampling_params.pooling is not None:  # a follower would pool its last token only
            raise InvalidParameter("n", "a pooling request has one result")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        for follower in followers:
            follower.status = RequestStatus.AWAITING_FORK
            self.requests[follower.request_id] = follower
        request.followers = list(followers)

    def abort_request(self, request_id: str) -> TokenDelta | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.LOADING_KV:
            # The worker may still write into its blocks: they are freed when the load ends.
            self.outputs.release_followers(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.ABORT
            del self.requests[request_id]
            return TokenDelta(request_id, [], FinishReason.ABORT.value)
        elif request.status is RequestStatus.AWAITING_FORK:
            for leader in self.requests.values():
                if request in leader.followers:
                    leader.followers.remove(request)
        else:
            self.waiting.remove(request)
        self.outputs.finish(request, FinishReason.ABORT)
        return TokenDelta(request_id, [], FinishReason.ABORT.value)

    def attach_kv_events(self, events: KvEventLog) -> None:
        """Logs the prefix cache's changes (the device pool's and the offload tiers') for KV events."""
        self.block_pool.events = events
        if self.connector is not None:
            self.connector.attach_events(events)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        """Requests to run, ended ones the worker has not been told to drop yet, or loads
        into blocks that are freed once the worker says the load ended."""
        return bool(self.requests or self.drops.dropped_ids or (self.connector is not None and self.connector.loading)
                    or (self.handoff is not None and self.handoff.held))

    @property
    def has_drops(self) -> bool:
        """Ended requests or block copies that the next plan must tell the worker."""
        return bool(self.drops.dropped_ids or self.drops.copies)

    @property
    def num_schedulable(self) -> int:
        """Requests a plan now could take: with plans in flight (a pipeline), their
        requests wait for their results."""
        return len(self.waiting) + sum(not r.in_flight or self._runs_ahead(r) for r in self.running)

    @property
    def plans_ahead(self) -> bool:
        """Whether a step may be planned while the last one runs (async scheduling): not
        while a running request may speculate, whose drafts are proposed from its newest
        token (a request left out of the plan ahead would fall a step behind)."""
        return self.speculation is None or not any(self.speculation.may_draft(r) for r in self.running)

    def _runs_ahead(self, request: Request) -> bool:
        """Whether a request in flight may be planned into the next step too: only one step
        ahead, a decode of the token its step in flight samples, when it will not certainly
        have finished by then and its sampling does not read its last token."""
        params = request.sampling_params
        # A pooling request's step that reaches its prompt's end is its last: nothing follows it.
        return (self.config.async_scheduling and request.num_ahead_samples == 1 and params.pooling is None
                and request.num_in_flight_tokens + request.num_computed_tokens == request.num_tokens
                and (params.max_tokens is None or len(request.output_token_ids) + 1 < params.max_tokens)
                and request.num_tokens + 1 < self.config.max_model_len and not params.reads_output_tokens)

    # -- what EngineStats reads, kept by the collaborators ----------------------------

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    @property
    def num_swapped_preemptions(self) -> int:
        return self.preemption.num_swapped_preemptions

    @property
    def iteration_tokens(self) -> BucketCounter:
        return self.outputs.iteration_tokens

    @property
    def prompt_tokens_by_source(self) -> dict[str, int]:
        return self.outputs.prompt_tokens_by_source

    @property
    def spec_decoding(self) -> SpecDecodingCounts:
        return self.outputs.spec_decoding

    @property
    def spec_step_costs(self) -> SpecStepCosts | None:
        """What decode steps of each size cost on this machine, with speculative decoding."""
        return self.speculation.step_costs if self.speculation is not None else None

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.hits

    # -- one step --------------------------------------------------------------------

    def schedule(self, max_requests: int | None = None) -> StepPlan:
        """The next plan; `max_requests` caps the requests in it, so that a pipeline's
        plans in flight share the requests (each stage busy with its own micro-batch)."""
        plan = StepPlan(step_id=next(self._step_ids))
        if self.handoff is not None:  # held for consumers that never came
            self.block_pool.free(self.handoff.expire())
        budget = self.config.max_num_batched_tokens
        self.pooling_budget.start_step(self._caps_pooling())
        if self.speculation is not None:
            self.speculation.start_step(self.running)
        preemptions_before = self.num_preemptions
        budget = self._schedule_running(plan, budget, max_requests)
        # After a preemption memory is short: admitting new work would only thrash.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(plan, budget, max_requests)
        if self.speculation is not None:
            plan.draft_probes = self.speculation.probes(plan)
        self.drops.take(plan)
        if self.connector is not None:
            plan.kv_host_saves, plan.kv_file_saves = self.connector.take_saves()
        if self.handoff is not None:
            plan.kv_holds, plan.kv_hold_ends = self.handoff.take_plan_changes()
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, max_requests: int | None) -> int:
        allocate_slots = self.kv_cache_manager.allocate_slots
        index = 0
        while index < len(self.running) and budget > 0 and len(plan.num_scheduled_tokens) != max_requests:
            request = self.running[index]
            index += 1
            ahead = request.in_flight
            if ahead and not self._runs_ahead(request):
                continue
            computed = request.num_computed_tokens + request.num_in_flight_tokens
            num_tokens = min(request.num_tokens + request.num_ahead_samples - computed,
                             self.pooling_budget.room(request, budget))
            if num_tokens == 0:  # a pooling request, past this step's pooling tokens
                continue
            drafts = self.speculation.drafts(request, budget) if self.speculation is not None else []
            new_blocks = allocate_slots(request, computed + num_tokens + len(drafts)) if drafts else None
            if new_blocks is None:  # no drafts, or no free blocks for them (no preempting for drafts)
                drafts = []
                new_blocks = allocate_slots(request, computed + num_tokens)
            if new_blocks is None and ahead:
                continue  # no preempting for a step ahead: it runs once its result is back
            while new_blocks is None:
                # The newest request not in flight: one in flight is computing into its blocks.
                victim = next(r for r in reversed(self.running) if not r.in_flight)
                self.running.remove(victim)
                self.preemption.preempt(victim, plan)
                if victim is request:
                    return budget
                new_blocks = allocate_slots(request, computed + num_tokens)
            add_to_plan(plan, request, num_tokens, new_blocks, drafts)
            budget -= num_tokens + len(drafts)
            self.pooling_budget.take(request, num_tokens)
        return budget

    def _caps_pooling(self) -> bool:
        """Whether this step's pooling tokens are capped: while generation requests run or
        wait (one admitted in this very step streams from its end), and prompts can be
        chunked (scheduler_svc/pooling_budget.py)."""
        return (self.config.pooler is not None and self.config.enable_chunked_prefill
                and any(r.sampling_params.pooling is None for queue in (self.running, self.waiting) for r in queue))

    def record_step_time(self, plan: StepPlan, seconds: float) -> None:
        """How long the worker took for `plan`: what the drafts that pay are computed from."""
        if self.speculation is not None:
            self.speculation.step_costs.record(plan, seconds)

    def record_turn_time(self, plan: StepPlan, seconds: float) -> None:
        """How long the streams of `plan` waited for its outputs: what the pooling cap is computed from."""
        if self.config.pooler is None:
            return
        counts = plan.num_scheduled_tokens.values()
        pooling = any(r.sampling_params.pooling is not None for queue in (self.running, self.waiting) for r in queue)
        self.pooling_budget.record(sum(n for n in counts if n > 1), sum(1 for n in counts if n == 1), seconds, pooling)

    def _schedule_waiting(self, plan: StepPlan, budget: int, max_requests: int | None) -> None:
        skipped: list[Request] = []  # of adapters that have no slot this step: back in front, in order
        try:
            self._admit_waiting(plan, budget, max_requests, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, plan: StepPlan, budget: int, max_requests: int | None, skipped: list[Request]) -> None:
        loras = {r.lora_int_id for r in self.running} - {None}
        while (self.waiting and self._num_seqs < self.config.max_num_seqs and budget > 0
               and len(plan.num_scheduled_tokens) != max_requests):
            request = self.waiting[0]
            if request.lora_int_id is not None and request.lora_int_id not in loras:
                if len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                loras.add(request.lora_int_id)
            room = self.pooling_budget.room(request, budget)
            if room == 0:  # a pooling request, past this step's pooling tokens: generation may go on
                skipped.append(self.waiting.popleft())
                continue
            if request.status is RequestStatus.SWAPPED:
                admitted = self.preemption.swap_in(request, plan, room)
            else:
                hits = self.kv_cache_manager.get_computed_blocks(request)
                if self.kv_loads is not None and self.kv_loads.start(request, hits, plan):
                    self.waiting.popleft()
                    continue
                if self.handoff is not None and self.handoff.awaits_blocks(request):
                    return  # as vLLM's: its KV comes from a producer once the pool has room, never computed here
                admitted = self._admit(request, hits, room)
            if admitted is None:
                return
            num_tokens, new_blocks = admitted
            self.waiting.popleft()
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            add_to_plan(plan, request, num_tokens, new_blocks)
            budget -= num_tokens
            self.pooling_budget.take(request, num_tokens)

    @property
    def _num_seqs(self) -> int:
        """Sequences holding a place in max_num_seqs: the running, and those whose KV is loading."""
        return len(self.running) + (len(self.connector.loading) if self.connector is not None else 0)

    def _admit(self, request: Request, hits: list[int], budget: int) -> tuple[int, list[int]] | None:
        """Start (or restart) a request from its longest cached prefix (`hits`), if it fits."""
        remaining = request.num_tokens - len(hits) * self.config.block_size
        if not self.config.enable_chunked_prefill and remaining > budget:
            return None
        num_tokens = min(remaining, budget)
        if not self.kv_cache_manager.start_from_prefix(request, hits, num_tokens):
            return None
        if self.connector is not None and request.sampling_params.prompt_logprobs is None:
            max_hit_blocks = self.kv_cache_manager.max_hit_blocks(request)
            self.connector.queries += max(0, max_hit_blocks - len(hits)) * self.config.block_size
        return num_tokens, request.block_ids

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenDelta]:
        """Apply a worker step's results: the KV loads and sends that ended, then each
        request's outputs (scheduler_svc/output_processor.py)."""
        if self.connector is not None:
            self.connector.add_counts(result.kv_tiers)
            for request_id, num_loaded in result.kv_loads_done.items():
                self.kv_loads.finished(request_id, num_loaded)
        if self.handoff is not None and result.kv_sent_done:
            self.block_pool.free(self.handoff.release(result.kv_sent_done))
        return self.outputs.update(plan, result)

    def requests_in(self, plan: StepPlan) -> list[str]:
        """The live requests whose KV a plan computes or moves: if the plan fails, their KV is in doubt."""
        moved = {host for _, host in plan.blocks_to_swap_out} | {dst for _, dst in plan.blocks_to_copy}
        touched = [r for r in plan.num_scheduled_tokens if r in self.requests]
        for request in self.requests.values():
            if request.request_id not in plan.num_scheduled_tokens and moved.intersection(
                request.host_block_ids + request.block_ids
            ):
                touched.append(request.request_id)
        return touched

    def resend_drops(self, request_ids: list[str]) -> None:
        """A plan failed, so the worker may not have dropped these: the next plan says it again."""
        self.drops.dropped_ids.extend(request_ids)

    def forget_worker(self) -> list[str]:
        """The worker is lost (it died, restarted, or cannot be reached): every
        request's KV and every cached prefix may be gone. Aborts every request and
        returns their ids. Their drops still go out with the next plan: a worker that
        was only unreachable frees their state, a restarted one ignores them."""
        request_ids = list(self.requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        self.drops.copies.clear()
        if self.kv_loads is not None:
            self.kv_loads.forget()
        if self.handoff is not None:  # what they held is gone with the worker
            self.block_pool.free(self.handoff.release(list(self.handoff.held)))
        self.block_pool.reset_prefix_cache()
        return request_ids
