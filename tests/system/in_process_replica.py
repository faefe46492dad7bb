"""A replica (worker + scheduler) in this process over real gRPC and NATS, registered in
Redis under a name of its own, and the tokenizer role beside it: what the cluster tests
put behind a gateway's client when they want to look inside each replica."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from scheduler_svc.engine_core import EngineCore
from scheduler_svc.main import lease_metadata
from scheduler_svc.nats_publisher import NatsOutputHub
from scheduler_svc.server import start_scheduler_server
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.worker_client import RemoteWorker
from services.config import EngineConfig
from services.messages import EngineStats
from services.registry import Lease, Member, Registry
from tokenizer_svc.server import start_tokenizer_server
from tokenizer_svc.tokenizer import Tokenizer
from worker_svc.runtime.worker import Worker
from worker_svc.server import start_worker_server


@contextmanager
def serving_tokenizer(registry: Registry, tokenizer: Tokenizer, ttl_s: float) -> Iterator[None]:
    """The tokenizer role, registered: a gateway is ready once one is up."""
    server = start_tokenizer_server(tokenizer, "127.0.0.1:0")
    lease = Lease(registry, Member("tokenizer", "t", server.address), ttl_s).start()
    try:
        yield
    finally:
        lease.stop()
        server.stop(0)


class InProcessReplica:
    def __init__(self, name: str, nats_url: str, registry: Registry, config: dict, ttl_s: float,
                 worker_config: dict | None = None, model: str = "smollm2") -> None:
        """`worker_config`: the worker's engine settings where they differ from the scheduler's.
        `model`: the model its scheduler's lease names (a gateway fronting several routes by it)."""
        self.worker_process = Worker(EngineConfig(**(worker_config or config)))
        self.worker = start_worker_server(self.worker_process, "127.0.0.1:0")
        self.remote = RemoteWorker(self.worker.address)
        self.core = EngineCore(EngineConfig(**config), self.remote, self.worker.address)
        self.hub = NatsOutputHub(nats_url, self.core.instance_id)
        self.loop = StepLoop(self.core, self.hub)
        self.scheduler = start_scheduler_server(self.loop, self.hub, "127.0.0.1:0")
        metadata = lease_metadata(self.worker.address, model, self.core)
        self.leases = [Lease(registry, Member("worker", name, self.worker.address), ttl_s).start(),
                       Lease(registry, Member("scheduler", name, self.scheduler.address, metadata), ttl_s).start()]

    def stats(self) -> EngineStats:
        return self.loop.stats()

    def idle(self) -> bool:
        return not self.core.scheduler.has_unfinished_requests

    def close(self) -> None:
        for lease in self.leases:
            lease.stop()
        self.scheduler.stop(0)
        self.worker.stop(0)
        self.remote.close()
