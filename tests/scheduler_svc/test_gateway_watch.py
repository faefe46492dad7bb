"""Which gateways a scheduler counts as gone, over a real Redis-compatible server: one
whose lease lapsed, never one whose lease Redis lost with its keyspace."""
from __future__ import annotations

import time

import redis

from scheduler_svc.gateway_watch import GatewayWatch
from services.registry import Lease, Member, Registry

from servers import redis_url  # noqa: F401  (fixture)

TTL_S = 1.2


def test_a_gateway_whose_lease_lapsed_is_gone_and_a_live_one_is_not(redis_url) -> None:
    registry = Registry(redis_url)
    live = Lease(registry, Member("gateway", "live", "127.0.0.1:1"), TTL_S).start()
    leaving = Lease(registry, Member("gateway", "leaving", "127.0.0.1:2"), TTL_S).start()
    watch = GatewayWatch(Registry(redis_url), TTL_S)
    try:
        time.sleep(2 * TTL_S)  # the watch's grace: Redis answered for a TTL, both known for one
        assert not watch.gone("live") and not watch.gone("leaving")
        leaving.stop()
        deadline = time.monotonic() + 3 * TTL_S
        while not watch.gone("leaving"):
            assert time.monotonic() < deadline, "a gateway that left was never counted gone"
            time.sleep(0.02)
        assert not watch.gone("live")
    finally:
        watch.close()
        live.stop()


def test_a_redis_that_lost_its_keyspace_makes_no_live_gateway_gone(redis_url) -> None:
    registry = Registry(redis_url)
    member = Member("gateway", "g", "127.0.0.1:1")
    # Beats 0.5 s apart: its key stays lost across at least one of the watch's reads (0.3 s
    # apart), and is back well within the watch's grace (a TTL, 1.2 s) however late a beat is.
    lease = Lease(registry, member, 1.25 * TTL_S).start()
    watch = GatewayWatch(Registry(redis_url), TTL_S)
    keyspace = redis.Redis.from_url(redis_url)
    try:
        time.sleep(2 * TTL_S)
        epoch = registry.epoch()
        while keyspace.pttl(member.key) < 1.25 * TTL_S * 1000 - 50:  # just after a beat
            time.sleep(0.005)
        keyspace.flushall()  # what a Redis restarted without persistence holds
        flushed = time.monotonic()
        while time.monotonic() - flushed < 2 * TTL_S:
            assert not watch.gone("g")
            time.sleep(0.01)
        assert keyspace.exists(member.key) and registry.epoch() != epoch
    finally:
        keyspace.close()
        watch.close()
        lease.stop()
