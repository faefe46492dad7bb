"""The role registry in Redis: which role processes are alive, where, and with what.

Every live role process holds a lease: key `kvfleet:role:<role>:<id>` holding JSON
{address, metadata}, with a TTL that a heartbeat thread renews every third of it.
A process that dies, hangs or stops being healthy stops renewing, and its key
expires: nobody has to clean up after it, and readers only ever see live members.

Readiness is derived from it: a scheduler is ready iff the worker group it drives
(its metadata's "worker" address) holds a lease; a gateway iff at least one ready
scheduler and one tokenizer do.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import redis

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvfleet:role"
LORA_KEY = "kvfleet:lora_adapters"
# The planner's requests that a replica drain and leave (docs/planner.md): one key per
# member, `kvfleet:drain:<role>:<id>`, under a TTL, so a planner that dies leaves none for good.
DRAIN_PREFIX = "kvfleet:drain"
# The planner's requests that a replica serve in another pool (docs/planner.md), likewise.
MOVE_PREFIX = "kvfleet:move"
# The keyspace's generation: a random id written once, with no TTL, by the first reader
# to find it missing. A Redis that restarted empty (or was flushed) has lost it, so a
# new one tells readers that missing leases may only be waiting for their next beat.
EPOCH_KEY = "kvfleet:epoch"
DEFAULT_TTL_S = 10.0
REDIS_PASSWORD_ENV = "KVFLEET_REDIS_PASSWORD"
# An ACL user's name (Redis 6+), logged in with the password above; without it, the
# password alone logs in as Redis's default user (requirepass).
REDIS_USERNAME_ENV = "KVFLEET_REDIS_USERNAME"


def new_member_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Member:
    role: str  # "gateway", "tokenizer", "scheduler", "worker"
    id: str
    address: str  # host:port that other roles dial
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}:{self.role}:{self.id}"


class Registry:
    """Typed access to the leases; every call is one or two Redis round trips."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url
        # The password comes from the environment: in a --redis-url it would show on the command line.
        credentials = {"password": os.environ[REDIS_PASSWORD_ENV]} if os.environ.get(REDIS_PASSWORD_ENV) else {}
        if credentials and os.environ.get(REDIS_USERNAME_ENV):
            credentials["username"] = os.environ[REDIS_USERNAME_ENV]
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True, **credentials
        )

    def put(self, member: Member, ttl_s: float) -> bool:
        """Lists or renews `member`; True when its key was not there: a first registration,
        or one that Redis lost (a restart with an empty keyspace) or let lapse."""
        value = json.dumps({"address": member.address, "metadata": dict(member.metadata)})
        pipeline = self._redis.pipeline()
        pipeline.exists(member.key)
        pipeline.set(member.key, value, px=max(1, round(ttl_s * 1000)))
        existed, _ = pipeline.execute()
        return not existed

    def remove(self, member: Member) -> None:
        self._redis.delete(member.key)

    def members(self, role: str) -> list[Member]:
        """The live members of a role, by id. SCAN walks the keyspace; this registry's
        keyspace is a handful of keys per process, so that stays cheap."""
        keys = sorted(self._redis.scan_iter(match=f"{KEY_PREFIX}:{role}:*", count=1000))
        members = []
        for key, value in zip(keys, self._redis.mget(keys) if keys else []):
            if value is None:  # expired between the scan and the read
                continue
            record = json.loads(value)
            members.append(Member(role, key.rsplit(":", 1)[1], record["address"], record["metadata"]))
        return members

    # The LoRA adapters a cluster's gateways serve (docs/lora.md): one hash, name -> the
    # LoRARequest's JSON, so a load through one gateway is served by all. Unlike a lease it
    # has no TTL: an adapter stays until unloaded (a restarted, empty Redis forgets them).
    def put_lora(self, name: str, value: str) -> None:
        self._redis.hset(LORA_KEY, name, value)

    def put_lora_if_absent(self, name: str, value: str) -> None:
        """A replica's re-announcement (Lease's on_registered): never over a newer load's entry."""
        self._redis.hsetnx(LORA_KEY, name, value)

    def remove_lora(self, name: str) -> None:
        self._redis.hdel(LORA_KEY, name)

    def loras(self) -> dict[str, str]:
        return self._redis.hgetall(LORA_KEY)

    # A drain request: the planner sets it, the member's process drains and leaves the
    # registry, and the planner removes it once it has scaled the member's pool down.
    # Its value, JSON: `timeout_s`, the seconds the member's requests get to finish (past
    # them, they end with an error), and `pool`, the planner's pool of the member, so that
    # a planner that restarts mid-drain resumes it (its pool is scaled down once it left).
    def request_drain(self, role: str, member_id: str, timeout_s: float, ttl_s: float, pool: str = "") -> None:
        value = json.dumps({"timeout_s": float(timeout_s), "pool": pool})
        self._redis.set(f"{DRAIN_PREFIX}:{role}:{member_id}", value, px=max(1, round(ttl_s * 1000)))

    def drain_requested(self, member: Member) -> float | None:
        """The drain's timeout if `member` is asked to drain, else None."""
        value = self._redis.get(f"{DRAIN_PREFIX}:{member.role}:{member.id}")
        return None if value is None else float(json.loads(value)["timeout_s"])

    def drain_requests(self, role: str) -> dict[str, str]:
        """The members of `role` asked to drain, whether or not they still hold a lease,
        each with the pool the request names."""
        keys = sorted(self._redis.scan_iter(match=f"{DRAIN_PREFIX}:{role}:*"))
        values = self._redis.mget(keys) if keys else []
        # A key may expire between the scan and the read: it is then no request.
        return {key.rsplit(":", 1)[1]: json.loads(value)["pool"] for key, value in zip(keys, values) if value}

    def clear_drain(self, role: str, member_id: str) -> None:
        self._redis.delete(f"{DRAIN_PREFIX}:{role}:{member_id}")

    # A move request: the planner sets it, the member (a kv_both scheduler) serves in the
    # named pool from then on, says so in its lease and clears the request.
    def request_move(self, role: str, member_id: str, pool: str, ttl_s: float) -> None:
        self._redis.set(f"{MOVE_PREFIX}:{role}:{member_id}", pool, px=max(1, round(ttl_s * 1000)))

    def move_requested(self, member: Member) -> str | None:
        """The pool `member` is asked to serve in, if it is."""
        return self._redis.get(f"{MOVE_PREFIX}:{member.role}:{member.id}")

    def clear_move(self, member: Member) -> None:
        self._redis.delete(f"{MOVE_PREFIX}:{member.role}:{member.id}")

    def epoch(self) -> str:
        """The keyspace's generation (EPOCH_KEY), written here if it is missing."""
        pipeline = self._redis.pipeline()
        pipeline.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        pipeline.get(EPOCH_KEY)
        return pipeline.execute()[1]

    def ping(self) -> bool:
        return bool(self._redis.ping())

    def close(self) -> None:
        self._redis.close()


