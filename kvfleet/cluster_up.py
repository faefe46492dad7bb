"""`kvfleet cluster up`: a whole cluster on this machine, each part its own OS process.

Starts nats-server and a Redis-compatible server on free ports (one that dies before it
listens is started again on another port, kvfleet/processes.py), then the tokenizer,
worker, scheduler and gateway roles, and waits until the gateway's /health says the
cluster serves. The launcher binds the HTTP port (or --uds socket) itself and hands the
listening socket to its --api-server-count gateways: they take its connections in turn,
and while one restarts the others, or the socket's backlog, hold them. SIGTERM or
Ctrl-C stops the roles first, each drained within --shutdown-timeout: the gateways
together (their requests in flight finish), then the scheduler, the worker and the
tokenizer, one at a time; then NATS and Redis, and exits 0. A part
that dies on its own is restarted with a backoff (kvfleet/supervisor.py), so a killed
worker comes back and is taken up again without restarting the cluster.

Children run in their own process group, so a terminal's Ctrl-C reaches only this
launcher, which stops them in order; on Linux each also dies with the launcher.
"""
from __future__ import annotations

import argparse
import http.client
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvfleet.extra_models import add_data_parallel_arg, extra_model_arg
from kvfleet.processes import (
    free_port,
    spawn_labelled,
    start_listening,
    start_nats,
    start_redis,
    stop,
    stop_together,
    write_secret_file,
)
from kvfleet.supervisor import CONFIG_ERROR_EXIT, Supervised
from services.cli_args import (
    TOKENIZER_FIELDS,
    add_api_server_count_arg,
    add_chat_template_arg,
    add_engine_args,
    add_http_args,
    add_lease_ttl_arg,
    add_migration_wait_arg,
    engine_args,
    engine_argv,
    gateway_argv,
)
from services.config import ConfigError, EngineConfig
from services.telemetry import configure_logging

logger = logging.getLogger("kvfleet.cluster")

# What a role gets past its --shutdown-timeout to exit before it is killed.
STOP_MARGIN_S = 10.0


def add_cluster_up_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_http_args(parser)
    add_chat_template_arg(parser)
    add_api_server_count_arg(parser, "gateway processes on the one port (or --uds socket), each serving the whole "
                             "API; /metrics, whichever answers, sums their counters")
    add_lease_ttl_arg(parser)
    add_migration_wait_arg(parser)
    add_data_parallel_arg(parser)
    parser.add_argument("--extra-model", action="append", type=extra_model_arg, default=[], metavar='"MODEL [FLAGS]"',
                        help="another model the gateway serves beside --model, with a tokenizer, worker and scheduler "
                        "of its own: the model, then its own engine flags, as the rest of a serve command line, e.g. "
                        '"all-minilm-l6-v2" or "smollm2 --convert embed"; clients name it by MODEL, /v1/models lists '
                        "both; repeat for more (docs/cluster.md)")
    parser.add_argument("--engine-port", type=int, default=None,
                        help="the scheduler also serves vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine, "
                        "for routers such as smg) on this port, at --host (default: not served)")


