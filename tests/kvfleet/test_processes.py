"""Starting the real nats-server and Redis-compatible server: one that dies before it
listens is started again on another port, its log kept; children start without running
this process's fork handlers, and die with their launcher."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from kvfleet.processes import ServerStartError, free_port, spawn, start_listening, start_nats, start_redis, stop

HOST = "127.0.0.1"
SERVERS = {"nats": partial(start_nats, HOST), "redis": partial(start_redis, HOST)}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket holds: a server started there fails to bind, and exits. Bound
    but not listening, so that nothing answers there meanwhile as if the server did."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        yield holder.getsockname()[1]


@pytest.mark.parametrize("server", SERVERS)
def test_a_server_that_dies_before_it_listens_is_started_again_on_another_port(
        server: str, taken_port: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ports = iter([taken_port, free_port(HOST)])
    log = tmp_path / f"{server}.log"
    with caplog.at_level(logging.WARNING, logger="kvfleet.processes"):
        started = start_listening(SERVERS[server], HOST, log, pick_port=lambda: next(ports))
    try:
        assert started.port != taken_port
        socket.create_connection((HOST, started.port), timeout=5).close()
        # The first start's own words stay in the log, and in the warning about it.
        first_start = log.read_text()
        assert "address already in use" in first_start.lower(), first_start
        [warning] = caplog.records
        assert f"port {taken_port} (start 1 of 3)" in warning.getMessage()
        assert "address already in use" in warning.getMessage().lower()
    finally:
        stop(started.process, grace_s=5.0)


@pytest.mark.parametrize("server", SERVERS)
def test_another_process_listening_on_the_port_is_not_taken_for_the_server(server: str, tmp_path: Path) -> None:
    """Another launcher's server may take the port between our pick and our start: it
    answers there at once, before ours fails to bind, and must not pass for ours."""
    with socket.socket() as other:
        other.bind((HOST, 0))
        other.listen()
        taken = other.getsockname()[1]
        ports = iter([taken, free_port(HOST)])
        started = start_listening(SERVERS[server], HOST, tmp_path / f"{server}.log", pick_port=lambda: next(ports))
    try:
        assert started.port != taken
        assert started.process.poll() is None
    finally:
        stop(started.process, grace_s=5.0)


@pytest.mark.parametrize("server", SERVERS)
def test_a_server_that_never_listens_fails_with_its_log_tail(server: str, taken_port: int, tmp_path: Path) -> None:
    log = tmp_path / f"{server}.log"
    with pytest.raises(ServerStartError, match="(?is)exited with 1 before listening, 2 times.*address already in use"):
        start_listening(SERVERS[server], HOST, log, attempts=2, pick_port=lambda: taken_port)
    assert log.read_text().lower().count("address already in use") == 2  # both starts' output, kept


def _python(code: str, **kwargs: object) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", code], env=environment, text=True, **kwargs)  # type: ignore[call-overload]


def test_a_child_starts_without_its_launchers_fork_handlers(tmp_path: Path) -> None:
    """No library's fork handler runs in the child: gRPC's aborted children before they
    could exec (SIGABRT, "epoll_wait error: Bad file descriptor"). A Python one stands
    in for them here: they run, or not, together (only on fork(), not vfork())."""
    marker = tmp_path / "fork handler ran"
    launcher = _python(
        "import os, sys\n"
        "from kvfleet.processes import spawn\n"
        f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
        "sys.exit(spawn(['true']).wait())\n")
    assert launcher.wait(30) == 0
    assert not marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_launcher() -> None:
    launcher = _python("import time\nfrom kvfleet.processes import spawn\n"
                       "print(spawn(['sleep', '60']).pid, flush=True)\ntime.sleep(60)\n", stdout=subprocess.PIPE)
    child = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"pid {child} outlived its launcher"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_missing_program_is_refused_at_spawn() -> None:
    with pytest.raises(FileNotFoundError):
        spawn(["kvfleet-no-such-program"])
