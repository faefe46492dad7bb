"""A kv_both scheduler follows the planner's move requests (scheduler_svc/pool_move.py),
against a real Redis: its lease says the new pool within a second or two, the request
is cleared, and a request naming no pool is dropped without changing the lease."""
from __future__ import annotations

import time

from scheduler_svc.pool_move import follow_move_requests
from services.registry import Lease, Member, Registry

from servers import redis_url  # noqa: F401  (fixture)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_move_request_changes_the_pool_the_lease_says_and_is_cleared(redis_url) -> None:
    registry = Registry(redis_url)
    member = Member("scheduler", "both-1", "127.0.0.1:1", {"kv_role": "kv_both", "kv_pool": "prefill",
                                                            "kv_home_pool": "prefill", "instance_id": "i"})
    lease = Lease(registry, member, ttl_s=30)
    try:
        lease.start()
        follow_move_requests(lease)

        def leased_pool() -> str | None:
            leased = [m for m in registry.members("scheduler") if m.id == member.id]
            return leased[0].metadata["kv_pool"] if leased else None

        wait_until(lambda: leased_pool() == "prefill")
        registry.request_move("scheduler", member.id, "decode", ttl_s=60)
        wait_until(lambda: leased_pool() == "decode")
        wait_until(lambda: registry.move_requested(member) is None)
        # Its first pool (its pod's Deployment's) stays as it was, as does the rest.
        leased = next(m for m in registry.members("scheduler") if m.id == member.id)
        assert leased.metadata == {**member.metadata, "kv_pool": "decode"}
        registry.request_move("scheduler", member.id, "everywhere", ttl_s=60)
        wait_until(lambda: registry.move_requested(member) is None)
        assert leased_pool() == "decode"
    finally:
        lease.stop()
        registry.close()
