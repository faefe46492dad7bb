"""`kvfleet scheduler`: queues, block tables and the step loop of one model replica,
driving its worker group over gRPC and publishing token deltas on NATS."""
from __future__ import annotations

import argparse
import gc
import logging
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from scheduler_svc.lora_announce import reannounce_loras
from scheduler_svc.worker_client import DEADLINE_TOKENS, DEFAULT_STEP_TIMEOUT_S
from services.cli_args import (
    add_engine_args,
    add_listen_args,
    add_nats_arg,
    add_registry_args,
    at_least,
    engine_args,
)
from services.config import EngineConfig
from services.engine_client import EngineUnavailable
from services.registry import Lease, Member, Registry, new_member_id
from services.role_process import (
    advertised,
    grpc_serving,
    registered,
    serve_until_signalled,
)
from services.telemetry import (
    EngineStatsCollector,
    configure_logging,
    serve_role_metrics,
)
from services.transport.server import FLUSH_S

if TYPE_CHECKING:
    from scheduler_svc.engine_core import EngineCore
    from scheduler_svc.nats_publisher import NatsOutputHub
    from scheduler_svc.step_loop import StepLoop
    from services.transport.server import RoleServer

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50052
WORKER_PORT = 50051
WORKER_CHECK_S = 0.25
_CHECK_TIMEOUT_S = 5.0  # a re-describe takes at most 2 s; the loop may be ending a step


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_listen_args(parser, DEFAULT_PORT)
    parser.add_argument("--worker-address", default=f"127.0.0.1:{WORKER_PORT}",
                        help="host:port of the worker group this scheduler drives (default: %(default)s)")
    parser.add_argument("--max-queued-requests", type=at_least(1), default=None,
                        help="past this many waiting requests, new ones are refused (gateways send them to another "
                        "replica, or answer 429 when all are full); running ones go on (default: no bound)")
    parser.add_argument("--worker-step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                        help=f"seconds a step may take, per {DEADLINE_TOKENS} scheduled tokens, before its worker "
                        "counts as hung and its requests end (or move to another replica) (default: %(default)s)")
    add_nats_arg(parser, required=False, help_text="publish token deltas on NATS (kvfleet.out.<gateway_id>), as "
                 "`kvfleet gateway` reads them; unset: over StreamOutputs only")
    add_registry_args(parser, required=False)
    parser.add_argument("--engine-port", type=int, default=None,
                        help="also serve vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine, for routers built "
                        "for vLLM's gRPC server) on this port; 0 picks a free one (default: not served)")
    parser.add_argument("--engine-host", default=None,
                        help="the address --engine-port binds, a public one where routers on other hosts call it "
                        "while the scheduler's own port stays internal (default: --host)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model name the engine protocol reports (GetModelInfo), the first of these "
                        "(default: the --model value)")


def run_scheduler(args: argparse.Namespace) -> int:
    from scheduler_svc.drain_request import follow_drain_requests
    from scheduler_svc.engine_core import EngineCore
    from scheduler_svc.engine_protocol.kv_events import KvEventStream
    from scheduler_svc.engine_protocol.server import VllmEngineServicer, start_vllm_engine_server
    from scheduler_svc.engine_protocol.text import EngineText
    from scheduler_svc.gateway_watch import GatewayWatch
    from scheduler_svc.nats_publisher import NatsOutputHub
    from scheduler_svc.output_hub import OutputHub
    from scheduler_svc.pool_move import follow_move_requests
    from scheduler_svc.server import start_scheduler_server
    from scheduler_svc.step_loop import StepLoop
    from scheduler_svc.worker_client import RemoteWorker
    from services.transport.tls import configure_tls

    if args.redis_url and not args.nats_url:
        raise SystemExit("--redis-url needs --nats-url: gateways that find this scheduler read its tokens from NATS")
    configure_logging()
    configure_tls(args)  # before any server or channel opens
    config = EngineConfig(**engine_args(args))
    worker = RemoteWorker(args.worker_address, step_timeout_s=args.worker_step_timeout)
    logger.info("waiting for the worker at %s", args.worker_address)
    core = EngineCore(config, worker, args.worker_address)
    # Its start-up objects live as long as the process: kept out of every collection, they
    # cost no pass of it between steps.
    gc.freeze()
    if args.nats_url:  # with a registry, the requests of a gateway whose lease lapsed are aborted
        gateways = GatewayWatch(Registry(args.redis_url), args.lease_ttl) if args.redis_url else None
        hub = NatsOutputHub(args.nats_url, core.instance_id, gateways=gateways)
    else:
        hub = OutputHub()
    kv_events = None
    if args.engine_port is not None:  # before the loop, which takes the hub's KV event publisher as it starts
        kv_events = hub.kv_events = KvEventStream(hub.kv_events)
    loop = StepLoop(core, hub, args.max_queued_requests)
    engine_server = None
    try:
        serve_role_metrics(args.metrics_port, args.host, EngineStatsCollector(loop, config.model))
        server = start_scheduler_server(loop, hub, f"{args.host}:{args.port}")
        if args.engine_port is not None:
            servicer = VllmEngineServicer(loop, hub, kv_events, EngineText.for_engine(config),
                                          grpc_serving(args.worker_address, args.lease_ttl), args.model,
                                          (args.served_model_name or [args.model])[0])
            engine_server = start_vllm_engine_server(servicer, f"{args.engine_host or args.host}:{args.engine_port}")
        _follow_worker(args.worker_address, args.lease_ttl, server, loop)
        with registered(args, lambda: _scheduler_lease(args, server.port, loop, hub)) as lease:
            if lease is not None:  # the planner scales down by asking a replica to drain
                follow_drain_requests(lease, server, loop)
                if lease.member.metadata["kv_pool"]:  # and moves one that can serve either pool
                    follow_move_requests(lease)
            serve_until_signalled(server, args.shutdown_timeout)
    finally:
        if engine_server is not None:  # after the drain, so its streams got their final messages
            engine_server.stop(0, flush_s=FLUSH_S)
        worker.close()
    return 0


