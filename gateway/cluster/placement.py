"""Which replica takes a request: among the routable ones, by the routing policy
(gateway/cluster/routing.py; with `prefix`, from where the prompt's prefix is cached:
gateway/cluster/kv_index.py), never one that is full; one that refused a request is
set aside until the next poll. It counts what it sends a replica until that poll."""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from gateway.cluster.kv_index import KvIndex
from gateway.cluster.replica import Replica
from gateway.cluster.replica_set import ReplicaSet
from gateway.cluster.routing import NOT_CACHED, Candidate, pick
from services.block_hash import extend_block_hashes, extra_keys_bytes
from services.engine_client import EngineOverloaded, EngineUnavailable
from services.lora_request import LoRARequest
from services.scheduler_messages import KvSnapshotRequest, KvSnapshotResponse

logger = logging.getLogger(__name__)


class Placement:
    def __init__(self, replicas: ReplicaSet, routing_policy: str, snapshot_timeout_s: float) -> None:
        self._replicas = replicas
        self._lock = replicas.lock
        self._placed = replicas.placed
        self._routing_policy = routing_policy
        self._snapshot_timeout_s = snapshot_timeout_s
        self._turn = 0  # requests routed, for round-robin
        self.kv_index: KvIndex | None = None

    def start(self, nats_url: str) -> None:
        if self._routing_policy == "prefix":
            self.kv_index = KvIndex(nats_url, self._kv_snapshot)

    def close(self) -> None:
        if self.kv_index is not None:
            self.kv_index.close()

    def claim(self, ids: list[str], prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
              avoid: set[Replica] = frozenset(), pool: Callable[[Replica], bool] | None = None,
              lora_request: LoRARequest | None = None) -> Replica:
        """A routable replica for the request, by the routing policy; one in `avoid` (where
        it ran before, and failed) only when no other can take it. `pool`: only replicas it
        admits (prefill/decode disaggregation, gateway/cluster/disaggregation.py), while any does.
        An adapter's request goes to the replicas already running it when one of them has
        room (no slot to fill, its prefix blocks there), else anywhere: any replica reads it
        from its path."""
        routable = self._replicas.routable()
        if pool is not None:
            routable = [replica for replica in routable if pool(replica)] or routable
        routable = [replica for replica in routable if replica not in avoid] or routable
        if not routable:
            raise EngineUnavailable("no scheduler is ready")
        routable = [replica for replica in routable if not replica.full]
        if not routable:
            raise EngineOverloaded("every scheduler's queue is full; try again shortly")
        lora_id = lora_request.lora_int_id if lora_request is not None else None
        if lora_request is not None:
            routable = [replica for replica in routable if replica.runs_lora(lora_request.lora_name)] or routable
        hashes: list[bytes] = []
        if self.kv_index is not None and prompt_token_ids and len(routable) > 1:  # one replica: no choice
            extend_block_hashes(hashes, prompt_token_ids, routable[0].block_size,
                                extra_keys_bytes(cache_salt, lora_id))
        cached = self.kv_index.cached_blocks(hashes) if hashes else {}
        with self._lock:
            candidates = [Candidate(r.load, cached.get(r.instance_id, NOT_CACHED)) for r in routable]
            replica = routable[pick(self._routing_policy, candidates, len(hashes), self._turn)]
            self._turn += 1
            replica.load += 1  # until the next poll counts it
            replica.waiting += 1
            self._placed.update(dict.fromkeys(ids, replica))
            return replica

    def reroute(self, refused: Replica, ids: list[str], code: grpc.StatusCode,
                pool: Callable[[Replica], bool] | None = None) -> Replica | None:
        """Sets a refusing replica aside until the next poll: a full one as full, so that
        what comes meanwhile is told to retry (429) rather than that nothing serves (503);
        a draining one as unroutable, for good if a successor refused in its place.
        Claims another, if any can take the request; where every routable one is full,
        raises EngineOverloaded, whatever this one's refusal was."""
        with self._lock:
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused.refused_as_full = True
            else:
                refused.routable = False
                refused.superseded |= code is grpc.StatusCode.FAILED_PRECONDITION
            refused.load -= 1
            refused.waiting -= 1
        try:
            return self.claim(ids, pool=pool)
        except EngineOverloaded:  # the request's answer: retry, not the last refusal's code
            raise
        except EngineUnavailable:
            return None

    def routable_in(self, pool: Callable[[Replica], bool]) -> list[Replica]:
        return [replica for replica in self._replicas.routable() if pool(replica)]

    def cached_tokens(self, replica: Replica, prompt_token_ids: list[int], cache_salt: str | None,
                      lora_request: LoRARequest | None = None) -> int:
        """The prompt's leading tokens the replica holds (device pool or offload tiers), as
        its KV events tell; 0 without a prefix index (another routing policy)."""
        if self.kv_index is None:
            return 0
        lora_id = lora_request.lora_int_id if lora_request is not None else None
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt_token_ids, replica.block_size, extra_keys_bytes(cache_salt, lora_id))
        cached = self.kv_index.cached_blocks(hashes).get(replica.instance_id, NOT_CACHED)
        return (cached.device + cached.tiers) * replica.block_size

    def release(self, ids: list[str]) -> None:
        """The request ended: it no longer loads its replica, though the next poll is up to
        half a second away (short requests in a row would otherwise pile up on the count
        and turn routing away from a replica that is idle). Its `waiting` stays until the
        poll: it may have left the queue long ago, and the poll knows."""
        with self._lock:
            for replica in {self._placed.pop(request_id, None) for request_id in ids} - {None}:
                replica.load = max(0, replica.load - 1)

    def _kv_snapshot(self, instance_id: str) -> KvSnapshotResponse | None:
        """For the KV index: the replica's cached hashes, or None once it is gone."""
        replica = self._replicas.replica_of(instance_id)
        if replica is None:
            return None
        try:
            return replica.stub.KvSnapshot(KvSnapshotRequest(instance_id), timeout=self._snapshot_timeout_s)
        except grpc.RpcError as exc:
            logger.warning("no KV snapshot from scheduler %s: %s", replica.member.address, exc.code().name)
            return None
