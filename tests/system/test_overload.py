"""Overload across the fleet (real processes: nats-server, Redis, a tokenizer, two
replicas whose schedulers run 2 requests and queue at most 2 more each, a gateway):
ten times more concurrent requests than the queues hold get a mix of 200 and 429
(with Retry-After), never a 5xx; every accepted request completes, and /metrics
counts the rejections."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvfleet.processes import free_port
from services.registry import ClusterView, Registry

from servers import HOST, RoleProcess, nats, redis_url  # noqa: F401  (fixtures)
from test_worker_failover import health, wait_for

QUEUED = 2
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(128 * 2**20),
                "--max-num-seqs", "2"]
REQUESTS = 10 * 2 * QUEUED
TOKENS = 24


@pytest.fixture(scope="module")
def gateway(nats, redis_url) -> Iterator[str]:
    registry = ["--redis-url", redis_url, "--lease-ttl", "3"]
    roles = [RoleProcess("tokenizer", "--port", "0", *registry)]
    for _ in range(2):
        worker_port = free_port()
        roles.append(RoleProcess("worker", *ENGINE_FLAGS, "--port", str(worker_port), *registry))
        roles.append(RoleProcess("scheduler", *ENGINE_FLAGS, "--port", str(free_port()), "--worker-address",
                                 f"{HOST}:{worker_port}", "--max-queued-requests", str(QUEUED),
                                 "--nats-url", nats.url, *registry))
    port = free_port()
    roles.append(RoleProcess("gateway", "--port", str(port), "--nats-url", nats.url, *registry))
    url = f"http://{HOST}:{port}"
    leases = Registry(redis_url)
    try:
        wait_for(lambda: health(url) == 200 and len(ClusterView.read(leases).ready_schedulers) == 2, 180,
                 "the cluster did not come up", roles)
        yield url
    finally:
        for role in roles:
            role.kill()
        leases.close()


def test_a_flood_gets_429s_never_a_5xx_and_what_is_accepted_completes(gateway: str) -> None:
    replies: list[httpx.Response] = []
    lock = threading.Lock()
    barrier = threading.Barrier(REQUESTS)

    def send(index: int) -> None:
        body = {"model": "smollm2", "prompt": f"Request {index}: once upon a time", "max_tokens": TOKENS,
                "temperature": 0, "ignore_eos": True}
        barrier.wait()
        reply = httpx.post(f"{gateway}/v1/completions", json=body, timeout=300)
        with lock:
            replies.append(reply)

    senders = [threading.Thread(target=send, args=(index,)) for index in range(REQUESTS)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(300)
    statuses = sorted(reply.status_code for reply in replies)
    odd = [(reply.status_code, reply.text[:300]) for reply in replies if reply.status_code not in (200, 429)]
    assert len(replies) == REQUESTS and set(statuses) == {200, 429}, (statuses, odd)
    for reply in replies:
        if reply.status_code == 200:
            assert reply.json()["usage"]["completion_tokens"] == TOKENS
            assert reply.json()["choices"][0]["finish_reason"] == "length"
        else:
            assert reply.headers["Retry-After"] == "1" and "queue is full" in reply.json()["error"]["message"]
    metrics = httpx.get(f"{gateway}/metrics", timeout=5).text
    [rejected] = [line for line in metrics.splitlines() if line.startswith("kvfleet:requests_rejected_total{")]
    assert float(rejected.rsplit(" ", 1)[1]) == statuses.count(429)
