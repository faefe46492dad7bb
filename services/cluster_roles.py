"""Roles in cluster mode: the gateway's entry point, and the registry leases of the others.

Each role holds a lease while it is healthy (its gRPC health says SERVING; the
scheduler's NATS link is up too), so a dead or wedged role drops out of the cluster
by itself. The gateway serves the OpenAI API over a ClusterEngineClient, with the
tokenizer in-process because the gateway owns incremental detokenization.

"""
from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.transport.channel import RECONNECT_OPTIONS
from services.telemetry import configure_logging
from services.registry import DEFAULT_TTL_S, Lease, Member, Registry, new_member_id

if TYPE_CHECKING:  # loading them pulls in the engine; only run_scheduler needs that
    from services.bus import NatsOutputHub
    from services.transport.step_loop import StepLoop

logger = logging.getLogger(__name__)

GATEWAY_PORT = 8000


def add_registry_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--redis-url", required=required, help="the registry, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S,
                        help="seconds a dead process stays listed (default: %(default)s)")
    parser.add_argument("--advertise-address", help="host:port other roles dial (default: --host:--port)")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the model whose tokenizer to load (default: %(default)s)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: the --model value)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=GATEWAY_PORT, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVFLEET_API_KEY)")
    parser.add_argument("--nats-url", required=True, help="where token deltas arrive, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish after SIGTERM (default: %(default)s)")
    add_registry_args(parser)


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import build_app
    from gateway.drain import serve
    from services.cluster_client import ClusterEngineClient
    from services.model_source import resolve_model
    from tokenizer_svc.tokenizer import Tokenizer

    configure_logging()
    tokenizer = Tokenizer.load(resolve_model(args.model))
    registry = Registry(args.redis_url)
    client = ClusterEngineClient(args.redis_url, args.nats_url)
    max_model_len, eos_token_ids = _engine_facts(registry)
    app = build_app(client, tokenizer, args.served_model_name or args.model, args.api_key,
                    max_model_len=max_model_len, eos_token_ids=eos_token_ids)
    member = Member("gateway", client.gateway_id, _advertised(args), {"model": args.model})
    client.start()
    try:
        with Lease(registry, member, args.lease_ttl):
            # Returns after SIGTERM/SIGINT, once open requests end or the timeout passes.
            serve(app, args.host, args.port, args.shutdown_timeout)
    finally:
        client.shutdown()
        registry.close()
    return 0


def scheduler_lease(args: argparse.Namespace, port: int, loop: StepLoop, hub: NatsOutputHub) -> Lease:
    """The scheduler's lease, with what gateways must know of its engine before they
    can validate requests. Healthy while it serves (or drains) and can publish."""
    serving = grpc_serving(f"127.0.0.1:{port}")
    metadata = {"worker": args.worker_address, "model": args.model, "max_model_len": str(loop.core.max_model_len),
                "eos_token_ids": ",".join(map(str, loop.core.eos_token_ids))}
    member = Member("scheduler", new_member_id(), _advertised(args, port), metadata)

    def healthy() -> bool:
        # After lost deltas, stay away for two TTLs: every gateway sees the lease lapse and fails our requests.
        publishing = hub.publisher.connected and not hub.publisher.lost_within(2 * args.lease_ttl)
        # Draining, health says NOT_SERVING but the lease stays: gateways fail the
        # requests of a scheduler whose lease lapses, and these are still running.
        return publishing and (serving() or loop.draining)

    return Lease(Registry(args.redis_url), member, args.lease_ttl, healthy=healthy)


def role_lease(role: str, args: argparse.Namespace, port: int) -> Lease:
    """A worker's or tokenizer's lease: listed while its gRPC health says SERVING."""
    member = Member(role, new_member_id(), _advertised(args, port), {"model": args.model})
    return Lease(Registry(args.redis_url), member, args.lease_ttl, healthy=grpc_serving(f"127.0.0.1:{port}"))


def grpc_serving(address: str) -> Callable[[], bool]:
    """A check that the gRPC server at `address` reports SERVING (false while it is down)."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address, options=RECONNECT_OPTIONS))

    def check() -> bool:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    return check


def _engine_facts(registry: Registry) -> tuple[int, tuple[int, ...]]:
    """max_model_len and EOS ids: the schedulers know them from their workers, so this
    waits for the first to register. Replicas of one model agree on them."""
    logger.info("waiting for a scheduler in the registry at %s", registry.url)
    while not (schedulers := registry.members("scheduler")):
        time.sleep(0.5)
    eos = schedulers[0].metadata["eos_token_ids"]
    return min(int(s.metadata["max_model_len"]) for s in schedulers), tuple(int(t) for t in eos.split(",") if t)


def _advertised(args: argparse.Namespace, port: int | None = None) -> str:
    return args.advertise_address or f"{args.host}:{port or args.port}"