class Lease:
    """Keeps `member` registered while `healthy()` holds, until stop().

    The key goes in at the first healthy beat, so a role is listed only once it can
    serve; an unhealthy beat skips the renewal, so the key lapses within the TTL.
    Usable as a context manager. `on_registered` runs after each beat that found the key
    absent (the first, or after Redis lost it): to put back what the member announces
    beside its lease (a scheduler's runtime-loaded LoRA adapters).
    """

    def __init__(
        self, registry: Registry, member: Member, ttl_s: float = DEFAULT_TTL_S, healthy: Callable[[], bool] = lambda: True,
        on_registered: Callable[[], None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.member = member
        self.ttl_s = ttl_s
        self._healthy = healthy
        self._on_registered = on_registered
        self._stop = threading.Event()
        # One beat at a time: an update's must not be overwritten by a beat that read the member before it.
        self._beating = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kvfleet-lease-{member.role}", daemon=True)

    def start(self) -> Lease:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops renewing and removes the key: a clean exit leaves no stale entry."""
        self._stop.set()
        self._thread.join()
        try:
            self.registry.remove(self.member)
        except redis.RedisError as exc:
            logger.warning("could not remove %s (it expires within %.1f s): %s", self.member.key, self.ttl_s, exc)

    def __enter__(self) -> Lease:
        return self.start()

    def update(self, **metadata: str) -> None:
        """Changes what the lease says, at once where Redis answers (else at the next beat)."""
        with self._beating:
            self.member = replace(self.member, metadata={**self.member.metadata, **metadata})
        self._beat()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        interval = self.ttl_s / 3
        while True:
            self._beat()
            if self._stop.wait(interval):
                return

    def _beat(self) -> None:
        try:
            with self._beating:
                registered = self._healthy() and self.registry.put(self.member, self.ttl_s)
            if registered:
                self._on_registered()
        except redis.RedisError as exc:  # Redis may come back before the lease runs out
            logger.warning("could not renew %s: %s", self.member.key, exc)
        except Exception:
            logger.exception("the health check of %s failed", self.member.key)


class RegistryContinuity:
    """Since when the registry has answered every read from one keyspace. A lease missing
    sooner than a TTL after Redis came back, or after it lost its keyspace (a new epoch,
    with no failed read to show for it when it restarted between two reads), may only be
    waiting for its member's next beat: it is evidence about the member only after that.
    The first answer holds at once: a keyspace lost before it took nothing this reader
    listed, so a member gone right after a reader starts is gone for it at once too."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._epoch: str | None = None

    def answered(self, epoch: str, now: float) -> None:
        if self._epoch is None:
            self._since = -math.inf
        elif self._since is None or epoch != self._epoch:
            self._since = now
        self._epoch = epoch

    def failed(self) -> None:
        self._since = None

    def held_for(self, ttl_s: float, now: float) -> bool:
        return self._since is not None and now - self._since >= ttl_s


@dataclass(frozen=True)
class ClusterView:
    """One read of the registry."""

    schedulers: list[Member]  # every live scheduler lease, ready or not
    workers: list[Member]
    tokenizers: list[Member]

    @classmethod
    def read(cls, registry: Registry) -> ClusterView:
        return cls(registry.members("scheduler"), registry.members("worker"), registry.members("tokenizer"))

    def merged(self, earlier: ClusterView) -> ClusterView:
        """This view plus the members of `earlier` it lacks."""
        def union(now: list[Member], before: list[Member]) -> list[Member]:
            ids = {member.id for member in now}
            return now + [member for member in before if member.id not in ids]

        return ClusterView(union(self.schedulers, earlier.schedulers), union(self.workers, earlier.workers),
                           union(self.tokenizers, earlier.tokenizers))

    def serving(self, accepts: Callable[[Member], bool]) -> ClusterView:
        """The schedulers and tokenizers `accepts` takes (one model's, for a gateway fronting
        several: gateway/cluster/served_models.py); the workers stay, as readiness looks
        them up by address."""
        return ClusterView([m for m in self.schedulers if accepts(m)], self.workers,
                           [m for m in self.tokenizers if accepts(m)])

    def scheduler_ready(self, scheduler: Member) -> bool:
        return scheduler.metadata.get("worker") in {worker.address for worker in self.workers}

    @property
    def ready_schedulers(self) -> list[Member]:
        return [scheduler for scheduler in self.schedulers if self.scheduler_ready(scheduler)]

    @property
    def gateway_ready(self) -> bool:
        return bool(self.ready_schedulers) and bool(self.tokenizers)
