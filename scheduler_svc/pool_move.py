"""A kv_both scheduler serves in the pool the planner moves it to (docs/planner.md).

A replica that can do both sides of a KV handoff (kv_role kv_both) and was given a pool
(`kv_connector_extra_config` `pool`: its pod's Deployment's) serves in that pool only.
The planner can move it to the other pool without restarting it: when the prompts
shrink and the decode pool runs short, an idle prefill replica serves decode at once,
where a new replica would load its model first. The request is a registry key; this
thread looks for it every second, says the new pool in the lease (`kv_pool`, which
gateways and the planner read) and clears it. What the replica holds of its old pool's
work (a prefill whose blocks wait for their fetch, a sequence decoding) runs on: a
kv_both replica does either kind of request.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from services.kv_transfer_config import POOLS
from services.registry import Lease

logger = logging.getLogger(__name__)

POLL_S = 1.0


def follow_move_requests(lease: Lease) -> threading.Thread:
    def follow() -> None:
        while True:
            time.sleep(POLL_S)
            try:
                pool = lease.registry.move_requested(lease.member)
                if pool is None:
                    continue
                if pool in POOLS and pool != lease.member.metadata.get("kv_pool"):
                    logger.info("the planner moved this scheduler to the %s pool", pool)
                    lease.update(kv_pool=pool)
                elif pool not in POOLS:
                    logger.warning("ignoring a request to move to pool %r: pools are %s", pool, ", ".join(POOLS))
                lease.registry.clear_move(lease.member)
            except redis.RedisError:  # Redis may come back; the request will still be there
                continue

    thread = threading.Thread(target=follow, name="kvfleet-move-request", daemon=True)
    thread.start()
    return thread
