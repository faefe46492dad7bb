"""Which gateways are gone: a scheduler aborts the requests of a gateway whose registry
lease has lapsed, since nobody will read their tokens (over NATS a scheduler cannot see
its readers leave). Evidence as the gateways' own rule for schedulers: a gateway counts
as gone only once it has been missing from the registry for a lease TTL while Redis
answered, so a Redis restart, or a gateway whose lease is not written yet, costs nothing.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from services.registry import Registry

logger = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, registry: Registry, ttl_s: float) -> None:
        self._registry = registry
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}  # gateway id -> listed, or first asked about (monotonic)
        self._registry_since: float | None = None  # every read has worked since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_forever, name="kvfleet-gateway-watch", daemon=True)
        self._thread.start()

    def gone(self, gateway_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            since = self._last_seen.setdefault(gateway_id, now)
            answered = self._registry_since is not None and now - self._registry_since > self._ttl_s
        return answered and now - since > self._ttl_s

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _poll_forever(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                listed = [member.id for member in self._registry.members("gateway")]
            except redis.RedisError as exc:
                logger.warning("cannot read the gateways' leases: %s", exc)
                with self._lock:
                    self._registry_since = None
                continue
            now = time.monotonic()
            with self._lock:
                if self._registry_since is None:
                    self._registry_since = now
                self._last_seen.update(dict.fromkeys(listed, now))
