"""Real nats-server and Redis-compatible server processes for tests, on free ports,
started the way `kvfleet cluster up` starts them (services/cluster.py)."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from services.cluster import free_port, start_nats, start_redis, stop, wait_for_port

HOST = "127.0.0.1"


@dataclass
class Server:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        stop(self.process, grace_s=5.0)


@contextmanager
def nats_server() -> Iterator[Server]:
    port = free_port(HOST)
    process = start_nats(HOST, port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(HOST, port, process)
        yield Server(f"nats://{HOST}:{port}", process)
    finally:
        stop(process, grace_s=5.0)


@contextmanager
def redis_server() -> Iterator[Server]:
    port = free_port(HOST)
    process = start_redis(HOST, port, stdout=subprocess.DEVNULL)
    try:
        wait_for_port(HOST, port, process)
        yield Server(f"redis://{HOST}:{port}/0", process)
    finally:
        stop(process, grace_s=5.0)


@pytest.fixture(scope="module")
def nats() -> Iterator[Server]:
    with nats_server() as server:
        yield server


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as server:
        yield server.url
