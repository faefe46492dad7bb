"""Which gateways are gone: a scheduler aborts the requests of a gateway whose registry
lease has lapsed, since nobody will read their tokens (over NATS a scheduler cannot see
its readers leave). A lapsed lease is a TTL of missed heartbeats, evidence about the
gateway itself; it counts only once Redis has answered from one keyspace for a TTL (an
empty, restarted Redis is refilled within one: services/registry.py's RegistryContinuity)
and a TTL after the gateway was first heard of (its lease may not be written yet), so
neither a Redis restart nor a new gateway costs anything.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from services.registry import Registry, RegistryContinuity

logger = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, registry: Registry, ttl_s: float) -> None:
        self._registry = registry
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._first_seen: dict[str, float] = {}  # gateway id -> first listed or asked about (monotonic)
        self._listed: set[str] = set()  # by the last read that worked
        self._continuity = RegistryContinuity()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_forever, name="kvfleet-gateway-watch", daemon=True)
        self._thread.start()

    def gone(self, gateway_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            known_for = now - self._first_seen.setdefault(gateway_id, now)
            return self._continuity.held_for(self._ttl_s, now) and known_for > self._ttl_s and gateway_id not in self._listed

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _poll_forever(self) -> None:
        while not self._stop.wait(self._ttl_s / 4):
            try:
                listed = [member.id for member in self._registry.members("gateway")]
                epoch = self._registry.epoch()  # after the read: a keyspace lost before it shows here
            except redis.RedisError as exc:
                logger.warning("cannot read the gateways' leases: %s", exc)
                with self._lock:
                    self._continuity.failed()
                continue
            now = time.monotonic()
            with self._lock:
                self._continuity.answered(epoch, now)
                self._listed = set(listed)
                for gateway_id in listed:
                    self._first_seen.setdefault(gateway_id, now)
