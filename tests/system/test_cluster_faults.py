"""The cluster never fails healthy work (real processes: nats-server, Redis, tokenizer,
worker, scheduler, gateway), with witness streams in flight through each fault:

- four valid but heavy requests at once (beam search of width 128 twice, n=128, best_of=128)
  are served, and every witness stream completes: submits travel batched, and a slow
  answer from a busy scheduler is no evidence that it died;
- Redis killed and restarted empty mid-stream: every stream completes, nothing is orphaned;
- nats-server killed and restarted mid-stream: every stream completes with exactly the
  text of an uninterrupted run (what NATS lost is replayed by the scheduler), and a
  request that arrives while NATS is away is served too;
- each process paused (SIGSTOP) for half a lease TTL mid-stream, one after another
  (Redis, NATS, the tokenizer, the worker, the scheduler, the gateway): a late heartbeat,
  not a death; every stream completes whole and a request sent during the pause is served;
- a scheduler killed and restarted at once on its address, its old lease still standing:
  the successor takes the new requests, and the old lease lapsing fails none of them;
- a scheduler killed mid-stream: its clients hear of it within a second (its channel
  fails), not a lease later, and its worker, which drops the dead scheduler's requests,
  exits within 3 s of a SIGTERM.
They run in this order on one cluster: the last fault ends it.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import httpx
import openai
import pytest

from kvfleet.processes import free_port, start_listening, start_nats, start_redis, stop, wait_for_port

from servers import HOST, RoleProcess
from streamed_chat import StreamedChat, in_flight
from test_worker_failover import health, wait_for

# Latency bounds under a second: run alone (see pyproject's markers).
pytestmark = pytest.mark.serial

LEASE_TTL_S = 3.0
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(512 * 2**20)]
WITNESS_TOKENS = 48


def witness_request(index: int) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": f"Count from {index} upwards."}],
            "max_tokens": WITNESS_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


def witnesses(url: str, count: int = 8) -> list[StreamedChat]:
    """Streams that have each received a token: all of them in flight."""
    return in_flight(url, [witness_request(index) for index in range(count)])


@dataclass
class Cluster:
    url: str
    redis_port: int
    redis: subprocess.Popen
    nats_port: int
    nats: subprocess.Popen
    roles: dict[str, RoleProcess]

    def logs(self) -> str:
        return "\n".join(role.log_tail() for role in self.roles.values())

    def scheduler_idle(self) -> bool:
        metrics = httpx.get(f"{self.url}/metrics", timeout=5).text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")]
        return bool(running) and all(float(line.rsplit(" ", 1)[1]) == 0 for line in running)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("servers")
    redis = start_listening(partial(start_redis, HOST), HOST, logs / "redis.log")
    nats = start_listening(partial(start_nats, HOST), HOST, logs / "nats.log")
    nats_url = f"nats://{HOST}:{nats.port}"
    registry = ["--redis-url", f"redis://{HOST}:{redis.port}/0", "--lease-ttl", str(LEASE_TTL_S)]
    worker_address, gateway_port = f"{HOST}:{free_port()}", free_port()
    roles = {
        "tokenizer": RoleProcess("tokenizer", "--port", "0", *registry),
        "worker": RoleProcess("worker", *ENGINE_FLAGS, "--port", worker_address.rsplit(":", 1)[1], *registry),
        "scheduler": RoleProcess("scheduler", *ENGINE_FLAGS, "--port", str(free_port()), "--worker-address", worker_address,
                                 "--nats-url", nats_url, *registry),
        "gateway": RoleProcess("gateway", "--port", str(gateway_port), "--nats-url", nats_url, *registry),
    }
    running = Cluster(f"http://{HOST}:{gateway_port}", redis.port, redis.process, nats.port, nats.process, roles)
    try:
        wait_for(lambda: health(running.url) == 200, 180, "the cluster is not healthy", list(roles.values()))
        yield running
    finally:
        for role in roles.values():
            role.kill()
        stop(running.redis, grace_s=5.0)
        stop(running.nats, grace_s=5.0)


def test_heavy_valid_requests_are_served_and_disturb_no_witness(cluster: Cluster) -> None:
    streams = witnesses(cluster.url)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a color."}]}
    heavy = [
        ("/v1/chat/completions", {**chat, "use_beam_search": True, "best_of": 128, "max_tokens": 6}),
        ("/v1/chat/completions", {**chat, "use_beam_search": True, "best_of": 128, "max_tokens": 6}),
        ("/v1/chat/completions", {**chat, "n": 128, "max_tokens": 8}),
        ("/v1/completions", {"model": "smollm2", "prompt": "Colors:", "best_of": 128, "max_tokens": 8}),
    ]
    statuses: list[int] = []

    def send(path: str, body: dict) -> None:
        statuses.append(httpx.post(f"{cluster.url}{path}", json=body, timeout=600).status_code)

    senders = [threading.Thread(target=send, args=request) for request in heavy]
    for sender in senders:
        sender.start()
    unhealthy = 0
    while any(sender.is_alive() for sender in senders):  # the gateway's health holds meanwhile
        unhealthy += health(cluster.url) != 200
        time.sleep(0.5)
    assert sorted(statuses) == [200] * 4, statuses
    assert all(stream.completed() for stream in streams), [(s.error, s.tokens) for s in streams]
    assert unhealthy == 0, cluster.logs()


def test_a_redis_restart_fails_no_stream_and_orphans_nothing(cluster: Cluster) -> None:
    streams = witnesses(cluster.url)
    cluster.redis.send_signal(signal.SIGKILL)
    cluster.redis.wait()
    time.sleep(3)
    cluster.redis = start_redis(HOST, cluster.redis_port, stdout=subprocess.DEVNULL)  # empty
    wait_for_port(HOST, cluster.redis_port, cluster.redis)
    assert all(stream.completed() for stream in streams), [(s.error, s.tokens) for s in streams]
    wait_for(cluster.scheduler_idle, 10, "requests still run on the scheduler", list(cluster.roles.values()))
    wait_for(lambda: health(cluster.url) == 200, 10, "/health is not 200", list(cluster.roles.values()))
    reply = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0).completions.create(
        model="smollm2", prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4


def test_a_nats_restart_loses_no_token(cluster: Cluster) -> None:
    streams = witnesses(cluster.url)
    cluster.nats.send_signal(signal.SIGKILL)
    cluster.nats.wait()
    time.sleep(0.5)
    streams.append(StreamedChat(cluster.url, witness_request(len(streams))))  # arrives while NATS is away
    time.sleep(0.5)
    cluster.nats = start_nats(HOST, cluster.nats_port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(HOST, cluster.nats_port, cluster.nats)
    assert all(stream.completed() for stream in streams), ([(s.error, s.tokens) for s in streams], cluster.logs())
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)
    for stream in streams:  # greedy: an uninterrupted run gives the same text
        reply = client.chat.completions.create(**stream.request)
        assert stream.text == reply.choices[0].message.content, stream.request
    wait_for(cluster.scheduler_idle, 10, "requests still run on the scheduler", list(cluster.roles.values()))


@pytest.mark.parametrize("paused", ["redis", "nats", "tokenizer", "worker", "scheduler", "gateway"])
def test_a_process_paused_for_half_a_lease_fails_no_stream(cluster: Cluster, paused: str) -> None:
    """Half a TTL: however late its last renewal came before the pause (a third of a TTL
    at most), its lease still stands when it resumes."""
    streams = witnesses(cluster.url, count=4)
    process = {"redis": cluster.redis, "nats": cluster.nats}.get(paused) or cluster.roles[paused].process
    process.send_signal(signal.SIGSTOP)
    try:
        streams.append(StreamedChat(cluster.url, witness_request(len(streams))))  # arrives during the pause
        time.sleep(LEASE_TTL_S / 2)
    finally:
        process.send_signal(signal.SIGCONT)
    assert all(stream.completed() for stream in streams), ([(s.error, s.tokens) for s in streams], cluster.logs())
    wait_for(cluster.scheduler_idle, 10, "requests still run on the scheduler", list(cluster.roles.values()))


def test_a_scheduler_restarted_on_its_address_serves_as_a_new_replica(cluster: Cluster) -> None:
    """Its successor serves on the same address while the dead one's lease still stands
    (for a TTL): requests go to the successor, and none is failed, or left hanging, when
    the old lease lapses."""
    doomed = witnesses(cluster.url, count=2)
    cluster.roles["scheduler"] = cluster.roles["scheduler"].restarted()  # kill -9, then the same command
    for stream in doomed:
        stream.join(30)
        assert isinstance(stream.error, openai.APIError), (stream.error, stream.tokens)
    roles = list(cluster.roles.values())
    wait_for(lambda: health(cluster.url) == 200, 60, "the restarted scheduler is not taken up", roles)
    streams = [StreamedChat(cluster.url, witness_request(index)) for index in range(8)]  # at once: the old lease stands
    assert all(stream.completed() for stream in streams), [(s.error, s.tokens) for s in streams]
    time.sleep(2 * LEASE_TTL_S)  # the old lease has lapsed by now, whatever its timing
    fresh = [StreamedChat(cluster.url, witness_request(index)) for index in range(2)]
    assert all(stream.completed() for stream in fresh), [(s.error, s.tokens) for s in fresh]


def test_a_dead_scheduler_reaches_its_clients_within_a_second(cluster: Cluster) -> None:
    streams = witnesses(cluster.url)
    cluster.roles["scheduler"].process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for stream in streams:
        stream.join(30)
        assert isinstance(stream.error, openai.APIError), (stream.error, stream.tokens)
        assert stream.failed_at - killed < 1.0, stream.failed_at - killed
    worker = cluster.roles["worker"]
    worker.process.send_signal(signal.SIGTERM)
    began = time.monotonic()
    assert worker.process.wait(10) == 0, worker.log_tail()
    assert time.monotonic() - began < 3.0, worker.log_tail()
