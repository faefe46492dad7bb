"""ClusterEngineClient: the gateway's EngineClient in cluster mode.

generate() opens the request's queue on this gateway's NATS subscription, submits the
request to a scheduler replica over gRPC, then yields the deltas NATS brings back.
Replicas come from the Redis registry, read by a poller thread that also fetches each
replica's Stats: routing picks the least loaded ready replica, and /metrics gets the
sum. When a scheduler's lease lapses (it died, hung or lost NATS), the requests it
held end here with RequestFailed within that lease: none waits forever.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.nats_subscriber import OutputSubscriber
from services.engine_client import EngineUnavailable, RequestFailed
from services.messages import EngineInfo, EngineStats, TokenDelta
from services.parallel_sampling import engine_request_ids, num_children
from services.pb.kvfleet.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.registry import ClusterView, Member, Registry, new_member_id
from services.sampling_params import SamplingParams
from services.transport.channel import open_channel
from services.transport.convert import sampling_params_to_proto, stats_from_proto
from services.transport.futures import finished, invalid_argument

logger = logging.getLogger(__name__)

_NO_STATS = EngineStats(0, 0, 0.0, 0, 0, 0, 0)


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

    @classmethod
    def open(cls, member: Member) -> _Replica:
        channel = open_channel(member.address)
        return cls(member, channel, scheduler_pb2_grpc.SchedulerStub(channel), health_pb2_grpc.HealthStub(channel))


class ClusterEngineClient:
    def __init__(
        self,
        redis_url: str,
        nats_url: str,
        gateway_id: str | None = None,
        poll_interval_s: float = 0.5,
        submit_timeout_s: float = 60.0,
    ) -> None:
        self.gateway_id = gateway_id or new_member_id()
        self._redis_url = redis_url
        self._nats_url = nats_url
        self._poll_interval_s = poll_interval_s
        self._submit_timeout_s = submit_timeout_s
        self._lock = threading.Lock()  # guards _replicas, their load, and _placed
        self._replicas: dict[str, _Replica] = {}
        # Where each request of ours runs, by its id and by its children's ids.
        self._placed: dict[str, _Replica] = {}
        self._aborts: set[grpc.Future] = set()  # in flight; held so they are not collected
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
        self._subscriber = OutputSubscriber(self._nats_url, self.gateway_id)
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
        # With n or best_of > 1 the scheduler runs child requests; each ends with one final delta.
        count = num_children(params)
        # Placed by its own id and its children's: an abort may name either.
        placed = list(dict.fromkeys([request_id, *engine_request_ids(request_id, count)]))
        stream = self._subscriber.open(request_id, count)  # before Submit: no delta can slip past
        submit: grpc.Future | None = None
        try:
            replica = self._claim(placed)
            request = scheduler_pb2.SubmitRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, gateway_id=self.gateway_id,
                sampling_params=sampling_params_to_proto(params), cache_salt=cache_salt,
            )
            while True:
                submit = replica.stub.Submit.future(request, timeout=self._submit_timeout_s)
                await finished(submit)
                try:
                    submit.result()
                    break
                except grpc.RpcError as exc:
                    # A replica that began draining (or lost its worker) since the last poll
                    # refuses as UNAVAILABLE: another one may take the request.
                    other = self._reroute(replica, placed) if _unavailable(exc) else None
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
                submit.add_done_callback(lambda _: self._send_abort(replica, request_id))

    async def abort(self, request_id: str) -> None:
        """A request id aborts the request and its children; a child id, that child only."""
        with self._lock:
            replica = self._placed.get(request_id)
        if replica is not None:
            self._send_abort(replica, request_id)

    def _claim(self, ids: list[str]) -> _Replica:
        with self._lock:
            routable = [replica for replica in self._replicas.values() if replica.routable]
            if not routable:
                raise EngineUnavailable("no scheduler is ready")
            replica = min(routable, key=lambda r: r.load)
            replica.load += 1  # until the next poll counts it
            self._placed.update(dict.fromkeys(ids, replica))
            return replica

    def _reroute(self, refused: _Replica, ids: list[str]) -> _Replica | None:
        """Sets a refusing replica aside until the next poll; claims another, if any is routable."""
        with self._lock:
            refused.routable = False
            refused.load -= 1
        try:
            return self._claim(ids)
        except EngineUnavailable:
            return None

    def _release(self, ids: list[str]) -> None:
        with self._lock:
            for request_id in ids:
                self._placed.pop(request_id, None)

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
            return
        leased = {member.id: member for member in view.schedulers}
        if view.schedulers:
            self._info = _engine_info(view.schedulers)
        with self._lock:
            gone = [self._replicas.pop(i) for i in list(self._replicas) if i not in leased]
            orphans = [(replica, [i for i, r in self._placed.items() if r is replica]) for replica in gone]
            for member_id, member in leased.items():
                if member_id not in self._replicas:
                    self._replicas[member_id] = _Replica.open(member)
            replicas = list(self._replicas.values())
        for replica, request_ids in orphans:
            message = f"scheduler {replica.member.id} at {replica.member.address} is gone (it left, or its lease lapsed)"
            logger.warning("%s; failing its %d requests", message, len(request_ids))
            self._subscriber.fail(request_ids, lambda request_id, message=message: RequestFailed(request_id, message))
            replica.channel.close()
        # All at once, so one slow replica delays the poll by its timeout only.
        calls = [
            (
                replica,
                replica.stub.Stats.future(scheduler_pb2.StatsRequest(), timeout=2.0),
                replica.health.Check.future(health_pb2.HealthCheckRequest(service=""), timeout=2.0),
            )
            for replica in replicas
        ]
        stats = [self._poll(replica, call, health, view.scheduler_ready(replica.member)) for replica, call, health in calls]
        self._stats = _total([s for s in stats if s is not None])
        with self._lock:
            self._ready = view.gateway_ready and any(replica.routable for replica in replicas)

    def _poll(self, replica: _Replica, call: grpc.Future, health: grpc.Future, worker_live: bool) -> EngineStats | None:
        try:
            stats = stats_from_proto(call.result())
            serving = health.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            logger.warning("scheduler %s does not answer: %s", replica.member.address, exc.code().name)
            with self._lock:
                replica.routable = False
            return None
        with self._lock:
            replica.load = stats.num_requests_running + stats.num_requests_waiting
            replica.routable = worker_live and serving
        return stats


def _unavailable(exc: grpc.RpcError) -> bool:
    return exc.code() is grpc.StatusCode.UNAVAILABLE


def _submit_error(exc: grpc.RpcError, scheduler: Member) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return invalid_argument(details)
    return EngineUnavailable(f"scheduler at {scheduler.address}: {code.name}: {details}")


def _engine_info(schedulers: list[Member]) -> EngineInfo:
    """What the schedulers know from their workers; replicas of one model agree on it."""
    eos = schedulers[0].metadata["eos_token_ids"]
    return EngineInfo(min(int(s.metadata["max_model_len"]) for s in schedulers),
                      tuple(int(t) for t in eos.split(",") if t))


def _total(stats: list[EngineStats]) -> EngineStats:
    """Every replica's stats as one: gauges and counters add up, usage is block-weighted."""
    blocks = sum(s.num_kv_blocks for s in stats)
    return EngineStats(
        num_requests_running=sum(s.num_requests_running for s in stats),
        num_requests_waiting=sum(s.num_requests_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / blocks if blocks else 0.0,
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_kv_blocks=blocks,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
    )
