"""The scheduler's side of a prefill/decode KV handoff (docs/disaggregation.md).

A producer (`kv_role` kv_producer or kv_both) runs a request that carries
`do_remote_decode` like any other (the gateway asks one token of it), but when it ends
its blocks are held rather than freed, and its final delta carries vLLM's
`kv_transfer_params` saying where they wait: this replica's worker, their block ids.
They go once a consumer's worker has fetched them (the worker says so in a
StepResult), or after `abort_timeout_s` if none ever does.

A request that also carries kvfleet's `remote_streamed` (the gateway's own splits) has
its blocks moved as they are computed: after each of its steps, the full blocks its
prefill has finished so far are held for the worker to serve (the hold grows with each
chunk), and after its first step it announces where they wait in a delta of no tokens,
on which the gateway submits the decode request at once; the consumer then fetches the
blocks by their place in the prompt while the next chunks compute. A consumer whose
fetch ends before the prefill does leaves the request's blocks to be freed with it.

A consumer (kv_consumer or kv_both) admits a request that carries `do_remote_prefill`
as a KV load (the LOADING_KV state the offload tiers use): its device-pool hits stay,
blocks are taken for the producer's full blocks after them, and the plan's KvLoad names
the producer's worker and blocks, which this replica's worker fetches. Only full blocks
move, and only those the consumer lacks; the rest is computed here, at most the last
partial block. A fetch that fails or stops midway loads the blocks that arrived whole,
and the rest are recomputed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.request import Request
from services.histogram_counts import BucketCounter
from services.kv_transfer_config import KvTransferConfig
from services.kv_transfer_messages import KvTransferParams, RemoteBlocks
from services.messages import KvLoad, KvTransferStats
from services.metric_buckets import KV_LOAD_SECONDS, KV_TRANSFER_BYTES

# vLLM's vllm:prompt_tokens_by_source labels.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def count_prompt_tokens(counts: dict[str, int], request: Request) -> None:
    """Counts a request's prompt tokens by where their KV came from, at its first token:
    computed here, this replica's prefix cache, or loaded (a producer, the offload tiers)."""
    cached = request.num_cached_tokens or 0
    external = min(request.num_external_tokens, cached)
    counts["external_kv_transfer"] += external
    counts["local_cache_hit"] += cached - external
    counts["local_compute"] += len(request.prompt_token_ids) - cached


@dataclass
class Held:
    block_ids: list[int]
    deadline: float  # time.monotonic() after which no consumer is waited for


