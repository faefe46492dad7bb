"""Stress, not in the default suite: starts and stops the tests' nats-server and
Redis-compatible server (tests/servers.py, as the fixtures do) a few hundred times
beside two busy processes, from a process that has gRPC active, as a test worker that
ran gRPC tests before has. There, children started by fork() (subprocess with a
preexec_fn) died of SIGABRT before exec now and then: gRPC's fork handler restarted
its epoll poller in the child (kvfleet/processes.py says more). Any start that fails
fails the run; an early death that a second start on another port covered is counted.

    PYTHONPATH=$PWD .venv/bin/python tests/stress/server_starts.py [--cycles 300]
"""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for servers.py

from kvfleet.processes import ServerStartError  # noqa: E402

from servers import nats_server, redis_server  # noqa: E402

BUSY = "while True: pass"


class EarlyDeaths(logging.Handler):
    """Counts the warnings of a server that died before it listened and was started again."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        print(record.getMessage(), file=sys.stderr)


class GrpcInUse:
    """A gRPC server here, and two threads calling it, until `stop`."""

    def __init__(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stopping = threading.Event()
        self.callers = [threading.Thread(target=self._call) for _ in range(2)]
        for caller in self.callers:
            caller.start()

    def _call(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while not self.stopping.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    def stop(self) -> None:
        self.stopping.set()
        for caller in self.callers:
            caller.join()
        self.channel.close()
        self.server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300, help="each starts and stops both servers")
    args = parser.parse_args()
    deaths = EarlyDeaths()
    logging.getLogger("kvfleet.processes").addHandler(deaths)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    grpc_in_use = GrpcInUse()
    failures = 0
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="kvfleet-stress-") as logs:
            for cycle in range(args.cycles):
                for start in (nats_server, redis_server):
                    log_dir = Path(logs) / f"{cycle}"
                    log_dir.mkdir(exist_ok=True)
                    try:
                        with start(log_dir):
                            pass
                    except ServerStartError as error:
                        failures += 1
                        print(f"cycle {cycle}: {error}", file=sys.stderr)
    finally:
        grpc_in_use.stop()
        for process in busy:
            process.kill()
            process.wait()
    print(f"{2 * args.cycles} starts ({args.cycles} nats-server, {args.cycles} Redis) beside 2 busy processes, "
          f"gRPC in use: {failures} failed, {deaths.count} died before listening and started again, "
          f"in {time.monotonic() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
