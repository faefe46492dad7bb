"""ClusterEngineClient: the gateway's EngineClient in cluster mode.

generate() places the request on a scheduler replica and streams its deltas back
(streams.py), resubmitting it elsewhere when its replica dies (migration.py). The
replicas, their health and their summed Stats are the replica set's (replica_set.py);
which one takes a request is placement's (placement.py: by --routing-policy, by default
where the prompt's prefix is cached, from the replicas' KV events, balanced with load).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from gateway.cluster.disaggregation import DEFAULT_PD_MIN_PREFILL_TOKENS, Disaggregation, decodes, prefills
from gateway.cluster.gateway_id import new_gateway_id
from gateway.cluster.lora_calls import each_replica
from gateway.cluster.migration import DEFAULT_MIGRATION_LIMIT, migrating
from gateway.cluster.placement import Placement
from gateway.cluster.replica import Replica
from gateway.cluster.replica_set import ReplicaSet
from gateway.cluster.streams import RequestStreams
from services.engine_client import EngineUnavailable
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import EngineInfo, EngineStats, TokenDelta
from services.registry import DEFAULT_TTL_S, Member
from services.sampling_params import SamplingParams
from services.scheduler_messages import RemoveLoraRequest

# A /metrics scrape waits this long at most for the replicas' Stats; one that answers
# later counts with its last answer.
SCRAPE_STATS_TIMEOUT_S = 1.0


class ClusterEngineClient:
    def __init__(
        self,
        redis_url: str,
        nats_url: str,
        gateway_id: str | None = None,
        gateway_name: str | None = None,
        poll_interval_s: float = 0.5,
        submit_timeout_s: float = 60.0,
        lease_ttl_s: float = DEFAULT_TTL_S,
        routing_policy: str = "prefix",
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        migration_wait_s: float = 0.0,
        pd_min_prefill_tokens: int = DEFAULT_PD_MIN_PREFILL_TOKENS,
        pd_max_prefill_queue: int | None = None,
        serves: Callable[[Member], bool] | None = None,
    ) -> None:
        """`pd_min_prefill_tokens`: with prefill replicas in the fleet, a prompt with more
        tokens than this uncached where it decodes is prefilled on one of them
        (docs/disaggregation.md), unless every prefill replica has `pd_max_prefill_queue`
        requests waiting or more. `serves`: the leases of the one model this client routes
        to, for a gateway fronting several (gateway/cluster/served_models.py); None: all."""
        self.gateway_id = gateway_id or new_gateway_id(gateway_name)
        self._nats_url = nats_url
        self._lease_ttl_s = lease_ttl_s
        self._migration_limit = migration_limit
        self._migration_wait_s = migration_wait_s
        self._replicas = ReplicaSet(redis_url, poll_interval_s, lease_ttl_s, serves)
        self._placement = Placement(self._replicas, routing_policy, submit_timeout_s)
        self._streams = RequestStreams(self.gateway_id, self._replicas, self._placement, submit_timeout_s,
                                       Disaggregation(pd_min_prefill_tokens, max_prefill_queue=pd_max_prefill_queue))

    def start(self) -> None:
        if self._replicas.started:
            raise RuntimeError("the client was already started")
        self._streams.start(self._nats_url, self._lease_ttl_s)
        self._placement.start(self._nats_url)
        self._replicas.start(self._streams.fail, self._placement.kv_index)

    def shutdown(self) -> None:
        if not self._replicas.running:
            return
        self._replicas.stop()
        self._streams.close()
        self._placement.close()
        self._replicas.close()

    def is_ready(self) -> bool:
        return self._replicas.running and self._replicas.ready and self._streams.connected

    def stats(self) -> EngineStats:
        return self._replicas.stats

    async def refresh_stats(self) -> None:
        await self._replicas.refresh_stats(SCRAPE_STATS_TIMEOUT_S)

    def engine_info(self) -> EngineInfo | None:
        return self._replicas.info

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        kv_transfer_params: KvTransferParams | None = None, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """`kv_transfer_params`: vLLM's, as its disaggregation proxy sends them (docs/disaggregation.md)."""
        if not self._replicas.running:
            raise EngineUnavailable("the cluster client is not running")

        def attempt(resumed: list[int], tried: set[Replica]) -> AsyncIterator[TokenDelta]:
            # A migrated request computes its prompt where it resumes: a handoff is not repeated.
            handoff = kv_transfer_params if not resumed else None
            # vLLM's proxy asks a prefill first (do_remote_decode): a prefill replica takes it.
            pool = prefills if handoff is not None and handoff.do_remote_decode else decodes
            return self._streams.place(request_id, prompt_token_ids, params, cache_salt, resumed, tried, handoff, pool,
                                       lora_request)

        async with aclosing(migrating(attempt, request_id, params, self._migration_limit,
                                            self._migration_wait_s)) as deltas:
            async for delta in deltas:
                yield delta

    async def abort(self, request_id: str) -> None:
        """A request id aborts the request and its children; a child id, that child only."""
        await self._streams.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Every routable replica's worker reads and checks the adapter; a replica that joins
        later reads it from its path when a request first names it."""
        await each_replica(self._replicas.routable(), "AddLora", lora_request)
        await asyncio.to_thread(self._replicas.share_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        await asyncio.to_thread(self._replicas.unshare_lora, lora_int_id)  # first: no gateway serves it any more
        await each_replica(self._replicas.routable(), "RemoveLora", RemoveLoraRequest(lora_int_id))
        return True

    def lora_requests(self) -> dict[str, LoRARequest]:
        """Every adapter the cluster's gateways serve, by name (the registry's, as of the last poll)."""
        return self._replicas.loras
