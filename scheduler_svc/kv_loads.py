"""KV loads into the device pool: a waiting request whose prefix continues past the
device pool's hits in the offload tiers (scheduler_svc/kv_connector.py), or whose KV a
prefill replica holds for it (scheduler_svc/kv_handoff.py), takes its blocks and waits
in LOADING_KV while the worker loads them; once the worker says the load ended, it runs
from the blocks that arrived, computing the rest."""
from __future__ import annotations

import time

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.kv_cache_manager import KvCacheManager
from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.kv_handoff import KvHandoff
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.scheduler_config import SchedulerConfig
from services.messages import StepPlan


class KvLoads:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, connector: KvConnector,
                 handoff: KvHandoff | None, kv_cache_manager: KvCacheManager, running: list[Request]) -> None:
        self.config = config
        self.block_pool = block_pool
        self.connector = connector
        self.handoff = handoff
        self.kv_cache_manager = kv_cache_manager
        self.running = running  # the scheduler's: a loaded request runs from there

    def start(self, request: Request, hits: list[int], plan: StepPlan) -> bool:
        """Whether the request's prefix continues, past the device pool's `hits`, in the
        offload tiers or a producer's hold: then its blocks are taken and the worker loads
        them meanwhile."""
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return False
        if self.handoff is not None and request.kv_transfer_params is not None:
            self.kv_cache_manager.hash_blocks(request)  # the fetched blocks are indexed by their hashes
            load = self.handoff.start_fetch(request, hits, self.block_pool, self.connector, self.config.block_size)
            if load is not None:
                if request.scheduled_time is None:
                    request.scheduled_time = time.monotonic()
                request.status = RequestStatus.LOADING_KV
                plan.kv_loads.append(load)
                return True
        max_hit_blocks = self.kv_cache_manager.max_hit_blocks(request)
        if self.kv_cache_manager.needs_every_position(request) or len(hits) >= max_hit_blocks:
            return False
        sources = self.connector.find(request.block_hashes, len(hits), max_hit_blocks)
        if not sources or not self.kv_cache_manager.take_blocks(request, hits, len(sources)):
            return False
        self.connector.queries += (max_hit_blocks - len(hits)) * self.config.block_size
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        request.status = RequestStatus.LOADING_KV
        plan.kv_loads.append(self.connector.start_load(request, len(hits), sources))
        return True

    def finished(self, request_id: str, num_loaded: int) -> None:
        """The worker filled the first `num_loaded` blocks asked of it; the rest are computed."""
        loading = self.connector.loading.pop(request_id, None)
        if loading is None:
            return
        request = loading.request
        if request.status is not RequestStatus.LOADING_KV:  # aborted meanwhile
            self.block_pool.free(request.block_ids)
            request.block_ids = []
            return
        size = self.config.block_size
        self.connector.hits += num_loaded * size
        request.num_external_tokens += num_loaded * size
        if loading.remote:
            request.kv_transfer_s = time.monotonic() - loading.started
            self.handoff.loaded(num_loaded, loading.num_blocks, request.kv_transfer_s)
        num_blocks = loading.num_device_hits + num_loaded
        self.kv_cache_manager.index(request, num_blocks, save=False)  # they came from the tiers
        request.num_computed_tokens = num_blocks * size
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens
        self.kv_cache_manager.count(request, loading.num_device_hits * size)
        # It runs from here: the next plan computes the rest, into the blocks it holds and
        # more (a running request, so it can be preempted like any other).
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def forget(self) -> None:
        """The worker is lost: no load will finish, so their blocks are free now."""
        for loading in self.connector.forget():
            self.block_pool.free(loading.request.block_ids)
            loading.request.block_ids = []