def run_cluster_up(args: argparse.Namespace) -> int:
    # Here, not at the top: `kvfleet --help` builds this command's parser and must not pay for them.
    from gateway.drain import bind
    from gateway.listener import listen, release
    from gateway.metrics import MULTIPROCESS_DIR_ENV
    from services.nats_link import NATS_PASSWORD_ENV, NATS_USER_ENV
    from services.registry import REDIS_PASSWORD_ENV
    from services.transport.cluster_token import TOKEN_ENV, cluster_token
    from worker_svc.runtime.preflight import check_device, check_lora_modules, check_model

    configure_logging()
    # What can be checked here is, before anything starts; torch's build is the worker's to check.
    config = EngineConfig(**engine_args(args))
    checked = check_model(config)
    check_lora_modules(args.lora_modules or [], config, checked.config)
    check_device(config)
    _check_extra_models(args)
    listener = listen(args)
    listener.listen()  # from now on connections wait in its backlog until a gateway takes them
    # Held until the roles' ports are picked, so that none of them takes it.
    engine_port_held = bind(args.host, args.engine_port) if args.engine_port is not None else None
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())
    local = "127.0.0.1"
    ports: dict[str, int] = {}
    # NATS and Redis say little worth reading next to the roles: their lines go to files.
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-cluster-"))
    # NATS and Redis take clients with this cluster's credentials only; the servers read
    # them from files only their owner can read, the roles from their environment.
    nats_password, redis_password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    # A step's output for one gateway is one NATS message: NATS's most (64 MB, not its
    # default 1 MB) lets through logprobs of the whole vocabulary (--max-logprobs -1).
    nats_config = write_secret_file(log_dir / "nats.conf",
                                    f'authorization {{ user: kvfleet, password: "{nats_password}" }}\n'
                                    "max_payload: 64MB\n")
    redis_config = write_secret_file(log_dir / "redis.conf", f"requirepass {redis_password}\n")
    infra: list[Supervised] = []
    roles: list[Supervised] = []  # in start order; stopped in reverse
    gateways: list[Supervised] = []  # the last of the roles
    exit_code = 0
    try:
        for name, start, config in (("nats", start_nats, nats_config), ("redis", start_redis, redis_config)):
            log = log_dir / f"{name}.log"
            # On another port if it dies before it listens; restarted later on the port it got, which the roles know.
            started = start_listening(partial(start, local, config=config), local, log)
            ports[name] = started.port
            infra.append(Supervised(name, partial(_logged, start, local, started.port, log, config)))
            infra[-1].adopt(started.process)
        logger.info("NATS on nats://%s:%d, Redis on redis://%s:%d; their logs: %s", local, ports["nats"], local,
                    ports["redis"], log_dir)
        cluster = ["--redis-url", f"redis://{local}:{ports['redis']}/0", "--lease-ttl", str(args.lease_ttl),
                   "--shutdown-timeout", str(args.shutdown_timeout)]
        nats = ["--nats-url", f"nats://{local}:{ports['nats']}"]
        engine = engine_argv(args)
        engine_door = [] if args.engine_port is None else [
            "--engine-host", args.host, "--engine-port", str(args.engine_port),
            *(["--served-model-name", *args.served_model_name] if args.served_model_name else [])]
        template = ["--chat-template", args.chat_template] if args.chat_template else []
        commands = _model_roles("", engine, [*engine_argv(args, only=TOKENIZER_FIELDS), *template],
                                args.data_parallel_size, [*nats, *cluster, *engine_door], cluster)
        for extra in args.extra_model:  # each its own roles, with its own flags only
            commands += _model_roles(f" {extra.name}", extra.argv(), extra.argv(TOKENIZER_FIELDS),
                                     extra.flags.data_parallel_size, [*nats, *cluster], cluster)
        # --host and --port are then only what the gateway's registry entry says.
        gateway = ["gateway", "--model", args.model, "--host", args.host, "--port", str(args.port), *nats, *cluster,
                   "--listen-fd", str(listener.fileno()), *gateway_argv(args),
                   "--migration-wait", str(args.migration_wait),
                   *(f"--extra-model={extra.name}" for extra in args.extra_model)]
        # The API key and the cluster token travel in the environment, never on a command
        # line others can read; a token of this cluster's own when none is given.
        env = {key: value for key, value in os.environ.items() if key != "KVFLEET_API_KEY"}
        env["PYTHONUNBUFFERED"] = "1"  # each line shows when written, in order with the others'
        if args.api_key:
            env["KVFLEET_API_KEY"] = args.api_key
        if cluster_token() is None:
            env[TOKEN_ENV] = secrets.token_urlsafe(32)
        env.update({NATS_USER_ENV: "kvfleet", NATS_PASSWORD_ENV: nats_password, REDIS_PASSWORD_ENV: redis_password})
        if engine_port_held is not None:
            engine_port_held.close()  # the scheduler binds it
        for label, _, command in commands:
            argv = [sys.executable, "-m", "kvfleet.cli", *command]
            role = Supervised(label, lambda name=label, argv=argv: spawn_labelled(name, argv, env))
            role.launch()
            roles.append(role)
        gateway_env = dict(env)
        if args.api_server_count > 1:  # their counters in shared files (gateway/metrics.py)
            shared_metrics = log_dir / "prometheus"
            shared_metrics.mkdir()
            gateway_env[MULTIPROCESS_DIR_ENV] = str(shared_metrics)
        argv = [sys.executable, "-m", "kvfleet.cli", *gateway]
        for index in range(args.api_server_count):
            name = "gateway" if args.api_server_count == 1 else f"gateway {index + 1}"
            role = Supervised(name, lambda name=name: spawn_labelled(name, argv, gateway_env,
                                                                     pass_fds=(listener.fileno(),)))
            role.launch()
            roles.append(role)
            gateways.append(role)
        for label, port, _ in commands:
            logger.info("%s: gRPC on %s:%d", label, local, port)
        where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
        logger.info("%s: %s (OpenAI API at /v1)", "gateway" if len(gateways) == 1 else f"{len(gateways)} gateways",
                    where)
        if args.engine_port is not None:
            logger.info("scheduler: vLLM's gRPC engine protocol on %s:%d", args.host, args.engine_port)
        exit_code = _supervise(args, infra + roles, stopping)
    finally:
        # The gateways first, together: they drain while the rest still serves. Once they
        # are gone nobody holds the socket, and new clients are refused.
        listener.close()
        stop_together([part.process for part in gateways if part.process is not None],
                      args.shutdown_timeout + STOP_MARGIN_S)
        for part in reversed(roles):
            if part.process is not None and part not in gateways:
                stop(part.process, args.shutdown_timeout + STOP_MARGIN_S)
        for part in infra:
            if part.process is not None:
                stop(part.process)
    release(listener, args.uds)
    logger.info("cluster stopped")
    return exit_code


