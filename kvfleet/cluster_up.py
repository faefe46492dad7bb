"""`kvfleet cluster up`: a whole cluster on this machine, each part its own OS process.

Starts nats-server and a Redis-compatible server on free ports, then the tokenizer,
worker, scheduler and gateway roles, and waits until the gateway's /health says the
cluster serves. SIGTERM or Ctrl-C stops the roles first, one at a time, each drained
within --shutdown-timeout: the gateway (its requests in flight finish), then the
scheduler, the worker and the tokenizer; then NATS and Redis, and exits 0. A part
that dies on its own is restarted with a backoff (kvfleet/supervisor.py), so a killed
worker comes back and is taken up again without restarting the cluster.

Children run in their own process group, so a terminal's Ctrl-C reaches only this
launcher, which stops them in order; on Linux each also dies with the launcher.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import urllib.request

from kvfleet.processes import (
    free_port,
    spawn,
    start_nats,
    start_redis,
    stop,
    wait_for_port,
)
from kvfleet.supervisor import Supervised
from services.cli_args import (
    add_engine_args,
    add_http_args,
    add_lease_ttl_arg,
    engine_argv,
    gateway_argv,
)
from services.telemetry import configure_logging

logger = logging.getLogger("kvfleet.cluster")

# What a role gets past its --shutdown-timeout to exit before it is killed.
STOP_MARGIN_S = 10.0


def add_cluster_up_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_http_args(parser)
    add_lease_ttl_arg(parser)


def run_cluster_up(args: argparse.Namespace) -> int:
    configure_logging()
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())
    local = "127.0.0.1"
    ports = {name: free_port(local) for name in ("nats", "redis", "tokenizer", "worker", "scheduler")}
    infra = [Supervised("nats", lambda: start_nats(local, ports["nats"])),
             Supervised("redis", lambda: start_redis(local, ports["redis"]))]
    roles: list[Supervised] = []  # in start order; stopped in reverse
    try:
        for part in infra:
            part.launch()
        wait_for_port(local, ports["nats"], infra[0].process)
        wait_for_port(local, ports["redis"], infra[1].process)
        cluster = ["--redis-url", f"redis://{local}:{ports['redis']}/0", "--lease-ttl", str(args.lease_ttl),
                   "--shutdown-timeout", str(args.shutdown_timeout)]
        nats = ["--nats-url", f"nats://{local}:{ports['nats']}"]
        engine = engine_argv(args)
        worker = f"{local}:{ports['worker']}"
        commands = [
            ["tokenizer", "--model", args.model, "--host", local, "--port", str(ports["tokenizer"]), *cluster],
            ["worker", *engine, "--host", local, "--port", str(ports["worker"]), *cluster],
            ["scheduler", *engine, "--host", local, "--port", str(ports["scheduler"]), "--worker-address", worker,
             *nats, *cluster],
            ["gateway", "--model", args.model, "--host", args.host, "--port", str(args.port), *nats, *cluster,
             *gateway_argv(args)] + (["--served-model-name", args.served_model_name] if args.served_model_name else []),
        ]
        # The API key travels in the environment, never on a command line others can read.
        env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
        if args.api_key:
            env["KVFLEET_API_KEY"] = args.api_key
        for command in commands:
            role = Supervised(command[0], lambda argv=command: spawn([sys.executable, "-m", "kvfleet.cli", *argv],
                                                                     env=env))
            role.launch()
            roles.append(role)
        _supervise(args, infra + roles, stopping)
    finally:
        for part in reversed(roles):  # the gateway first: it drains while the rest still serves
            if part.process is not None:
                stop(part.process, args.shutdown_timeout + STOP_MARGIN_S)
        for part in infra:
            if part.process is not None:
                stop(part.process)
    logger.info("cluster stopped")
    return 0


def _supervise(args: argparse.Namespace, parts: list[Supervised], stopping: threading.Event) -> None:
    """Until a signal: restarts whatever exits, and announces when the cluster serves."""
    health = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}/health"
    serving = False
    while not stopping.wait(0.5):
        for part in parts:
            part.check()
        if not serving and _healthy(health):
            serving = True
            logger.info("cluster serving on http://%s:%d", args.host, args.port)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False