def _follow_worker(address: str, patience_s: float, server: RoleServer, loop: StepLoop) -> None:
    """Not ready while the worker does not answer its health check (a busy one: past
    `patience_s`, see grpc_serving): a dead worker is seen within WORKER_CHECK_S (its
    connection is refused), and gateways stop routing here at their next poll, instead
    of a worker lease later. When it answers again, the loop first checks whether it is
    the same worker (a restarted one lost every KV block), and is ready once the engine's
    own client reaches it too: that channel may still be backing off from the outage
    while this probe's already connects."""
    serving = grpc_serving(address, patience_s)

    def follow() -> None:
        was_up = True
        while True:
            up = serving()
            if up and not was_up:
                try:
                    up = loop.check_worker().result(timeout=_CHECK_TIMEOUT_S)
                except EngineUnavailable:  # shutting down
                    return
                except TimeoutError:
                    up = False
            # A scheduler draining for the planner stays not ready (scheduler_svc/drain_request.py).
            server.set_serving(up and not loop.draining)
            was_up = up
            time.sleep(WORKER_CHECK_S)

    threading.Thread(target=follow, name="kvfleet-worker-check", daemon=True).start()


def lease_metadata(worker_address: str, model: str, core: EngineCore, max_queued_requests: int | None = None
                   ) -> dict[str, str]:
    """What a scheduler's lease tells gateways: its worker group (whose lease says it is
    up), what they must know of its engine before they can validate requests, and the
    process's instance, which they name in their calls (a successor on the same address
    refuses what was meant for this one)."""
    kv_transfer = core.config.kv_transfer
    kv_pool = (kv_transfer.pool if kv_transfer is not None else None) or ""
    return {"worker": worker_address, "model": model, "max_model_len": str(core.max_model_len),
            "eos_token_ids": ",".join(map(str, core.eos_token_ids)), "instance_id": core.instance_id,
            "block_size": str(core.scheduler.config.block_size),
            # Its side of prefill/decode disaggregation: gateways keep a prefill and a decode pool.
            "kv_role": kv_transfer.kv_role if kv_transfer is not None else "",
            # A kv_both replica's pool, until the planner moves it (scheduler_svc/pool_move.py),
            # and its first: its pod's Deployment's, which the planner scales. "" otherwise.
            "kv_pool": kv_pool, "kv_home_pool": kv_pool,
            "max_queued_requests": "" if max_queued_requests is None else str(max_queued_requests),
            # How it pools (docs/pooling.md), as JSON; "" when it does not.
            "pooler": "" if core.description.pooler is None else msgspec.json.encode(core.description.pooler).decode()}


def _scheduler_lease(args: argparse.Namespace, port: int, loop: StepLoop, hub: NatsOutputHub) -> Lease:
    """The scheduler's lease, with what gateways must know of its engine before they
    can validate requests. Healthy while it serves (or drains) and reaches NATS: a
    scheduler cut off from NATS for a lease TTL loses its lease, and gateways fail its
    requests (within that TTL, what it publishes waits in its replay window)."""
    serving = grpc_serving(f"127.0.0.1:{port}", args.lease_ttl)
    metadata = lease_metadata(args.worker_address, args.model, loop.core, loop.max_queued_requests)
    member = Member("scheduler", new_member_id(), advertised(args, port), metadata)

    def healthy() -> bool:
        # Draining, health says NOT_SERVING but the lease stays: gateways fail the
        # requests of a scheduler whose lease lapses, and these are still running.
        return hub.publisher.nats.away_s() < args.lease_ttl and (serving() or loop.draining)

    registry = Registry(args.redis_url)
    return Lease(registry, member, args.lease_ttl, healthy=healthy, on_registered=reannounce_loras(registry, loop.core))
