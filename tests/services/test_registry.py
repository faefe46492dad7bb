"""The role registry over a real Redis-compatible server: a lease lives while its
heartbeat runs and lapses within its TTL once the process holding it dies or turns
unhealthy; readiness follows the live leases."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.registry import ClusterView, Lease, Member, Registry, RegistryContinuity

from servers import redis_url  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
TTL_S = 1.0

_HOLD_LEASE = (
    "import sys, time\n"
    "from services.registry import Lease, Member, Registry\n"
    "Lease(Registry(sys.argv[1]), Member('worker', 'w-sub', '127.0.0.1:1'), ttl_s=float(sys.argv[2])).start()\n"
    "print('registered', flush=True)\n"
    "time.sleep(600)\n"
)


def ids(registry: Registry, role: str) -> list[str]:
    return [member.id for member in registry.members(role)]


def wait_until(condition, timeout_s: float) -> float:
    """Seconds until condition() held; fails after timeout_s."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_killed_process_drops_out_within_its_lease(redis_url: str) -> None:
    registry = Registry(redis_url)
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LEASE, redis_url, str(TTL_S)], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert process.stdout.readline().strip() == "registered"
        wait_until(lambda: "w-sub" in ids(registry, "worker"), 5)
        time.sleep(2 * TTL_S)  # renewed past its TTL while the process lives
        assert ids(registry, "worker") == ["w-sub"]
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert ids(registry, "worker") == ["w-sub"]  # nobody cleaned up: it just lapses...
        assert wait_until(lambda: not ids(registry, "worker"), 3 * TTL_S) <= TTL_S + 0.2  # ...within the TTL
    finally:
        process.kill()
        process.wait()
        registry.close()


def test_stop_removes_at_once_and_unhealthy_members_lapse(redis_url: str) -> None:
    registry = Registry(redis_url)
    healthy = threading.Event()
    member = Member("tokenizer", "t1", "127.0.0.1:2", {"model": "smollm2"})
    lease = Lease(registry, member, TTL_S, healthy=healthy.is_set).start()
    try:
        time.sleep(TTL_S / 2)
        assert ids(registry, "tokenizer") == []  # not listed before it can serve
        healthy.set()
        wait_until(lambda: ids(registry, "tokenizer") == ["t1"], 2 * TTL_S)
        assert registry.members("tokenizer") == [member]
        healthy.clear()
        wait_until(lambda: not ids(registry, "tokenizer"), 2 * TTL_S)
        healthy.set()
        wait_until(lambda: ids(registry, "tokenizer") == ["t1"], 2 * TTL_S)
    finally:
        lease.stop()
    assert ids(registry, "tokenizer") == []
    registry.close()


def test_readiness_follows_the_leases(redis_url: str) -> None:
    registry = Registry(redis_url)
    scheduler = Member("scheduler", "s1", "127.0.0.1:3", {"worker": "127.0.0.1:4"})
    other_worker = Member("worker", "w1", "127.0.0.1:5")
    worker = Member("worker", "w2", "127.0.0.1:4")
    tokenizer = Member("tokenizer", "t1", "127.0.0.1:6")
    with Lease(registry, scheduler, 30), Lease(registry, other_worker, 30):
        wait_until(lambda: len(ClusterView.read(registry).workers) == 1, 5)
        view = ClusterView.read(registry)
        assert not view.scheduler_ready(scheduler) and not view.gateway_ready  # its worker is not live
        with Lease(registry, worker, 30):
            wait_until(lambda: len(ClusterView.read(registry).workers) == 2, 5)
            view = ClusterView.read(registry)
            assert view.ready_schedulers == [scheduler] and not view.gateway_ready  # no tokenizer
            with Lease(registry, tokenizer, 30):
                wait_until(lambda: ClusterView.read(registry).gateway_ready, 5)
        assert ClusterView.read(registry).ready_schedulers == []  # its worker left
    registry.close()


def test_continuity_holds_from_a_readers_first_answer_and_restarts_after_a_gap() -> None:
    continuity = RegistryContinuity()
    assert not continuity.held_for(3.0, 0.0)  # nothing read yet
    continuity.answered("epoch-1", 0.0)
    assert continuity.held_for(3.0, 0.0)  # no earlier read of its own can be stale
    continuity.failed()
    continuity.answered("epoch-1", 10.0)  # back after a failed read: a TTL before it holds again
    assert not continuity.held_for(3.0, 12.0) and continuity.held_for(3.0, 13.0)
    continuity.answered("epoch-2", 20.0)  # Redis lost its keyspace between two reads
    assert not continuity.held_for(3.0, 22.0) and continuity.held_for(3.0, 23.0)
