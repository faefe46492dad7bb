"""A scheduler drains when the planner asks it to (docs/planner.md): the same drain as
on SIGTERM, without the process exiting.

The planner scales a pool down only by draining: it writes a drain request for one
replica in the registry, this replica's health says NOT_SERVING for the scheduler's
service (gateways stop routing to it at their next poll; its pod, whose readiness probe
asks about that service, turns not ready, so its Deployment's scale-down takes this pod
first), its requests run to their end, then it leaves the registry. The planner sees
its lease gone and patches the Deployment's scale; SIGTERM then finds nothing to drain.
Until then the process stays up, idle. The whole server ("") stays SERVING: the pod's
liveness probe asks about it, and a drain must not look like a hang, however long.
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from scheduler_svc.step_loop import StepLoop
from services.registry import Lease
from services.transport.server import RoleServer

logger = logging.getLogger(__name__)

# How often it looks for a request: a drain is minutes of work, a second's delay is nothing.
POLL_S = 1.0


def follow_drain_requests(lease: Lease, server: RoleServer, loop: StepLoop) -> threading.Thread:
    def follow() -> None:
        timeout_s = None
        while timeout_s is None:
            time.sleep(POLL_S)
            if loop.draining:  # a signal's drain got there first
                return
            try:
                timeout_s = lease.registry.drain_requested(lease.member)
            except redis.RedisError:  # Redis may come back; the request will still be there
                continue
        logger.info("the planner asked this scheduler to drain (up to %g s)", timeout_s)
        server.set_serving(False)  # the worker check leaves it so while the loop drains
        finished = loop.drain(timeout_s)
        logger.info("drained (%s); leaving the registry", "every request finished" if finished else "timed out")
        lease.stop()

    thread = threading.Thread(target=follow, name="kvfleet-drain-request", daemon=True)
    thread.start()
    return thread
