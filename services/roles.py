"""Entry points of the cluster roles (`kvfleet worker|scheduler|tokenizer`): each
loads its part, serves it over gRPC with health checks, and on SIGTERM or SIGINT
drains, then exits 0. Health says NOT_SERVING at once; within --shutdown-timeout,
the scheduler refuses new requests (UNAVAILABLE) and steps the running ones to their
end, then ends any left with an explicit error; the worker runs steps until its
scheduler has ended every request it holds; the tokenizer finishes its calls in flight.
Each run_* imports its role's modules itself, so building the CLI parser loads none
of them (transformers, the model code)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

from collections.abc import Callable
from contextlib import AbstractContextManager

from services.cli_args import add_engine_args, engine_args
from services.cluster_roles import add_registry_args, role_lease, scheduler_lease
from services.config import EngineConfig
from services.model_source import resolve_model
from services.threads import configure_torch_threads
from services.telemetry import EngineStatsCollector, configure_logging, serve_role_metrics
from services.transport.grpc_server import FLUSH_S, RoleServer

logger = logging.getLogger(__name__)

WORKER_PORT = 50051
SCHEDULER_PORT = 50052
TOKENIZER_PORT = 50053


def _add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=port, help="port to listen on; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0,
        help="serve Prometheus /metrics on this port; 0 turns it off (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds in-flight work gets to finish after SIGTERM (default: %(default)s)",
    )


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    _add_listen_args(parser, WORKER_PORT)
    add_registry_args(parser, required=False)


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    _add_listen_args(parser, SCHEDULER_PORT)
    parser.add_argument(
        "--worker-address", default=f"127.0.0.1:{WORKER_PORT}",
        help="host:port of the worker group this scheduler drives (default: %(default)s)",
    )
    parser.add_argument(
        "--nats-url", help="publish token deltas on NATS (kvfleet.out.<gateway_id>), as `kvfleet gateway` reads "
        "them; unset: over StreamOutputs only",
    )
    add_registry_args(parser, required=False)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="alias (smollm2), a .gguf file, or a HuggingFace "
                        "model directory (default: %(default)s)")
    _add_listen_args(parser, TOKENIZER_PORT)
    add_registry_args(parser, required=False)


def run_worker(args: argparse.Namespace) -> int:
    from services.transport.worker_server import start_worker_server
    from worker_svc.worker import Worker

    configure_logging()
    configure_torch_threads()
    worker = Worker(EngineConfig(**engine_args(args)))
    serve_role_metrics(args.metrics_port, args.host)
    server = start_worker_server(worker, f"{args.host}:{args.port}")
    with _registered(args, lambda: role_lease("worker", args, server.port)):
        _serve_until_signalled(server, args.shutdown_timeout)
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    from services.transport.output_hub import OutputHub
    from services.transport.scheduler_server import start_scheduler_server
    from services.transport.step_loop import StepLoop
    from services.transport.worker_client import RemoteWorker
    from tokenizer_svc.tokenizer import Tokenizer

    from services.bus import NatsOutputHub

    if args.redis_url and not args.nats_url:
        raise SystemExit("--redis-url needs --nats-url: gateways that find this scheduler read its tokens from NATS")
    configure_logging()
    config = EngineConfig(**engine_args(args))
    worker = RemoteWorker(args.worker_address)
    logger.info("waiting for the worker at %s", args.worker_address)
    # Only a model whose config names no EOS needs the tokenizer's.
    fallback_eos = None if worker.describe().eos_token_ids else Tokenizer.load(resolve_model(config.model)).eos_token_id
    hub = NatsOutputHub(args.nats_url) if args.nats_url else OutputHub()
    loop = StepLoop(config, worker, hub, fallback_eos)
    try:
        serve_role_metrics(args.metrics_port, args.host, EngineStatsCollector(loop, config.model))
        server = start_scheduler_server(loop, hub, f"{args.host}:{args.port}")
        with _registered(args, lambda: scheduler_lease(args, server.port, loop, hub)):
            _serve_until_signalled(server, args.shutdown_timeout)
    finally:
        worker.close()
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    from services.transport.tokenizer_server import start_tokenizer_server
    from tokenizer_svc.tokenizer import Tokenizer

    configure_logging()
    tokenizer = Tokenizer.load(resolve_model(args.model))
    serve_role_metrics(args.metrics_port, args.host)
    server = start_tokenizer_server(tokenizer, f"{args.host}:{args.port}")
    with _registered(args, lambda: role_lease("tokenizer", args, server.port)):
        _serve_until_signalled(server, args.shutdown_timeout)
    return 0


def _registered(args: argparse.Namespace, lease: Callable[[], AbstractContextManager]) -> AbstractContextManager:
    """The role's registry lease with --redis-url; without, nothing."""
    return lease() if args.redis_url else contextlib.nullcontext()


def _serve_until_signalled(server: RoleServer, grace_s: float) -> None:
    """Serves until SIGTERM or SIGINT, then drains and stops within `grace_s` (plus a
    moment for streams to send their last messages, even with `grace_s` 0). A second
    signal meanwhile gets the default handling: it ends the process at once."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.wait()
        logger.info("stopping %s", server.service_name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop(grace_s, flush_s=FLUSH_S)
