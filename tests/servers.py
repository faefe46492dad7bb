"""Real nats-server and Redis-compatible server processes for tests, on free ports,
started the way `kvfleet cluster up` starts them (services/cluster.py), and kvfleet
roles as processes of their own."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cluster import free_port, start_nats, start_redis, stop, wait_for_port

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


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


class RoleProcess:
    """`kvfleet <role> <flags>` as a real process, its log kept (never a full pipe).
    Torch runs on one thread, as everywhere in the suite."""

    def __init__(self, role: str, *flags: str) -> None:
        self.role = role
        env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.cli", role, *flags],
            cwd=REPO, env=env, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def log_tail(self, lines: int = 40) -> str:
        return f"--- {self.role} ---\n" + "".join(self.log[-lines:])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