class KvHandoff:
    def __init__(self, config: KvTransferConfig, engine_id: str, worker_address: str, block_bytes: int) -> None:
        """`worker_address`: host:port of this replica's worker as consumers dial it
        (`kv_ip`, when set, replaces the host); `block_bytes`: one block's KV, all layers."""
        self.config = config
        self.engine_id = engine_id
        self.block_bytes = block_bytes
        host, _, port = worker_address.rpartition(":")
        self.host, self.port = config.kv_ip or host, int(port)
        self.held: dict[str, Held] = {}
        # remote_streamed requests whose prefill runs, their hold growing: how many blocks it has
        self.publishing: dict[str, tuple[Request, int]] = {}
        self._new_holds: dict[str, list[int]] = {}
        self._ended: list[str] = []
        self.bytes_per_request = BucketCounter(KV_TRANSFER_BYTES)
        self.transfer_seconds = BucketCounter(KV_LOAD_SECONDS)
        self.expired_requests = 0
        self.failed_blocks = 0

    # -- producer ------------------------------------------------------------------------

    def wants_hold(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return self.config.is_producer and params is not None and params.do_remote_decode

    def hold(self, request: Request) -> KvTransferParams:
        """Keeps the ended request's blocks for a consumer; returns what tells it where."""
        self.publishing.pop(request.request_id, None)  # its hold goes on, whole now
        self.held[request.request_id] = Held(request.block_ids, time.monotonic() + self.config.abort_timeout_s)
        self._new_holds[request.request_id] = list(request.block_ids)
        return KvTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                remote_block_ids=list(request.block_ids), remote_host=self.host,
                                remote_port=self.port, remote_request_id=request.request_id)

    def publish(self, request: Request, block_size: int) -> KvTransferParams | None:
        """After a step of the request: a remote_streamed request's hold grows by the full
        blocks now computed (the step is over: nothing writes them again). Returns what
        tells the consumer where they wait the first time, None otherwise."""
        params = request.kv_transfer_params
        if not (self.wants_hold(request) and params.remote_streamed):
            return None
        _, published = self.publishing.get(request.request_id, (request, -1))
        num_full = min(request.num_computed_tokens, len(request.prompt_token_ids)) // block_size
        if num_full > published:  # the first time too, with none: the worker knows it is coming
            self.publishing[request.request_id] = (request, num_full)
            self._new_holds[request.request_id] = request.block_ids[:num_full]
        if published >= 0:
            return None
        return KvTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=self.host,
                                remote_port=self.port, remote_request_id=request.request_id, remote_streamed=True)

    def forget(self, request: Request) -> None:
        """The request's blocks leave it (it was preempted, aborted, or ended without a
        hold): the worker serves them no more, in the plan before anything can reuse them.
        The fetch stops there and the consumer recomputes the rest; a preempted request
        publishes no more."""
        if request.request_id in self.publishing:
            del self.publishing[request.request_id]
            self._ended.append(request.request_id)
            self._new_holds.pop(request.request_id, None)
            request.kv_transfer_params = None

    def release(self, request_ids: list[str]) -> list[int]:
        """The blocks of those a consumer fetched, to free; the next plan tells the worker
        to serve them no more, before anything can write into them."""
        blocks = []
        for request_id in request_ids:
            if request_id in self.publishing:
                # Fetched (or given up) before its prefill ended: its blocks stay its own,
                # freed with it, and no hold follows.
                self.forget(self.publishing[request_id][0])
                continue
            if (held := self.held.pop(request_id, None)) is not None:
                blocks += held.block_ids
                self._ended.append(request_id)
                self._new_holds.pop(request_id, None)
        return blocks

    def take_plan_changes(self) -> tuple[dict[str, list[int]], list[str]]:
        """The holds begun and ended since the last plan, for the next one."""
        changes = self._new_holds, self._ended
        self._new_holds, self._ended = {}, []
        return changes

    def expire(self) -> list[int]:
        """The blocks of holds past their deadline, to free (no consumer came)."""
        now = time.monotonic()
        expired = [request_id for request_id, held in self.held.items() if held.deadline <= now]
        self.expired_requests += len(expired)
        return self.release(expired)

    # -- consumer ------------------------------------------------------------------------

    def start_fetch(self, request: Request, hits: list[int], pool: BlockPool, connector: KvConnector,
                    block_size: int) -> KvLoad | None:
        """Takes the request's blocks (its device-pool `hits`, then one for each full block
        of the producer's it lacks) and the load that fills them; None when it carries no
        fetchable parameters or the pool lacks the blocks (it waits, as an admission would).
        A request whose hits cover the producer's blocks still fetches none of them, which
        tells the producer to let them go."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or params is None or not params.fetchable:
            return None
        # Full blocks only, and never the prompt's last token: its logits start the decode.
        num_full = (request.num_tokens - 1) // block_size
        if params.remote_streamed:  # the producer's prefill publishes them by their place in the prompt
            sources = list(range(len(hits), num_full))
        else:
            sources = params.remote_block_ids[len(hits):min(len(params.remote_block_ids), num_full)]
        if len(sources) > pool.num_free_blocks - pool.num_unheld(hits):
            return None
        request.kv_transfer_params = None  # fetched once: a preempted request recomputes (or hits its cache)
        pool.share(hits)
        request.block_ids = hits + pool.allocate(len(sources))
        request.num_computed_tokens = len(hits) * block_size
        request.num_cached_blocks = len(hits)
        remote = RemoteBlocks(f"{params.remote_host}:{params.remote_port}", params.remote_request_id or "",
                              params.remote_streamed, self.config.reads_over_nixl)
        return connector.start_load(request, len(hits), sources, remote)

    def awaits_blocks(self, request: Request) -> bool:
        """A request whose fetch could not start (start_fetch gave None though it can fetch):
        the pool lacks its blocks. It waits for them rather than compute its prompt here,
        which would stall the decodes: blocks come free as requests end."""
        params = request.kv_transfer_params
        return self.config.is_consumer and params is not None and params.fetchable

    def loaded(self, num_blocks: int, num_wanted: int, seconds: float) -> None:
        """A fetch ended: `num_blocks` of the `num_wanted` arrived whole, after `seconds`."""
        self.bytes_per_request.observe(num_blocks * self.block_bytes)
        self.transfer_seconds.observe(seconds)
        self.failed_blocks += num_wanted - num_blocks

    def stats(self) -> KvTransferStats:
        # Held: the blocks of ended prefills, and those a running prefill has published so far.
        held = sum(len(h.block_ids) for h in self.held.values()) + sum(n for _, n in self.publishing.values())
        return KvTransferStats(self.bytes_per_request.snapshot(), self.transfer_seconds.snapshot(),
                               self.expired_requests, self.failed_blocks, held)
