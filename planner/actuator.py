"""Carries out a decision: scale-up patches the Deployment's scale at once; scale-down
drains first. The planner asks the least loaded replicas to drain (a drain request in
the registry), each one stops taking requests, finishes those it runs and leaves the
registry, and only then is the Deployment's scale patched down: its controller removes
the drained pods, which fail readiness, before any ready one. Pods still loading (not
yet registered) serve nothing: those go by a patch alone.

A replica that can serve either pool (kv_both, given a pool) moves from the prefill pool
to the decode pool when the decision says so (`Decision.moves`): a move request in the
registry, which the replica follows within a second (scheduler_svc/pool_move.py). Its
pod stays in its Deployment: each pool's count is then its Deployment's, less the pods
serving in the other pool, plus the other Deployment's pods serving in this one; and a
drained replica's own Deployment is scaled down, whichever pool it served in.

With `--dry-run` (no Deployments) each action is logged instead of taken."""
from __future__ import annotations

import logging
from collections import Counter

from planner.decision import Decision
from planner.fleet import Replica, home_of, pool_of
from planner.kube import Deployments
from services.registry import Member, Registry

logger = logging.getLogger(__name__)

# How long a drain request outlives the drain's own timeout: a planner that dies mid-drain
# leaves no request in Redis for good (the replica, drained, waits idle to be removed).
DRAIN_REQUEST_SLACK_S = 300.0
# A move request is followed within a second; one nobody follows (its replica died) lapses.
MOVE_REQUEST_TTL_S = 60.0


class Actuator:
    def __init__(self, registry: Registry, deployments: Deployments | None, names: dict[str, str],
                 drain_timeout_s: float) -> None:
        """`names`: the Deployment of each pool the planner manages."""
        self._registry = registry
        self._deployments = deployments
        self._names = names
        self._drain_timeout_s = drain_timeout_s
        self.draining: dict[str, str] = {}  # member id -> its home pool, until that pool is scaled down
        self._resumed = False

    def counts(self, members: list[Member]) -> dict[str, int]:
        """Each managed pool's replicas: its Deployment's count less those draining, less
        its pods serving in another pool, plus other pools' pods serving in it (dry run:
        the registered replicas not draining)."""
        serving = [m for m in members if m.id not in self.draining]
        if self._deployments is None:
            up = Counter(pool_of(m) for m in serving)
            return {pool: up[pool] for pool in self._names}
        draining = Counter(self.draining.values())
        moved = Counter()
        for member in serving:
            if pool_of(member) != home_of(member):
                moved[pool_of(member)] += 1
                moved[home_of(member)] -= 1
        return {pool: self._deployments.replicas(name) - draining[pool] + moved[pool]
                for pool, name in self._names.items()}

    def resume_drains(self) -> None:
        """Once, at the first round that reaches Redis: takes up the drains a planner
        before this one asked for (the request names its pool) and did not settle, so a
        planner that restarts mid-drain still scales the pool down once they end."""
        if self._resumed or self._deployments is None:  # a dry run asks for no drain, settles none
            return
        for member_id, pool in self._registry.drain_requests("scheduler").items():
            if pool in self._names:
                self.draining.setdefault(member_id, pool)
        self._resumed = True
        if self.draining:
            logger.info("resuming the drains of %s", ", ".join(f"{m} ({p})" for m, p in sorted(self.draining.items())))

    def settle_drains(self, members: list[Member]) -> None:
        """Scales each pool down by its replicas that finished draining (left the registry)."""
        self.resume_drains()
        live = {m.id for m in members}
        done: dict[str, list[str]] = {}
        for member_id, pool in self.draining.items():
            if member_id not in live:
                done.setdefault(pool, []).append(member_id)
        for pool, member_ids in done.items():
            # Forgotten right after their pool's patch, so a failure later in the round
            # (another pool's patch) never patches this pool twice.
            self._patch(pool, lambda current, n=len(member_ids): current - n, f"{len(member_ids)} replica(s) drained")
            for member_id in member_ids:
                del self.draining[member_id]
                self._registry.clear_drain("scheduler", member_id)

    def apply(self, decision: Decision, replicas: list[Replica], counts: dict[str, int]) -> None:
        targets, counts = dict(decision.replicas), dict(counts)
        moved = self._move_to_decode(decision.moves, replicas) if decision.moves else 0
        if moved:  # they count in the decode pool now, and the prefill pool does not replace them
            counts["prefill"] -= moved
            counts["decode"] += moved
            targets["prefill"] = min(targets["prefill"], counts["prefill"])
        for pool, target in targets.items():
            current = counts[pool]
            if target > current:
                self._patch(pool, lambda spec, more=target - current: spec + more, f"{current} -> {target}")
            elif target < current:
                self._scale_down(pool, current - target, replicas)

    def _move_to_decode(self, wanted: int, replicas: list[Replica]) -> int:
        """Asks up to `wanted` prefill replicas that can move, the least loaded, to serve
        decode; one prefill replica stays. How many were asked."""
        prefill = [r for r in replicas if r.pool == "prefill" and r.member.id not in self.draining]
        movable = sorted((r for r in prefill if r.movable), key=lambda r: (r.load, r.member.id))
        chosen = movable[:max(0, min(wanted, len(prefill) - 1))]
        for replica in chosen:
            logger.info("%s prefill replica %s (load %d) to the decode pool",
                        "would move" if self._deployments is None else "moving", replica.member.id, replica.load)
            if self._deployments is not None:
                self._registry.request_move("scheduler", replica.member.id, "decode", MOVE_REQUEST_TTL_S)
        return len(chosen)  # a dry run logs the rest of its decision as if they had moved

    def _scale_down(self, pool: str, fewer: int, replicas: list[Replica]) -> None:
        # (A replica whose Deployment the planner does not manage is not its to remove.)
        serving = [r for r in replicas if r.pool == pool and r.home in self._names and r.member.id not in self.draining]
        # Pods not registered yet (loading their model) serve nothing: they go first, by a
        # patch alone (the controller removes pods that are not ready before ready ones).
        registered = sum(1 for r in replicas if r.home == pool and r.member.id not in self.draining)
        loading = 0 if self._deployments is None else max(
            0, self._deployments.replicas(self._names[pool]) - sum(1 for p in self.draining.values() if p == pool)
            - registered)
        unregistered = min(fewer, loading)
        if unregistered:
            self._patch(pool, lambda spec: spec - unregistered, f"{unregistered} replica(s) not yet serving")
        for replica in sorted(serving, key=lambda r: (r.load, r.member.id))[:fewer - unregistered]:
            logger.info("%s pool: %s replica %s (load %d) to drain", pool,
                        "would ask" if self._deployments is None else "asking", replica.member.id, replica.load)
            if self._deployments is not None:
                # Its own Deployment is scaled down once it left, whichever pool it served in.
                self._registry.request_drain("scheduler", replica.member.id, self._drain_timeout_s,
                                             ttl_s=self._drain_timeout_s + DRAIN_REQUEST_SLACK_S, pool=replica.home)
                self.draining[replica.member.id] = replica.home

    def _patch(self, pool: str, new_count, why: str) -> None:
        name = self._names[pool]
        if self._deployments is None:
            logger.info("%s pool: would scale Deployment %s (%s)", pool, name, why)
            return
        current = self._deployments.replicas(name)
        replicas = max(0, new_count(current))
        logger.info("%s pool: scaling Deployment %s from %d to %d (%s)", pool, name, current, replicas, why)
        self._deployments.scale(name, replicas)
