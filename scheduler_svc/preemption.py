"""Preemption, when the device pool runs out of blocks: a preempted request's KV is
dropped and recomputed later, or (swap mode) copied to the host pool and back when it
resumes. Owns the host pool and the preemption counts EngineStats reports."""
from __future__ import annotations

from collections import deque

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.scheduler_config import SchedulerConfig
from scheduler_svc.worker_drops import WorkerDrops
from services.messages import StepPlan


class Preemption:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, drops: WorkerDrops,
                 waiting: deque[Request]) -> None:
        self.block_size = config.block_size
        self.block_pool = block_pool
        self.host_pool = BlockPool(config.num_host_blocks) if config.preemption_mode == "swap" else None
        self.drops = drops
        self.waiting = waiting  # the scheduler's: a preempted request goes back to its front
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # the part of num_preemptions that swapped rather than dropped KV

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's device blocks and requeue it at the front: its KV goes to
        the host pool in swap mode (when it fits), otherwise it is recomputed later."""
        num_blocks = len(request.block_ids)
        # A pooling request's partial vector lives in the worker's state, which a swap drops: recomputed.
        if (self.host_pool is not None and num_blocks <= self.host_pool.num_free_blocks
                and request.sampling_params.pooling is None):
            request.host_block_ids = self.host_pool.allocate(num_blocks)
            plan.blocks_to_swap_out.extend(zip(request.block_ids, request.host_block_ids))
            request.status = RequestStatus.SWAPPED
            self.num_swapped_preemptions += 1
        else:
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        self.drops.forget(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def swap_in(self, request: Request, plan: StepPlan, budget: int) -> tuple[int, list[int]] | None:
        """Resume a swapped request: fresh device blocks, its KV copied back into them."""
        num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
        needed = -(-(request.num_computed_tokens + num_tokens) // self.block_size)
        if needed > self.block_pool.num_free_blocks:
            return None
        request.block_ids = self.block_pool.allocate(needed)
        # The host pool may be reused once the worker has copied these, which it
        # does first thing in this very step.
        plan.blocks_to_swap_in.extend(zip(request.host_block_ids, request.block_ids))
        self.release_host_blocks(request)
        return num_tokens, request.block_ids

    def release_host_blocks(self, request: Request) -> None:
        """Free a swapped-out request's host blocks: it resumed, or ended."""
        self.host_pool.free(request.host_block_ids)
        request.host_block_ids = []
