"""`kvfleet tokenizer`: text work for the gateways (chat templates, tokenization, the
tokenizer files they detokenize with), over gRPC."""
from __future__ import annotations

import argparse

from services.cli_args import (
    TOKENIZER_FIELDS,
    add_chat_template_arg,
    add_engine_args,
    add_listen_args,
    add_registry_args,
    engine_args,
)
from services.config import EngineConfig
from services.role_process import serve_role
from services.telemetry import configure_logging, serve_role_metrics

DEFAULT_PORT = 50053


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, only=TOKENIZER_FIELDS)
    add_chat_template_arg(parser)
    add_listen_args(parser, DEFAULT_PORT)
    add_registry_args(parser, required=False)


def run_tokenizer(args: argparse.Namespace) -> int:
    from services.transport.tls import configure_tls
    from tokenizer_svc.server import start_tokenizer_server
    from tokenizer_svc.tokenizer import Tokenizer

    configure_logging()
    configure_tls(args)  # before any server or channel opens
    tokenizer = Tokenizer.for_engine(EngineConfig(**engine_args(args)), args.chat_template)
    serve_role_metrics(args.metrics_port, args.host)
    server = start_tokenizer_server(tokenizer, f"{args.host}:{args.port}")
    serve_role(args, "tokenizer", server)
    return 0