def _model_roles(suffix: str, engine: list[str], tokenizer: list[str], replicas: int, scheduler: list[str],
                 cluster: list[str]) -> list[tuple[str, int, list[str]]]:
    """(label, port, command) of one model's roles: its tokenizer, then a worker and its
    scheduler per replica (--data-parallel-size), on free loopback ports. `suffix` tells
    an extra model's labels apart; `scheduler`: the flags only the schedulers take."""
    local = "127.0.0.1"
    port = free_port(local)
    roles = [(f"tokenizer{suffix}", port, ["tokenizer", *tokenizer, "--host", local, "--port", str(port), *cluster])]
    for index in range(replicas):
        number = f" {index + 1}" if replicas > 1 else ""
        worker, scheduler_port = free_port(local), free_port(local)
        roles += [
            (f"worker{suffix}{number}", worker, ["worker", *engine, "--host", local, "--port", str(worker), *cluster]),
            (f"scheduler{suffix}{number}", scheduler_port,
             ["scheduler", *engine, "--host", local, "--port", str(scheduler_port), "--worker-address",
              f"{local}:{worker}", *scheduler]),
        ]
    return roles


def _check_extra_models(args: argparse.Namespace) -> None:
    """Each extra model as the main one is checked, before anything starts."""
    from worker_svc.runtime.preflight import check_device, check_model

    names = [args.model, *(extra.name for extra in args.extra_model)]
    for name in {name for name in names if names.count(name) > 1}:
        raise ConfigError(f"--extra-model {name}: served twice; each model is served once, by its name")
    if args.served_model_name and set(args.served_model_name) & set(names[1:]):
        raise ConfigError("--served-model-name: names an --extra-model; clients name each extra model by its MODEL")
    for extra in args.extra_model:
        check_model(extra.config)
        check_device(extra.config)
    if args.engine_port is not None and args.data_parallel_size > 1:
        raise ConfigError(f"--engine-port with --data-parallel-size {args.data_parallel_size}: each replica's "
                          "scheduler would serve vLLM's engine protocol on the one port; run one replica, or "
                          "start the schedulers by hand, each on a port of its own")


def _logged(start: Callable[..., subprocess.Popen], host: str, port: int, path: Path, config: Path) -> subprocess.Popen:
    """`start` with its `config` file, the process's output appended to `path`."""
    with path.open("ab") as log:  # the child holds its own copy once started; each restart opens anew
        return start(host, port, config, stdout=log, stderr=subprocess.STDOUT)


def _supervise(args: argparse.Namespace, parts: list[Supervised], stopping: threading.Event) -> int:
    """Until a signal, or a part refusing its configuration (its exit code): restarts
    whatever exits, and announces when the cluster serves."""
    serving = False
    while not stopping.wait(0.5):
        for part in parts:
            if part.misconfigured:
                logger.error("%s refused its configuration (its line above says why); stopping the cluster", part.name)
                return CONFIG_ERROR_EXIT
            part.check()
        if not serving and _healthy(args):
            serving = True
            logger.info("cluster serving on %s", f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}")
    return 0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=1.0)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _healthy(args: argparse.Namespace) -> bool:
    """Whether a gateway answers 200 on /health."""
    if args.uds:
        connection = _UnixConnection(args.uds)
    else:
        connection = http.client.HTTPConnection("127.0.0.1" if args.host in ("0.0.0.0", "") else args.host, args.port,
                                                timeout=1.0)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()
