#!/usr/bin/env python3
"""kvfleet-probe: health checks for containers that have Python but neither curl nor
grpc_health_probe. The images install it as /usr/local/bin/kvfleet-probe.

  kvfleet-probe grpc HOST:PORT [--service NAME]  exit 0 if grpc.health.v1 answers SERVING
  kvfleet-probe http URL                         exit 0 on a 2xx answer
  kvfleet-probe wait-closed HOST:PORT            return once nothing listens on HOST:PORT

docker-compose.yml uses the first two as health checks. In the Helm chart, a
replica's worker runs `wait-closed` on its scheduler's port as its preStop hook, so
it gets SIGTERM only after the scheduler has drained and exited.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
import urllib.error
import urllib.request


def check_grpc(address: str, service: str, timeout: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return False
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}", file=sys.stderr)
    return serving


def check_http(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError) as error:  # HTTPError (4xx, 5xx) is a URLError
        print(f"{url}: {error}", file=sys.stderr)
        return False


def wait_closed(address: str, timeout: float, interval: float = 0.5) -> bool:
    host, port = _split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=interval).close()
        except OSError:
            return True
        if time.monotonic() >= deadline:
            print(f"{address}: still open after {timeout:g} s", file=sys.stderr)
            return False
        time.sleep(interval)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet-probe", description=__doc__.split("\n\n")[0])
    checks = parser.add_subparsers(dest="check", required=True)
    grpc_check = checks.add_parser("grpc", help="grpc.health.v1 Check: exit 0 if SERVING")
    grpc_check.add_argument("address", metavar="HOST:PORT")
    grpc_check.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    grpc_check.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    http_check = checks.add_parser("http", help="GET: exit 0 on a 2xx answer")
    http_check.add_argument("url")
    http_check.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    closed = checks.add_parser("wait-closed", help="return once nothing listens on HOST:PORT")
    closed.add_argument("address", metavar="HOST:PORT")
    closed.add_argument("--timeout", type=float, default=60.0, help="give up (exit 1) after this many seconds")
    args = parser.parse_args(argv)

    if args.check == "grpc":
        ok = check_grpc(args.address, args.service, args.timeout)
    elif args.check == "http":
        ok = check_http(args.url, args.timeout)
    else:
        ok = wait_closed(args.address, args.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
