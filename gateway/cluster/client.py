"""ClusterEngineClient: the gateway's EngineClient in cluster mode.

generate() opens the request's stream on this gateway's NATS subscription, submits the
request to a scheduler replica over gRPC (batched with those that arrive together),
then yields the deltas NATS brings back. Replicas come from the Redis registry, read
by a poller thread that also fetches each replica's Stats and health: routing picks
among the ready replicas by --routing-policy (gateway/cluster/routing.py; by default where the
prompt's prefix is cached, from the replicas' KV events: gateway/cluster/kv_index.py, balanced
with load), and /metrics gets the sum.

A replica is declared dead only on evidence about it, and then its requests end here
with RequestLost (a 503), none waiting forever: its channel failing (a dead process, seen
within milliseconds), another process answering at its address (calls name the
lease's instance, and a successor refuses them), or its lease staying away longer than a lease TTL while Redis
answers (a hung scheduler, or one cut off from NATS for a TTL). A slow
answer is no evidence, nor is a lease missing right after Redis came back (an empty,
restarted Redis is refilled within a TTL), so a busy scheduler or a Redis restart
fails nothing. Nor does a NATS restart: messages missed meanwhile are replayed by their
scheduler (gateway/cluster/nats_subscriber.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cluster.gateway_id import new_gateway_id
from gateway.cluster.kv_index import KvIndex
from gateway.cluster.migration import DEFAULT_MIGRATION_LIMIT, migrating
from gateway.cluster.nats_subscriber import OutputSubscriber
from gateway.cluster.pass_batcher import PassBatcher
from gateway.cluster.routing import Candidate, pick
from gateway.cluster.submit_batcher import Scheduler, SubmitRefused, submit_batch
from services.block_hash import extend_block_hashes, extra_keys_bytes
from services.engine_client import EngineOverloaded, EngineUnavailable, RequestLost
from services.histogram_counts import HistogramCounts
from services.messages import CacheConfigInfo, EngineInfo, EngineStats, TokenDelta
from services.metric_buckets import ITERATION_TOKENS
from services.parallel_sampling import engine_request_ids, num_children
from services.pb.kvfleet.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.registry import DEFAULT_TTL_S, ClusterView, Member, Registry
from services.sampling_params import SamplingParams
from services.transport.channel import open_channel
from services.transport.convert import sampling_params_to_proto, stats_from_proto
from services.transport.futures import invalid_argument

logger = logging.getLogger(__name__)

# Its health says SERVING while the scheduler takes requests and its worker link is up.
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name

_NO_STATS = EngineStats(0, 0, 0.0, 0, 0, 0, 0, HistogramCounts.zero(ITERATION_TOKENS), None)
# Submit refusals after which another replica may take the request.
_TRY_ANOTHER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(eq=False)
class _Replica:
    member: Member
    channel: grpc.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    health: health_pb2_grpc.HealthStub
    # Its worker holds a lease, it answered the last Stats, and its health said SERVING
    # (a draining scheduler says NOT_SERVING while it finishes what it holds).
    routable: bool = False
    load: int = 0  # running + waiting at the last poll, plus what we sent it since
    waiting: int = 0  # waiting at the last poll, plus what we sent it since
    # Another process answers at its address: this one died, and never serves again
    # (its successor has a lease, so an entry, of its own).
    superseded: bool = False
    # It refused a request as full since the last poll (whatever its queue bound says).
    refused_as_full: bool = False

    @property
    def instance_id(self) -> str:
        """Named in Stats and SubmitBatch, so only this process answers them."""
        return self.member.metadata.get("instance_id", "")

    @property
    def block_size(self) -> int:
        return int(self.member.metadata.get("block_size", "16"))

    @property
    def full(self) -> bool:
        """Its queue is at its bound (--max-queued-requests), as far as we know."""
        bound = self.member.metadata.get("max_queued_requests")
        return self.refused_as_full or (bool(bound) and self.waiting >= int(bound))

    @classmethod
    def open(cls, member: Member, on_lost: Callable[[_Replica, str], None]) -> _Replica:
        channel = open_channel(member.address)
        replica = cls(member, channel, scheduler_pb2_grpc.SchedulerStub(channel), health_pb2_grpc.HealthStub(channel))

        def changed(state: grpc.ChannelConnectivity) -> None:
            # Its connection failed (a dead process refuses it): evidence about the
            # scheduler itself, seen within milliseconds rather than a lease later.
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                on_lost(replica, "is unreachable")

        channel.subscribe(changed, try_to_connect=True)
        return replica


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
    ) -> None:
        self.gateway_id = gateway_id or new_gateway_id(gateway_name)
        self._migration_limit = migration_limit
        self._routing_policy = routing_policy
        self._turn = 0  # requests routed, for round-robin
        self._kv_index: KvIndex | None = None
        self._lease_ttl_s = lease_ttl_s
        # Since when every registry read has worked; None while Redis is away. A lease
        # missing within a TTL of Redis coming back may just not be re-written yet (an
        # empty restarted Redis), so it counts only once this grace has passed.
        self._registry_since: float | None = None
        self._view = ClusterView([], [], [])
        self._redis_url = redis_url
        self._nats_url = nats_url
        self._poll_interval_s = poll_interval_s
        self._submit_timeout_s = submit_timeout_s
        self._lock = threading.Lock()  # guards _replicas, their load, and _placed
        self._replicas: dict[str, _Replica] = {}
        # Where each request of ours runs, by its id and by its children's ids.
        self._placed: dict[str, _Replica] = {}
        self._aborts: set[grpc.Future] = set()  # in flight; held so they are not collected
        self._batcher: PassBatcher[Scheduler, scheduler_pb2.SubmitRequest, None] = (
            PassBatcher(submit_batch(submit_timeout_s)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Replaced (never mutated) by the poller, so any thread may read them.
        self._ready = False
        self._stats = _NO_STATS
        self._info: EngineInfo | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the client was already started")
        self._registry = Registry(self._redis_url)
        # NATS away for a lease TTL fails our streams, as a scheduler's lease lapsing would.
        self._subscriber = OutputSubscriber(self._nats_url, self.gateway_id, self, grace_s=self._lease_ttl_s)
        if self._routing_policy == "prefix":
            self._kv_index = KvIndex(self._nats_url, self._kv_snapshot)
        self._refresh()  # so is_ready() is right from the start
        self._thread = threading.Thread(target=self._poll_forever, name="kvfleet-cluster-poller", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._subscriber.fail(None, lambda request_id: EngineUnavailable("the gateway is shutting down"))
        self._subscriber.close()
        if self._kv_index is not None:
            self._kv_index.close()
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            replica.channel.close()
        self._registry.close()

    def is_ready(self) -> bool:
        running = self._thread is not None and not self._stop.is_set()
        return running and self._ready and self._subscriber.connected

    def stats(self) -> EngineStats:
        return self._stats

    def engine_info(self) -> EngineInfo | None:
        return self._info

    # -- requests ----------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        if self._thread is None or self._stop.is_set():
            raise EngineUnavailable("the cluster client is not running")

        def attempt(resumed: list[int], tried: set[_Replica]) -> AsyncIterator[TokenDelta]:
            return self._place(request_id, prompt_token_ids, params, cache_salt, resumed, tried)

        async with aclosing(migrating(attempt, request_id, params, self._migration_limit)) as deltas:
            async for delta in deltas:
                yield delta

    async def _place(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None,
        resumed: list[int], tried: set[_Replica],
    ) -> AsyncIterator[TokenDelta]:
        """One placement of the request on a replica (gateway/cluster/migration.py); `resumed`:
        the tokens it generated on replicas that died."""
        # With n or best_of > 1 the scheduler runs child requests; each ends with one final delta.
        count = num_children(params)
        # Placed by its own id and its children's: an abort may name either.
        placed = list(dict.fromkeys([request_id, *engine_request_ids(request_id, count)]))
        stream = self._subscriber.open(request_id, count)  # before Submit: no delta can slip past
        submit: asyncio.Future[None] | None = None
        try:
            replica = self._claim(placed, prompt_token_ids, cache_salt, tried)
            if resumed:  # the prompt's logprobs went out with its first delta
                params = replace(params, prompt_logprobs=None)
            request = scheduler_pb2.SubmitRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, gateway_id=self.gateway_id,
                sampling_params=sampling_params_to_proto(params), cache_salt=cache_salt, output_token_ids=resumed,
            )
            while True:
                tried.add(replica)
                self._subscriber.expect(request_id, replica.instance_id)
                submit = self._batcher.submit((replica.stub, replica.instance_id), request)
                try:
                    await asyncio.shield(submit)
                    break
                except SubmitRefused as exc:
                    # A replica that began draining (or lost its worker) since the last poll
                    # refuses as UNAVAILABLE, and a successor on a dead one's address as
                    # FAILED_PRECONDITION: another one may take the request.
                    other = self._reroute(replica, placed, exc.code) if exc.code in _TRY_ANOTHER else None
                    if other is None:
                        raise _submit_error(exc, replica.member) from exc
                    replica = other
            async for delta in stream.deltas():
                yield delta
        finally:
            self._subscriber.discard(request_id)
            self._release(placed)
            # Whatever did not finish may still run there (the consumer left, the stream
            # broke, Submit was cancelled midway); aborting an unknown id is a no-op.
            if stream.unfinished and submit is not None:
                submit.add_done_callback(lambda done: done.exception() or self._send_abort(replica, request_id))

    async def abort(self, request_id: str) -> None:
        """A request id aborts the request and its children; a child id, that child only."""
        with self._lock:
            replica = self._placed.get(request_id)
        if replica is not None:
            self._send_abort(replica, request_id)

    def _claim(self, ids: list[str], prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
               avoid: set[_Replica] = frozenset()) -> _Replica:
        """A routable replica for the request, by the routing policy; one in `avoid` (where
        it ran before, and failed) only when no other can take it."""
        with self._lock:
            routable = [replica for replica in self._replicas.values() if replica.routable]
        routable = [replica for replica in routable if replica not in avoid] or routable
        if not routable:
            raise EngineUnavailable("no scheduler is ready")
        routable = [replica for replica in routable if not replica.full]
        if not routable:
            raise EngineOverloaded("every scheduler's queue is full; try again shortly")
        hashes: list[bytes] = []
        if self._kv_index is not None and prompt_token_ids and len(routable) > 1:  # one replica: no choice
            extend_block_hashes(hashes, prompt_token_ids, routable[0].block_size, extra_keys_bytes(cache_salt))
        cached = self._kv_index.cached_blocks(hashes) if hashes else {}
        with self._lock:
            candidates = [Candidate(r.load, cached.get(r.instance_id, 0)) for r in routable]
            replica = routable[pick(self._routing_policy, candidates, len(hashes), self._turn)]
            self._turn += 1
            replica.load += 1  # until the next poll counts it
            replica.waiting += 1
            self._placed.update(dict.fromkeys(ids, replica))
            return replica

    def _reroute(self, refused: _Replica, ids: list[str], code: grpc.StatusCode) -> _Replica | None:
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
            return self._claim(ids)
        except EngineOverloaded:  # the request's answer: retry, not the last refusal's code
            raise
        except EngineUnavailable:
            return None

    def _release(self, ids: list[str]) -> None:
        """The request ended: it no longer loads its replica, though the next poll is up to
        half a second away (short requests in a row would otherwise pile up on the count
        and turn routing away from a replica that is idle). Its `waiting` stays until the
        poll: it may have left the queue long ago, and the poll knows."""
        with self._lock:
            for replica in {self._placed.pop(request_id, None) for request_id in ids} - {None}:
                replica.load = max(0, replica.load - 1)

    def _send_abort(self, replica: _Replica, request_id: str) -> None:
        """Fire and forget, from any thread."""
        try:
            call = replica.stub.Abort.future(scheduler_pb2.AbortRequest(request_id=request_id), timeout=5.0)
        except ValueError:  # its channel is closed: the replica is gone, and the request with it
            return
        with self._lock:
            self._aborts.add(call)
        call.add_done_callback(self._aborted)

    def _aborted(self, call: grpc.Future) -> None:
        with self._lock:
            self._aborts.discard(call)
        if call.exception() is not None:
            logger.warning("abort failed: %s", call.exception())

    # -- replaying the token stream (the subscriber's ReplaySource) ----------------------

    def replay(self, instance_id: str, after_seq: int) -> list[scheduler_pb2.StepOutputs] | None:
        replica = self._replica_of(instance_id)
        if replica is None:  # retired: its requests were failed then
            return None
        request = scheduler_pb2.ReplayOutputsRequest(gateway_id=self.gateway_id, after_seq=after_seq,
                                                     scheduler_instance_id=instance_id)
        try:
            return list(replica.stub.ReplayOutputs(request, timeout=self._submit_timeout_s))
        except grpc.RpcError as exc:
            self._lost(replica, f"could not replay its token stream: {exc.code().name}: {exc.details()}")
            return None

    def _kv_snapshot(self, instance_id: str) -> scheduler_pb2.KvSnapshotResponse | None:
        """For the KV index: the replica's cached hashes, or None once it is gone."""
        replica = self._replica_of(instance_id)
        if replica is None:
            return None
        try:
            return replica.stub.KvSnapshot(scheduler_pb2.KvSnapshotRequest(scheduler_instance_id=instance_id),
                                           timeout=self._submit_timeout_s)
        except grpc.RpcError as exc:
            logger.warning("no KV snapshot from scheduler %s: %s", replica.member.address, exc.code().name)
            return None

    def _replica_of(self, instance_id: str) -> _Replica | None:
        """The listed replica that is this scheduler process, if it still is."""
        with self._lock:
            return next((r for r in self._replicas.values() if r.instance_id == instance_id), None)

    def instances(self) -> list[str]:
        with self._lock:
            return list({replica.instance_id for replica in self._placed.values()})

    # -- the poller thread -------------------------------------------------------------

    def _poll_forever(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self._refresh()
            except Exception:
                logger.exception("the cluster poller failed; trying again")

    def _refresh(self) -> None:
        try:
            view = ClusterView.read(self._registry)
        except redis.RedisError as exc:  # keep the last view: a Redis blip must not stop serving
            logger.warning("cannot read the registry at %s: %s", self._redis_url, exc)
            self._registry_since = None
            return
        now = time.monotonic()
        if self._registry_since is None:
            self._registry_since = now
        if now - self._registry_since < self._lease_ttl_s:  # grace: what was listed still is
            view = view.merged(self._view)
        self._view = view
        leased = {member.id: member for member in view.schedulers}
        if view.schedulers:
            self._info = _engine_info(view.schedulers)
        with self._lock:
            gone = [self._replicas.pop(i) for i in list(self._replicas) if i not in leased]
            orphans = [(replica, [i for i, r in self._placed.items() if r is replica]) for replica in gone]
            opened = [self._replicas.setdefault(member_id, _Replica.open(member, self._lost))
                      for member_id, member in leased.items() if member_id not in self._replicas]
            replicas = list(self._replicas.values())
        if self._kv_index is not None:
            for replica in opened:
                self._kv_index.sync(replica.instance_id)
            for replica in gone:
                self._kv_index.forget(replica.instance_id)
        for replica, request_ids in orphans:
            self._retire(replica, request_ids)
        # All at once, so one slow replica delays the poll by its timeout only.
        calls = [
            (
                replica,
                replica.stub.Stats.future(scheduler_pb2.StatsRequest(scheduler_instance_id=replica.instance_id),
                                          timeout=2.0),
                replica.health.Check.future(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0),
            )
            for replica in replicas
        ]
        stats = [self._poll(replica, call, health, view.scheduler_ready(replica.member)) for replica, call, health in calls]
        self._stats = _total([s for s in stats if s is not None])
        with self._lock:
            self._ready = view.gateway_ready and any(replica.routable for replica in replicas)

    def _retire(self, replica: _Replica, request_ids: list[str]) -> None:
        """A replica whose lease lapsed past the grace: its requests end here, and it is
        told to abort them (it may still be running, e.g. cut off from NATS) before its
        channel closes."""
        message = f"scheduler {replica.member.id} at {replica.member.address} is gone (its lease lapsed)"
        logger.warning("%s; failing its %d requests", message, len(request_ids))
        self._subscriber.fail(request_ids, lambda request_id: RequestLost(request_id, message))
        aborts = [replica.stub.Abort.future(scheduler_pb2.AbortRequest(request_id=i), timeout=5.0) for i in request_ids]
        pending = len(aborts)
        lock = threading.Lock()

        def aborted(_: grpc.Future) -> None:
            nonlocal pending
            with lock:
                pending -= 1
                last = pending == 0
            if last:
                replica.channel.close()

        for call in aborts:
            call.add_done_callback(aborted)
        if not aborts:
            replica.channel.close()

    def _lost(self, replica: _Replica, why: str, superseded: bool = False) -> None:
        """Any thread: the scheduler's process is gone (its connection failed, or another
        process answers at its address), or tokens it sent us cannot be replayed; its
        requests end now."""
        with self._lock:
            replica.routable = False
            replica.superseded |= superseded
            request_ids = [i for i, r in self._placed.items() if r is replica]
        if request_ids:
            message = f"scheduler {replica.member.id} at {replica.member.address} {why}"
            logger.warning("%s; failing its %d requests", message, len(request_ids))
            self._subscriber.fail(request_ids, lambda request_id: RequestLost(request_id, message))

    def _poll(self, replica: _Replica, call: grpc.Future, health: grpc.Future, worker_live: bool) -> EngineStats | None:
        try:
            stats = stats_from_proto(call.result())
            serving = health.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self._lost(replica, f"was replaced by another process ({exc.details()})", superseded=True)
                return None
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                # Busy, not gone (a dead one refuses the connection, and a hung one loses
                # its lease): it keeps what the last poll said rather than turning healthy
                # work away for a slow answer.
                logger.warning("scheduler %s answers its poll late; keeping it as it was", replica.member.address)
                return None
            logger.warning("scheduler %s does not answer: %s", replica.member.address, exc.code().name)
            with self._lock:
                replica.routable = False
            return None
        with self._lock:
            replica.load = stats.num_requests_running + stats.num_requests_waiting
            replica.waiting = stats.num_requests_waiting
            replica.refused_as_full = False
            replica.routable = worker_live and serving and not replica.superseded
        return stats


def _submit_error(exc: SubmitRefused, scheduler: Member) -> Exception:
    if exc.code is grpc.StatusCode.INVALID_ARGUMENT:
        return invalid_argument(exc.details)
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # the last replica that could take it is full too
        return EngineOverloaded(f"every scheduler's queue is full ({exc.details}); try again shortly")
    return EngineUnavailable(f"scheduler at {scheduler.address}: {exc.code.name}: {exc.details}")


def _engine_info(schedulers: list[Member]) -> EngineInfo:
    """What the schedulers know from their workers; replicas of one model agree on it."""
    eos = schedulers[0].metadata["eos_token_ids"]
    return EngineInfo(min(int(s.metadata["max_model_len"]) for s in schedulers),
                      tuple(int(t) for t in eos.split(",") if t))


def _total(stats: list[EngineStats]) -> EngineStats:
    """Every replica's stats as one: gauges, counters and histograms add up, usage is block-weighted."""
    blocks = sum(s.num_kv_blocks for s in stats)
    return EngineStats(
        num_requests_running=sum(s.num_requests_running for s in stats),
        num_requests_waiting=sum(s.num_requests_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / blocks if blocks else 0.0,
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_kv_blocks=blocks,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        iteration_tokens=sum((s.iteration_tokens for s in stats), HistogramCounts.zero(ITERATION_TOKENS)),
        cache_config=_fleet_cache_config([s.cache_config for s in stats if s.cache_config is not None]),
    )


def _fleet_cache_config(configs: list[CacheConfigInfo]) -> CacheConfigInfo | None:
    """The replicas' KV cache as one, as their other stats are: the blocks of all of them,
    with the settings they share (replicas of one model run one configuration)."""
    if not configs:
        return None
    return replace(configs[0], num_gpu_blocks=sum(c.num_gpu_blocks for c in configs),
                   num_cpu_blocks=sum(c.num_cpu_blocks for c in configs))
