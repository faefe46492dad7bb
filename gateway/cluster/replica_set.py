"""The scheduler replicas a gateway routes to, their health and load, and which of our
requests each runs.

Replicas come from the Redis registry, read by a poller thread that also fetches each
replica's Stats and health: which are routable, full or draining. /metrics shows the sum
of their Stats as asked at the scrape itself (refresh_stats), so a scrape sees every
request that ended before it; the poller's answers serve in between.

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

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import redis
from grpc_health.v1 import health_pb2

from gateway.cluster.fleet_stats import engine_info, total
from gateway.cluster.kv_index import KvIndex
from gateway.cluster.lora_calls import read_loras
from gateway.cluster.replica import Replica
from services.engine_client import RequestLost
from services.lora_request import LoRARequest, encode_lora
from services.messages import EngineInfo, EngineStats
from services.registry import ClusterView, Member, Registry, RegistryContinuity
from services.scheduler_messages import AbortRequest, StatsRequest
from services.transport.futures import finished
from services.transport.role_services import SCHEDULER

logger = logging.getLogger(__name__)

# Its health says SERVING while the scheduler takes requests and its worker link is up.
SCHEDULER_SERVICE = SCHEDULER.name

# Ends the named requests of ours (None: all), each with the error made for its id
# (OutputSubscriber.fail).
FailRequests = Callable[[Sequence[str] | None, Callable[[str], BaseException]], None]


class ReplicaSet:
    def __init__(self, redis_url: str, poll_interval_s: float, lease_ttl_s: float,
                 serves: Callable[[Member], bool] | None = None) -> None:
        """`serves`: the leases of the model this set routes to (gateway/cluster/served_models.py); None: all."""
        self._lease_ttl_s = lease_ttl_s
        self._serves = serves
        # A lease missing within a TTL of Redis coming back or losing its keyspace may
        # just not be re-written yet, so it counts only once that grace has passed.
        self._continuity = RegistryContinuity()
        self._view = ClusterView([], [], [])
        self._redis_url = redis_url
        self._poll_interval_s = poll_interval_s
        # Guards _replicas, their load, and placed; placement and the request streams share it.
        self.lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}
        # Where each request of ours runs, by its id and by its children's ids.
        self.placed: dict[str, Replica] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kv_index: KvIndex | None = None
        # Replaced (never mutated) by the poller, so any thread may read them; lost() may
        # also lower `ready`.
        self.ready = False
        self.info: EngineInfo | None = None
        self.loras: dict[str, LoRARequest] = {}  # the cluster's adapters by name, as the registry holds them

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, fail: FailRequests, kv_index: KvIndex | None) -> None:
        """`fail` ends the requests of a replica that is gone; `kv_index` follows the replicas that come and go."""
        self._registry = Registry(self._redis_url)
        self._fail = fail
        self._kv_index = kv_index
        self._refresh()  # so the client's is_ready() is right from the start
        self._thread = threading.Thread(target=self._poll_forever, name="kvfleet-cluster-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the poller; the replicas' channels stay open until close()."""
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        with self.lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            replica.channel.close()
        self._registry.close()

    def routable(self) -> list[Replica]:
        with self.lock:
            return [replica for replica in self._replicas.values() if replica.routable]

    @property
    def stats(self) -> EngineStats:
        """The sum of each replica's newest Stats."""
        with self.lock:
            return total([replica.stats for replica in self._replicas.values() if replica.stats is not None])

    async def refresh_stats(self, timeout_s: float) -> None:
        """Asks every replica for its Stats now, on the caller's loop. A replica that does
        not answer within `timeout_s` keeps its last answer: judging its health is the
        poller's work."""
        with self.lock:
            replicas = list(self._replicas.values())
        asked_at = time.monotonic()
        calls = []
        for replica in replicas:
            try:
                calls.append((replica, replica.stub.Stats.future(StatsRequest(replica.instance_id), timeout=timeout_s)))
            except ValueError:  # its channel is closed: it has just been retired
                continue
        for replica, call in calls:  # all asked at once: the wait is the slowest answer's
            await finished(call)
            if call.exception() is None:
                with self.lock:
                    replica.record_stats(call.result(), asked_at)

    def share_lora(self, lora_request: LoRARequest) -> None:
        """Lists an adapter in the registry, for every gateway to serve."""
        self._registry.put_lora(lora_request.lora_name, encode_lora(lora_request))
        self.loras = {**self.loras, lora_request.lora_name: lora_request}

    def unshare_lora(self, lora_int_id: int) -> None:
        names = [name for name, lora in self.loras.items() if lora.lora_int_id == lora_int_id]
        for name in names:
            self._registry.remove_lora(name)
        self.loras = {name: lora for name, lora in self.loras.items() if name not in names}

    def replica_of(self, instance_id: str) -> Replica | None:
        """The listed replica that is this scheduler process, if it still is."""
        with self.lock:
            return next((r for r in self._replicas.values() if r.instance_id == instance_id), None)

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
            if self._serves is not None:
                view = view.serving(self._serves)
            loras = read_loras(self._registry)
            epoch = self._registry.epoch()  # after the reads: a keyspace lost before them shows here
        except redis.RedisError as exc:  # keep the last view: a Redis blip must not stop serving
            logger.warning("cannot read the registry at %s: %s", self._redis_url, exc)
            self._continuity.failed()
            return
        now = time.monotonic()
        self._continuity.answered(epoch, now)
        if not self._continuity.held_for(self._lease_ttl_s, now):  # grace: what was listed still is
            view = view.merged(self._view)
            loras = {**self.loras, **loras}
        self._view = view
        self.loras = loras
        leased = {member.id: member for member in view.schedulers}
        if view.schedulers:
            self.info = engine_info(view.schedulers)
        with self.lock:
            gone = [self._replicas.pop(i) for i in list(self._replicas) if i not in leased]
            for member_id, replica in self._replicas.items():  # what a lease says may change (its kv_pool)
                replica.member = leased[member_id]
            orphans = [(replica, [i for i, r in self.placed.items() if r is replica]) for replica in gone]
            opened = [self._replicas.setdefault(member_id, Replica.open(member, self.lost))
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
        asked_at = time.monotonic()
        calls = [
            (
                replica,
                replica.stub.Stats.future(StatsRequest(replica.instance_id), timeout=2.0),
                replica.health.Check.future(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0),
            )
            for replica in replicas
        ]
        for replica, call, health in calls:
            self._poll(replica, call, health, view.scheduler_ready(replica.member), asked_at)
        with self.lock:
            self.ready = view.gateway_ready and any(replica.routable for replica in replicas)

    def _retire(self, replica: Replica, request_ids: list[str]) -> None:
        """A replica whose lease lapsed past the grace: its requests end here, and it is
        told to abort them (it may still be running, e.g. cut off from NATS) before its
        channel closes."""
        message = f"scheduler {replica.member.id} at {replica.member.address} is gone (its lease lapsed)"
        logger.warning("%s; failing its %d requests", message, len(request_ids))
        self._fail(request_ids, lambda request_id: RequestLost(request_id, message))
        aborts = [replica.stub.Abort.future(AbortRequest(i), timeout=5.0) for i in request_ids]
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

    def lost(self, replica: Replica, why: str, superseded: bool = False) -> None:
        """Any thread: the scheduler's process is gone (its connection failed, or another
        process answers at its address), or tokens it sent us cannot be replayed; its
        requests end now."""
        with self.lock:
            replica.routable = False
            replica.superseded |= superseded
            # Not ready from now if it was the last routable one, not from the next poll: a
            # client that sees /health answer 200 must not get a 503 for its next request.
            # Only the poller makes it ready again, once a replica's health says so.
            self.ready = self.ready and any(r.routable for r in self._replicas.values())
            request_ids = [i for i, r in self.placed.items() if r is replica]
        if request_ids:
            message = f"scheduler {replica.member.id} at {replica.member.address} {why}"
            logger.warning("%s; failing its %d requests", message, len(request_ids))
            self._fail(request_ids, lambda request_id: RequestLost(request_id, message))

    def _poll(self, replica: Replica, call: grpc.Future, health: grpc.Future, worker_live: bool,
              asked_at: float) -> None:
        try:
            stats = call.result()
            serving = health.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                # Busy, not gone (a dead one refuses the connection, and a hung one loses
                # its lease): it keeps what the last poll said rather than turning healthy
                # work away for a slow answer.
                logger.warning("scheduler %s answers its poll late; keeping it as it was", replica.member.address)
                return
            with self.lock:  # what it said before no longer counts
                replica.stats = None
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self.lost(replica, f"was replaced by another process ({exc.details()})", superseded=True)
                return
            logger.warning("scheduler %s does not answer: %s", replica.member.address, exc.code().name)
            with self.lock:
                replica.routable = False
            return
        with self.lock:
            replica.record_stats(stats, asked_at)
            replica.load = stats.num_requests_running + stats.num_requests_waiting
            replica.waiting = stats.num_requests_waiting
            replica.refused_as_full = False
            replica.routable = worker_live and serving and not replica.superseded
