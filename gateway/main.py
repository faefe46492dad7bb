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

from gateway.cluster.disaggregation import DEFAULT_PD_MIN_PREFILL_TOKENS
from gateway.cluster.gateway_id import checked_gateway_name
from gateway.cluster.migration import DEFAULT_MIGRATION_LIMIT
from gateway.cluster.routing import ROUTING_POLICIES
from services.cli_args import (
    add_http_args,
    add_nats_arg,
    add_registry_args,
    add_tls_args,
    at_least,
)
from services.registry import Lease, Member, Registry
from services.role_process import advertised
from services.telemetry import configure_logging

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
    parser.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="prefix",
                        help="which scheduler replica takes a request: where its prompt's prefix is cached, "
                        "balanced with load (prefix), the least loaded, or each in turn (default: %(default)s)")
    parser.add_argument("--pd-min-prefill-tokens", type=at_least(0), default=DEFAULT_PD_MIN_PREFILL_TOKENS,
                        help="with prefill replicas (--kv-transfer-config kv_producer) in the fleet: a prompt with "
                        "more tokens than this not cached on the decode replica chosen for it is prefilled on a "
                        "prefill replica, its KV moved worker to worker (docs/disaggregation.md) "
                        "(default: %(default)s)")
    parser.add_argument("--listen-fd", type=int, metavar="FD",
                        help="serve on this inherited listening socket (TCP or Unix) instead of binding one, taking "
                        "its connections only once the cluster can serve them: how `cluster up --api-server-count N` "
                        "puts its N gateways on one port")


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import build_app
    from gateway.cluster.client import ClusterEngineClient
    from gateway.cluster.tokenizer_client import RemoteTokenizer
    from gateway.drain import serve
    from gateway.limits import RequestLimits
    from gateway.listener import listen, release
    from gateway.response_options import ResponseOptions
    from gateway.server_options import ServerOptions
    from gateway.tool_calls import ChatOptions
    from services.transport.tls import configure_tls

    configure_logging()
    configure_tls(args)  # before any server or channel opens
    listener = listen(args)
    registry = Registry(args.redis_url)
    client = ClusterEngineClient(args.redis_url, args.nats_url, gateway_name=args.gateway_name,
                                 lease_ttl_s=args.lease_ttl, routing_policy=args.routing_policy,
                                 migration_limit=args.migration_limit,
                                 pd_min_prefill_tokens=args.pd_min_prefill_tokens)
    encoder = RemoteTokenizer(lambda: [member.address for member in registry.members("tokenizer")],
                              lease_ttl_s=args.lease_ttl)
    app = build_app(client, encoder, args.served_model_name or [args.model], args.api_key,
                    RequestLimits.from_args(args), ChatOptions.from_args(args), ResponseOptions.from_args(args),
                    args.model, ServerOptions.from_args(args))
    for module in args.lora_modules or []:  # checked by `cluster up`; each replica reads them on first use
        app.state.gateway.loras.register(module.name, module.path, module.base_model_name)
    member = Member("gateway", client.gateway_id, advertised(args), {"model": args.model})
    client.start()
    encoder.start()
    try:
        with Lease(registry, member, args.lease_ttl):
            # Returns after SIGTERM/SIGINT, once open requests end or the timeout passes.
            serve(app, listener, args.shutdown_timeout, args.uvicorn_log_level, not args.disable_uvicorn_access_log,
                  accept_when_ready=args.listen_fd is not None)
    finally:
        encoder.close()
        client.shutdown()
        registry.close()
        release(listener, args.uds)
    return 0
