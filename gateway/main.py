"""`kvfleet gateway`: the OpenAI-compatible HTTP server of a cluster.

It listens at once and answers 503 on /health until the cluster can serve (a
scheduler and a tokenizer hold leases and the tokenizer's files have been fetched),
so a long model load elsewhere never restart-loops it against a startup probe. On a
socket `cluster up` hands it (--listen-fd), which its other gateways share, it takes
connections only once it can serve them: until then the others, or the socket's
backlog, hold them, as vLLM's API servers take none before their engine is up. It
needs no model files: it tokenizes through the tokenizer role and detokenizes with
the files that role hands out.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.cluster.disaggregation import DEFAULT_PD_MIN_PREFILL_TOKENS
from gateway.cluster.gateway_id import checked_gateway_name
from gateway.cluster.migration import DEFAULT_MIGRATION_LIMIT
from gateway.cluster.routing import ROUTING_POLICIES
from services.cli_args import (
    add_http_args,
    add_migration_wait_arg,
    add_nats_arg,
    add_registry_args,
    add_tls_args,
    at_least,
)
from services.config import ConfigError
from services.registry import Lease, Member, Registry
from services.role_process import advertised
from services.telemetry import configure_logging

if TYPE_CHECKING:  # --help builds this module's parser: no FastAPI, grpc or NATS then
    from fastapi import FastAPI

    from gateway.cluster.client import ClusterEngineClient
    from gateway.cluster.tokenizer_client import RemoteTokenizer

DEFAULT_PORT = 8000
GATEWAY_NAME_ENV = "KVFLEET_GATEWAY_NAME"


def gateway_name(text: str) -> str:
    """--gateway-name, checked as gateway/cluster/gateway_id.py has it; argparse shows the reason."""
    try:
        return checked_gateway_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="the model the cluster serves: its name for clients (default: %(default)s)")
    parser.add_argument("--extra-model", action="append", default=[], metavar="MODEL",
                        help="another model this gateway serves beside --model, by its name in its replicas' "
                        "leases (their --model), which is also its name for clients: a request naming it goes to "
                        "its replicas and tokenizer, and /v1/models lists it; repeat for more. --model's replicas "
                        "are then the others (docs/cluster.md)")
    add_http_args(parser, DEFAULT_PORT)
    add_tls_args(parser)  # for its channels to the tokenizers and schedulers
    add_nats_arg(parser, required=True, help_text="where token deltas arrive, e.g. nats://127.0.0.1:4222")
    add_registry_args(parser, required=True)
    parser.add_argument("--gateway-name", type=gateway_name, default=os.environ.get(GATEWAY_NAME_ENV) or None,
                        help="this gateway's name: its token stream is then kvfleet.out.<name>.<random> (random per "
                        "process), which a NATS permission on kvfleet.out.<name>.> lets this gateway alone read "
                        f"(default: ${GATEWAY_NAME_ENV}; none: kvfleet.out.<random>)")
    parser.add_argument("--migration-limit", type=at_least(0), default=DEFAULT_MIGRATION_LIMIT,
                        help="how many times a request whose replica dies is resubmitted to another, its stream "
                        "going on where it was (0: never; the client gets the error) (default: %(default)s)")
    add_migration_wait_arg(parser)
    parser.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="prefix",
                        help="which scheduler replica takes a request: where its prompt's prefix is cached, "
                        "balanced with load (prefix), the least loaded, or each in turn (default: %(default)s)")
    parser.add_argument("--pd-min-prefill-tokens", type=at_least(0), default=DEFAULT_PD_MIN_PREFILL_TOKENS,
                        help="with prefill replicas (--kv-transfer-config kv_producer) in the fleet: a prompt with "
                        "more tokens than this not cached on the decode replica chosen for it is prefilled on a "
                        "prefill replica, its KV moved worker to worker (docs/disaggregation.md) "
                        "(default: %(default)s)")
    parser.add_argument("--pd-max-prefill-queue", type=at_least(1), default=None, metavar="N",
                        help="with prefill replicas: split a prompt only while some prefill replica has fewer than "
                        "N requests waiting; past that, the decode replica computes it itself, as NVIDIA Dynamo's "
                        "conditional disaggregation does (default: no bound)")
    parser.add_argument("--listen-fd", type=int, metavar="FD",
                        help="serve on this inherited listening socket (TCP or Unix) instead of binding one, taking "
                        "its connections only once the cluster can serve them: how `cluster up --api-server-count N` "
                        "puts its N gateways on one port")


@dataclass
class GatewayModels:
    """The app of a gateway and, per model it fronts, its engine client, tokenizer and lease."""

    app: FastAPI
    clients: list[ClusterEngineClient]
    encoders: list[RemoteTokenizer]
    members: list[Member]

    def start(self) -> None:
        for client, encoder in zip(self.clients, self.encoders):
            client.start()
            encoder.start()

    def close(self) -> None:
        for client, encoder in zip(self.clients, self.encoders):
            encoder.close()
            client.shutdown()


def build_gateway(args: argparse.Namespace, registry: Registry) -> GatewayModels:
    """One engine client and tokenizer per model (--model, then each --extra-model), each
    over that model's leases (gateway/cluster/served_models.py) and streaming its tokens
    under a gateway id (and lease) of its own; one app, answering each request with its
    model's (gateway/model_router.py)."""
    from gateway.app import build_app
    from gateway.cluster.client import ClusterEngineClient
    from gateway.cluster.served_models import serving
    from gateway.cluster.tokenizer_client import RemoteTokenizer
    from gateway.limits import RequestLimits
    from gateway.response_options import ResponseOptions
    from gateway.server_options import ServerOptions
    from gateway.tool_calls import ChatOptions

    if args.model in args.extra_model:
        raise ConfigError(f"--extra-model {args.model}: that is --model already")
    built = GatewayModels(None, [], [], [])  # type: ignore[arg-type]  # the app comes last

    def model_app(model: str | None, served_names: list[str], **extra: object) -> FastAPI:
        serves = serving(model, args.extra_model)
        client = ClusterEngineClient(args.redis_url, args.nats_url, gateway_name=args.gateway_name,
                                     lease_ttl_s=args.lease_ttl, routing_policy=args.routing_policy,
                                     migration_limit=args.migration_limit,
                                     migration_wait_s=args.migration_wait,
                                     pd_min_prefill_tokens=args.pd_min_prefill_tokens,
                                     pd_max_prefill_queue=args.pd_max_prefill_queue, serves=serves)
        encoder = RemoteTokenizer(lambda: [m.address for m in registry.members("tokenizer") if serves(m)],
                                  lease_ttl_s=args.lease_ttl)
        built.clients.append(client)
        built.encoders.append(encoder)
        built.members.append(Member("gateway", client.gateway_id, advertised(args), {"model": model or args.model}))
        return build_app(client, encoder, served_names, args.api_key, RequestLimits.from_args(args),
                         ChatOptions.from_args(args), ResponseOptions.from_args(args), model or args.model,
                         ServerOptions.from_args(args), **extra)

    extra_apps = [model_app(model, [model]) for model in dict.fromkeys(args.extra_model)]
    built.app = model_app(None, args.served_model_name or [args.model], extra_models=extra_apps)
    for module in args.lora_modules or []:  # checked by `cluster up`; each replica reads them on first use
        built.app.state.gateway.loras.register(module.name, module.path, module.base_model_name)
    return built


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.drain import serve
    from gateway.listener import listen, release
    from services.transport.tls import configure_tls

    configure_logging()
    configure_tls(args)  # before any server or channel opens
    listener = listen(args)
    registry = Registry(args.redis_url)
    gateway = build_gateway(args, registry)
    gateway.start()
    leases = [Lease(registry, member, args.lease_ttl).start() for member in gateway.members]
    try:
        # Returns after SIGTERM/SIGINT, once open requests end or the timeout passes.
        serve(gateway.app, listener, args.shutdown_timeout, args.uvicorn_log_level,
              not args.disable_uvicorn_access_log, accept_when_ready=args.listen_fd is not None)
    finally:
        for lease in leases:
            lease.stop()
        gateway.close()
        registry.close()
        release(listener, args.uds)
    return 0
