"""`kvfleet worker`: the model and its KV cache, serving step plans over gRPC to its scheduler."""
from __future__ import annotations

import argparse
import gc
import os

from services.cli_args import (
    add_engine_args,
    add_listen_args,
    add_registry_args,
    engine_args,
)
from services.config import EngineConfig
from services.role_process import serve_role
from services.telemetry import configure_logging, serve_role_metrics

DEFAULT_PORT = 50051


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_listen_args(parser, DEFAULT_PORT)
    add_registry_args(parser, required=False)


def run_worker(args: argparse.Namespace) -> int:
    from services.transport.tls import configure_tls
    from worker_svc.runtime.preflight import check_model

    config = EngineConfig(**engine_args(args))
    check_model(config)  # a model the flags cannot fit (or split) fails before torch loads

    from worker_svc.kernels.cpu.threads import configure_torch_threads
    from worker_svc.server import start_worker_server
    from worker_svc.worker_group import start_worker

    configure_logging()
    configure_tls(args)  # before any server or channel opens
    configure_torch_threads()
    # A rank of its group that dies ends this process: its scheduler sees one lost worker,
    # and whoever supervises the worker starts the group again.
    worker = start_worker(config, on_lost=lambda reason: os._exit(1))
    # The model's objects live as long as the process: kept out of every collection,
    # they cost no GC pass while serving, and exit skips ~1 s of collecting them.
    gc.freeze()
    serve_role_metrics(args.metrics_port, args.host)
    server = start_worker_server(worker, f"{args.host}:{args.port}")
    serve_role(args, "worker", server)
    return 0
