"""Real nats-server and Redis-compatible server processes for tests, on free ports,
started the way `kvfleet cluster up` starts them (kvfleet/processes.py), and kvfleet
roles as processes of their own."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from kvfleet.processes import start_listening, start_nats, start_redis, stop

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        stop(self.process, grace_s=5.0)


@contextmanager
def nats_server(log_dir: Path) -> Iterator[Server]:
    """Its output in `log_dir`/nats.log; started again on another port if it dies before it listens."""
    started = start_listening(partial(start_nats, HOST), HOST, log_dir / "nats.log")
    try:
        yield Server(f"nats://{HOST}:{started.port}", started.process)
    finally:
        stop(started.process, grace_s=5.0)


@contextmanager
def redis_server(log_dir: Path) -> Iterator[Server]:
    """As `nats_server`, its output in `log_dir`/redis.log."""
    started = start_listening(partial(start_redis, HOST), HOST, log_dir / "redis.log")
    try:
        yield Server(f"redis://{HOST}:{started.port}/0", started.process)
    finally:
        stop(started.process, grace_s=5.0)


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with nats_server(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


TORCH_REPORT = "kvfleet-test torch imported: "
# `kvfleet.cli` as `python -m` runs it, plus a last line, as the process exits, saying
# whether torch was ever imported in it.
_REPORTING_TORCH = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print({TORCH_REPORT!r} + str('torch' in sys.modules), flush=True))\n"
    "from kvfleet.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


class RoleProcess:
    """`kvfleet <role> <flags>` as a real process, its log kept (never a full pipe).
    Torch runs on one thread, as everywhere in the suite. `env` adds to the environment."""

    def __init__(self, role: str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.flags = flags
        self.env = env
        environment = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _REPORTING_TORCH, role, *flags],
            cwd=REPO, env=environment, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def log_tail(self, lines: int = 40) -> str:
        return f"--- {self.role} ---\n" + "".join(self.log[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then its exit code once it has drained."""
        self.process.terminate()
        code = self.process.wait(timeout_s)
        self._reader.join(5)
        return code

    def imported_torch(self) -> bool:
        """After the process exited: whether torch was ever imported in it."""
        reports = [line for line in self.log if line.startswith(TORCH_REPORT)]
        assert reports, self.log_tail()
        return reports[-1].removeprefix(TORCH_REPORT).strip() == "True"

    def restarted(self) -> RoleProcess:
        """The same command as a new process (on the same ports, where the flags name them)."""
        self.kill()
        return RoleProcess(self.role, *self.flags, env=self.env)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
