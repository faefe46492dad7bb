"""Graceful shutdown against real processes, with streams in flight.

`kvfleet serve` and a cluster (gateway, scheduler and worker over real NATS and Redis)
each get SIGTERM while the official openai client reads several streams. Right
away /health answers 503, a new request gets an OpenAI-style 503 (the scheduler: gRPC
UNAVAILABLE; scheduler and worker health: NOT_SERVING); then every stream in flight
runs to its last token (max_tokens with ignore_eos: exactly that many, finish_reason
"length"), and every process exits 0.

The cluster's leases are short (2 s) and its streams outlast them: a draining scheduler
must keep its lease, or its gateway would fail the requests it still runs. (The
tokenizer role is only a registry entry here, which the gateway needs to be ready:
tests/system/test_grpc_roles.py stops a real one.)
"""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.processes import free_port
from services.sampling_params import SamplingParams
from services.scheduler_messages import SubmitRequest
from services.transport.role_services import SCHEDULER

from servers import RoleProcess, nats, redis_url  # noqa: F401  (fixtures)

HOST = "127.0.0.1"
# 3 streams of up to 256 tokens (a chat prompt is some 35, its system prompt included): 16 blocks each.
# 200 new tokens keep them in flight for seconds even where 4-bit decode runs at 100 tokens/s.
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "48", "--max-model-len", "256"]
NEW_TOKENS = 200
LEASE_TTL_S = 2.0


def terminate(*processes: RoleProcess) -> None:
    for process in processes:
        process.process.send_signal(signal.SIGTERM)


def assert_exits_0(process: RoleProcess) -> None:
    assert process.process.wait(30) == 0, process.log_tail()


@pytest.fixture
def processes():
    started: list[RoleProcess] = []

    def start(*args: str) -> RoleProcess:
        started.append(RoleProcess(*args))
        return started[-1]

    yield start
    for process in started:
        process.kill()


def http_status(url: str, body: dict | None = None) -> tuple[int | None, dict | None]:
    """(status, JSON body) of a GET, or of a POST of `body`; (None, None) if nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, None
    except urllib.error.HTTPError as error:
        text = error.read()
        return error.code, json.loads(text) if text else None
    except OSError:
        return None, None


def wait_healthy(base: str, *processes: RoleProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while http_status(f"{base}/health")[0] != 200:
        for process in processes:
            assert process.process.poll() is None, process.log_tail()
        assert time.monotonic() < deadline, "\n".join(p.log_tail() for p in processes)
        time.sleep(0.2)


class Stream(threading.Thread):
    """One streamed completion (chat or legacy) through the openai client, read on a thread."""

    def __init__(self, client: openai.OpenAI, chat: bool, index: int) -> None:
        super().__init__(daemon=True)
        self.client, self.chat, self.index = client, chat, index
        self.first_token = threading.Event()
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        common = dict(model="smollm2", max_tokens=NEW_TOKENS, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        try:
            if self.chat:
                chunks = self.client.chat.completions.create(
                    messages=[{"role": "user", "content": f"Count to {self.index + 3}."}], **common)
            else:
                chunks = self.client.completions.create(prompt=f"Once upon a time, {self.index}", **common)
            for chunk in chunks:
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content if self.chat else choice.text:
                        self.first_token.set()
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except BaseException as exc:
            self.error = exc
        finally:
            self.first_token.set()


def start_streams(base: str, count: int = 3) -> list[Stream]:
    """Streams that have each received a token: all of them in flight."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    streams = [Stream(client, chat=i % 2 == 0, index=i) for i in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(60) and stream.error is None, stream.error
    return streams


def assert_draining_gateway(base: str) -> None:
    """/health fails at once, and a new request gets an OpenAI-style 503 (not a refused connection)."""
    deadline = time.monotonic() + 2.0
    while (status := http_status(f"{base}/health")[0]) != 503:
        assert status == 200 and time.monotonic() < deadline, f"/health answered {status}"
        time.sleep(0.02)
    status, body = http_status(f"{base}/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
    assert status == 503, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and "shutting down" in body["error"]["message"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert refused.value.status_code == 503


def assert_in_flight(streams: list[Stream]) -> None:
    assert all(stream.finish_reason is None for stream in streams), "a stream ended before the signal"


def assert_streams_completed(streams: list[Stream]) -> None:
    for stream in streams:
        stream.join(60)
        assert not stream.is_alive() and stream.error is None, stream.error
        assert (stream.finish_reason, stream.completion_tokens) == ("length", NEW_TOKENS)


def test_serve_drains_open_streams_on_sigterm_then_exits_0(processes) -> None:
    port = free_port()
    base = f"http://{HOST}:{port}"
    server = processes("serve", *ENGINE_FLAGS, "--host", HOST, "--port", str(port), "--shutdown-timeout", "60")
    wait_healthy(base, server)
    streams = start_streams(base)

    assert_in_flight(streams)
    terminate(server)
    assert_draining_gateway(base)
    assert_streams_completed(streams)
    assert_exits_0(server)
    assert any("drained" in line for line in server.log), server.log_tail()


def grpc_status(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def wait_not_serving(address: str) -> None:
    deadline = time.monotonic() + 2.0
    while (status := grpc_status(address)) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline, status
        time.sleep(0.02)


def test_a_cluster_drains_open_streams_on_sigterm_then_exits_0(processes, nats, redis_url) -> None:
    ports = {name: free_port() for name in ("gateway", "scheduler", "worker")}
    address = {name: f"{HOST}:{port}" for name, port in ports.items()}
    common = ["--host", HOST, "--redis-url", redis_url, "--lease-ttl", str(LEASE_TTL_S), "--shutdown-timeout", "60"]
    processes("tokenizer", "--port", "0", *common)  # the gateway's text work
    worker = processes("worker", *ENGINE_FLAGS, "--port", str(ports["worker"]), *common)
    scheduler = processes("scheduler", *ENGINE_FLAGS, "--port", str(ports["scheduler"]), *common,
                          "--worker-address", address["worker"], "--nats-url", nats.url)
    gateway = processes("gateway", "--port", str(ports["gateway"]), *common, "--nats-url", nats.url)
    base = f"http://{address['gateway']}"
    wait_healthy(base, worker, scheduler, gateway)
    streams = start_streams(base)

    # What a deleted replica pod and gateway pod get, all at once.
    assert_in_flight(streams)
    terminate(gateway, scheduler, worker)
    assert_draining_gateway(base)
    wait_not_serving(address["scheduler"])
    wait_not_serving(address["worker"])
    with grpc.insecure_channel(address["scheduler"]) as channel, pytest.raises(grpc.RpcError) as refused:
        SCHEDULER.stub(channel).Submit(SubmitRequest(
            request_id="late", prompt_token_ids=[1, 2, 3], gateway_id="someone",
            sampling_params=SamplingParams(max_tokens=4),
        ), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()

    assert_streams_completed(streams)  # they outlast the leases' TTL: the draining scheduler keeps its lease
    for process in (gateway, scheduler, worker):
        assert_exits_0(process)
