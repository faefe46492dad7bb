"""A cluster of kvfleet roles as real processes (tests/servers.py's RoleProcess), for the
tests that kill them: what they share of starting, watching and restarting roles, and
reading a replica's own metrics from its scheduler."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from services.registry import ClusterView, Registry

from servers import RoleProcess
from test_worker_failover import health, wait_for


class RoleCluster:
    """`roles` by name; `metrics`, each replica's scheduler /metrics URL; `urls`, each
    gateway's. Subclasses start them."""

    def __init__(self, redis_url: str, num_replicas: int) -> None:
        self.registry = Registry(redis_url)
        self.num_replicas = num_replicas
        self.roles: dict[str, RoleProcess] = {}
        self.metrics: dict[str, str] = {}
        self.urls: dict[str, str] = {}

    def logs(self) -> str:
        return "\n".join(role.log_tail() for role in self.roles.values())

    def wait_for_replicas(self) -> None:
        def ready() -> bool:
            every = len(ClusterView.read(self.registry).ready_schedulers) == self.num_replicas
            return every and all(health(url) == 200 for url in self.urls.values())

        wait_for(ready, 240, "the replicas did not come up", list(self.roles.values()))
        time.sleep(2.0)  # the gateways' pollers have seen them all (every 0.5 s)

    def restart(self, role: str) -> None:
        """kill -9, then the same command (on the same ports)."""
        fresh = self.roles[role] = self.roles[role].restarted()
        # The killed process's lease may stand for a TTL yet: "all ready" means nothing until the new one serves.
        wait_for(lambda: any(" serving on " in line for line in fresh.log), 120, f"the restarted {role} did not serve",
                 [fresh])
        self.wait_for_replicas()

    def metric(self, replica: str, metric: str, **labels: str) -> float:
        """A replica's metric from its scheduler's own /metrics, summed over the lines with `labels`."""
        total = 0.0
        for line in httpx.get(self.metrics[replica], timeout=5).text.splitlines():
            if line.startswith(metric + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def serving(cluster: RoleCluster) -> Iterator[RoleCluster]:
    """The cluster once its replicas serve; every role killed after."""
    try:
        cluster.wait_for_replicas()
        yield cluster
    finally:
        for role in cluster.roles.values():
            role.kill()
        cluster.registry.close()
