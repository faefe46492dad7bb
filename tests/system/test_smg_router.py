"""The real Shepherd Model Gateway (PyPI smg: a Rust router that tokenizes, routes and
serves the OpenAI API itself) in front of a kvfleet replica: `kvfleet cluster up
--engine-port`, whose scheduler serves vLLM's gRPC engine protocol there, and smg
pointed at it with `--worker-urls grpc://...`. smg takes the tokenizer from the replica
(GetTokenizer: the GGUF's own tokenizer, sent as HF files). Driven by the official
openai client, the same requests to smg and to kvfleet's own gateway on the same
replica: greedy chat and completion equal, stop strings, streaming; a cancelled stream
aborted on the replica, health and the model list, and smg holding its KV event
subscription."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai_servers import API_KEY, SERVED, running_server
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from kvfleet.processes import free_port, stop

NEW_TOKENS = 12
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
STOP = " color"  # what greedy decoding of PROMPT says within NEW_TOKENS
# smg gives up on a KV event subscription that has answered nothing (not even headers) by then.
KV_SUBSCRIBE_TIMEOUT_S = 2.0
# Far more tokens than a cancelled stream lets the replica make before it is idle again.
LONG_STREAM_TOKENS = 400
READY_TIMEOUT_S = 120.0
SMG = Path(sys.executable).with_name("smg")


@dataclass
class Stack:
    client: openai.OpenAI  # smg's
    gateway: openai.OpenAI  # kvfleet's own, on the same replica
    base_url: str
    engine: pb_grpc.VllmEngineStub
    log: Path
    ready_at: float

    def running(self) -> int:
        [load] = self.engine.GetLoads(pb.GetLoadsRequest(), timeout=5).loads
        return load.num_running_reqs + load.num_waiting_reqs


def _wait_ready(base_url: str, router: subprocess.Popen, log: Path) -> None:
    """Until smg answers a completion: it loads the replica's tokenizer after it starts listening."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    while time.monotonic() < deadline:
        assert router.poll() is None, log.read_text(errors="replace")[-4000:]
        try:
            if httpx.post(f"{base_url}/v1/completions", json=body, timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"smg not ready after {READY_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine_port, http_port, metrics_port = (free_port() for _ in range(3))
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with running_server("cluster", tmp_path_factory, "--engine-port", str(engine_port)) as cluster:
        router = None
        channel = grpc.insecure_channel(f"127.0.0.1:{engine_port}")
        try:
            engine = pb_grpc.VllmEngineStub(channel)
            grpc.channel_ready_future(channel).result(timeout=READY_TIMEOUT_S)
            assert engine.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy, cluster.log_tail()
            with log.open("w") as output:
                # Its metrics port too: the default (29000) is one port for the whole machine.
                router = subprocess.Popen(
                    [str(SMG), "launch", "--worker-urls", f"grpc://127.0.0.1:{engine_port}", "--host", "127.0.0.1",
                     "--port", str(http_port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                     str(metrics_port), "--shutdown-grace-period-secs", "1", "--log-level", "warn"],
                    env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=output, stderr=subprocess.STDOUT)
            base_url = f"http://127.0.0.1:{http_port}"
            _wait_ready(base_url, router, log)
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
            gateway = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
            yield Stack(client, gateway, base_url, engine, log, time.monotonic())
        finally:
            if router is not None:
                stop(router, grace_s=10)
            channel.close()


def _wait_idle(stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.running():
        assert time.monotonic() < deadline, f"the replica still runs {stack.running()} request(s)"
        time.sleep(0.05)


def test_health_and_the_model_list(stack: Stack) -> None:
    assert httpx.get(f"{stack.base_url}/health", timeout=10).status_code == 200
    assert [model.id for model in stack.client.models.list()] == [SERVED]


def _completions(stack: Stack, **request) -> list:
    """The same greedy completion from smg and from kvfleet's gateway."""
    return [client.completions.create(model=SERVED, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS, **request)
            for client in (stack.client, stack.gateway)]


def test_greedy_chat_and_completion_equal_kvfleets_gateway(stack: Stack) -> None:
    smg, kvfleet = (client.chat.completions.create(model=SERVED, messages=CHAT, temperature=0, max_tokens=NEW_TOKENS)
                    for client in (stack.client, stack.gateway))
    assert smg.choices[0].message.content == kvfleet.choices[0].message.content
    assert smg.choices[0].message.content
    smg, kvfleet = _completions(stack)
    assert smg.choices[0].text == kvfleet.choices[0].text
    assert smg.usage.completion_tokens == kvfleet.usage.completion_tokens == NEW_TOKENS


def test_a_stop_string_cuts_the_completion_as_kvfleets_gateway_does(stack: Stack) -> None:
    smg, kvfleet = _completions(stack, stop=[STOP])
    assert kvfleet.choices[0].finish_reason == "stop", "STOP must be something the model says"
    assert (smg.choices[0].text, smg.choices[0].finish_reason) == (kvfleet.choices[0].text, "stop")
    _wait_idle(stack, timeout_s=5.0)


def test_streamed_chat_equals_kvfleets_gateway(stack: Stack) -> None:
    texts, counts = [], []
    for client in (stack.client, stack.gateway):
        chunks = list(client.chat.completions.create(model=SERVED, messages=CHAT, temperature=0,
                                                     max_tokens=NEW_TOKENS, stream=True))
        texts.append("".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices))
        counts.append(len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]))
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("stop", "length")
    assert texts[0] == texts[1] and counts[0] > 1


def test_a_cancelled_stream_is_aborted_on_the_replica(stack: Stack) -> None:
    stream = stack.client.completions.create(model=SERVED, prompt=PROMPT, temperature=0,
                                             max_tokens=LONG_STREAM_TOKENS, stream=True,
                                             extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert stack.running() == 1
    stream.close()
    # Making the other ~400 tokens would take far longer than this.
    _wait_idle(stack, timeout_s=5.0)


def test_smg_holds_its_kv_event_subscription(stack: Stack) -> None:
    """The replica answers SubscribeKvEvents with headers at once: a subscription silent
    for 2 s makes smg veto the worker as unreachable and subscribe again, over and over."""
    time.sleep(max(0.0, stack.ready_at + 2 * KV_SUBSCRIBE_TIMEOUT_S - time.monotonic()))
    lines = stack.log.read_text(errors="replace").splitlines()
    dropped = [line for line in lines if "Failed to subscribe to KV events" in line or "Worker vetoed" in line]
    assert not dropped, "\n".join(dropped[:5])
