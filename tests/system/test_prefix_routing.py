"""Prefix-aware routing across two real replicas (each a worker and a scheduler over gRPC,
in this process), real NATS and Redis: requests sharing a long prefix go to the replica
that holds it, seen through the replicas' own prefix-cache hits, whether the gateway
followed the KV events as they came or started later and loaded the replicas'
snapshots; a least-load gateway, as a control, does not. The KV index also recovers
a lost event message from a snapshot. One gateway fronts the chat model and an
embedding model, each request going to the replicas of the model it names."""
from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing

import httpx
import openai
import pytest

from gateway.cluster.client import ClusterEngineClient
from gateway.cluster.kv_index import KvIndex
from gateway.cluster.routing import CachedPrefix
from gateway.main import add_gateway_args, build_gateway
from scheduler_svc.block_pool import KvEvents
from scheduler_svc.kv_event_publisher import KvEventPublisher
from scheduler_svc.nats_publisher import NatsOutputHub
from services.block_hash import extend_block_hashes
from services.model_source import resolve_model
from services.registry import Lease, Member, Registry
from services.sampling_params import SamplingParams
from services.scheduler_messages import SubmitRequest
from tokenizer_svc.server import start_tokenizer_server
from tokenizer_svc.tokenizer import Tokenizer

from corpus import TEXT
from in_process_replica import InProcessReplica, serving_tokenizer
from servers import nats, redis_url  # noqa: F401  (fixtures)

ENGINE = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
BLOCK = 16
PREFIX_BLOCKS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TTL_S = 2.0
EMBEDDER = "all-minilm-l6-v2"


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def replicas(nats, redis_url, tokenizer) -> Iterator[dict[str, InProcessReplica]]:
    registry = Registry(redis_url)
    with serving_tokenizer(registry, tokenizer, TTL_S):
        # The registry lists schedulers by member id: "a" before "b", so under equal load
        # a least-load gateway picks "a"; the prefix is put in "b".
        replicas = {name: InProcessReplica(name, nats.url, registry, ENGINE, TTL_S) for name in ("a", "b")}
        yield replicas
        for replica in replicas.values():
            replica.close()
    registry.close()


def started_client(redis_url: str, nats_url: str, policy: str) -> ClusterEngineClient:
    client = ClusterEngineClient(redis_url, nats_url, poll_interval_s=0.2, routing_policy=policy)
    client.start()
    wait_until(lambda: client.is_ready() and len(client._replicas.routable()) == 2,
               "the client never saw both replicas")
    return client


def prompts(tokenizer: Tokenizer, count: int, first: int = 0) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    prefix = ids[:PREFIX_BLOCKS * BLOCK]
    return [prefix + ids[200 + 9 * i:200 + 9 * i + 9] for i in range(first, first + count)]


def prefix_hashes(prompt: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt[:PREFIX_BLOCKS * BLOCK], BLOCK, b"")
    return hashes


def holds_prefix(index: KvIndex, instance_id: str, prompt: list[int]) -> bool:
    return index.cached_blocks(prefix_hashes(prompt)).get(instance_id, CachedPrefix()).device == PREFIX_BLOCKS


def run_each(client: ClusterEngineClient, prompts: list[list[int]], tag: str) -> None:
    async def one(index: int, prompt: list[int]) -> None:
        async with aclosing(client.generate(f"{tag}-{index}", prompt, GREEDY)) as deltas:
            async for _ in deltas:
                pass

    async def main() -> None:
        for index, prompt in enumerate(prompts):  # one at a time: equal load at each choice
            await one(index, prompt)

    asyncio.run(main())


def test_a_shared_prefix_goes_where_it_is_cached(replicas, tokenizer, nats, redis_url) -> None:
    a, b = replicas["a"], replicas["b"]
    following = started_client(redis_url, nats.url, "prefix")
    try:
        warm = prompts(tokenizer, 1)[0]
        [accepted] = b.loop.submit([SubmitRequest("warm", warm, GREEDY, "nobody")])
        accepted.result(10)
        wait_until(b.idle, "the warm-up request did not finish")
        wait_until(lambda: holds_prefix(following._placement.kv_index, b.core.instance_id, warm),
                   "the gateway's index never learnt that b holds the prefix")

        run_each(following, prompts(tokenizer, 3, first=1), "following")
        assert a.stats().prefix_cache_hits == 0, "a shared-prefix request went to the replica without the prefix"
        assert b.stats().prefix_cache_hits >= 3 * PREFIX_BLOCKS * BLOCK

        late = started_client(redis_url, nats.url, "prefix")  # no events since: it loads snapshots
        try:
            wait_until(lambda: holds_prefix(late._placement.kv_index, b.core.instance_id, warm),
                       "the late gateway's index never loaded b's snapshot")
            before = b.stats().prefix_cache_hits
            run_each(late, prompts(tokenizer, 2, first=4), "late")
            assert a.stats().prefix_cache_hits == 0 and b.stats().prefix_cache_hits >= before + 2 * PREFIX_BLOCKS * BLOCK
        finally:
            late.shutdown()

        control = started_client(redis_url, nats.url, "least-load")
        try:
            run_each(control, prompts(tokenizer, 1, first=6), "control")
            stats = a.stats()
            assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries > 0  # it went to a, blind to the cache
        finally:
            control.shutdown()
    finally:
        following.shutdown()


def test_a_lost_event_message_is_recovered_from_a_snapshot(nats, monkeypatch) -> None:
    hub = NatsOutputHub(nats.url, "s1")
    publisher: KvEventPublisher = hub.kv_events
    index = KvIndex(nats.url, lambda instance_id: publisher.snapshot() if instance_id == "s1" else None)
    try:
        publisher.publish(KvEvents(False, [], [b"A"]))
        wait_until(lambda: index.cached_blocks([b"A"]) == {"s1": CachedPrefix(1)}, "the first event was not applied")
        send = KvEventPublisher._send

        async def lose(self: KvEventPublisher, payload: bytes) -> None:  # NATS drops this one
            monkeypatch.setattr(KvEventPublisher, "_send", send)

        monkeypatch.setattr(KvEventPublisher, "_send", lose)
        publisher.publish(KvEvents(False, [b"A"], [b"B"]))  # lost
        wait_until(lambda: KvEventPublisher._send is send, "the loss was not injected")
        publisher.publish(KvEvents(False, [], [b"C"]))  # a gap: the index reloads
        wait_until(lambda: index.cached_blocks([b"B", b"C"]) == {"s1": CachedPrefix(2)}
                   and index.cached_blocks([b"A"]) == {"s1": CachedPrefix(0)},
                   "the index did not recover the lost message")
    finally:
        index.close()
        hub.close()


def test_one_gateway_serves_the_chat_model_and_an_embedding_model_each_on_its_replicas(
        replicas, tokenizer, nats, redis_url) -> None:
    """`kvfleet gateway --extra-model`: requests go to the replicas and tokenizer of the model
    they name; /v1/models lists both; a model nobody serves is a 404 naming it. When one
    model's replicas are gone, the gateway stays ready for the other's traffic, and the
    gone model's requests get a 503."""
    registry = Registry(redis_url)
    server = start_tokenizer_server(Tokenizer.load(resolve_model(EMBEDDER)), "127.0.0.1:0")
    lease = Lease(registry, Member("tokenizer", "minilm", server.address, {"model": EMBEDDER}), TTL_S).start()
    embedder = InProcessReplica("minilm", nats.url, registry, {"model": EMBEDDER}, TTL_S, model=EMBEDDER)
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    gateway = build_gateway(parser.parse_args(["--nats-url", nats.url, "--redis-url", redis_url,
                                               "--extra-model", EMBEDDER]), registry)
    gateway.start()
    try:
        wait_until(gateway.app.state.gateway.is_ready, "the gateway never saw both models' replicas")

        async def main() -> tuple:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gateway",
                                         timeout=60) as http:
                client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http)
                models = await client.models.list()
                chat = await client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
                    temperature=0)
                vectors = await client.embeddings.create(model=EMBEDDER, input=["A man is eating food.", "Hi"])
                unknown = await http.post("/v1/embeddings", json={"model": "nobody", "input": "x"})
                return models, chat, vectors, unknown, (await http.get("/metrics")).text

        models, chat, vectors, unknown, metrics = asyncio.run(main())
        assert sorted(card.id for card in models.data) == sorted(["smollm2", EMBEDDER])
        assert chat.model == "smollm2" and chat.usage.completion_tokens == 4 and chat.choices[0].message.content
        # 384 is MiniLM's width (the chat model's is 576, and it does not pool: a 400)
        assert vectors.model == EMBEDDER and [len(d.embedding) for d in vectors.data] == [384, 384]
        assert abs(sum(x * x for x in vectors.data[0].embedding) - 1) < 1e-4  # normalized, as MiniLM's modules say
        assert unknown.status_code == 404 and "nobody" in unknown.json()["error"]["message"]
        # One scrape, each family once, each model's series by its name.
        assert metrics.count("# TYPE vllm:request_success_total counter") == 1
        assert 'vllm:request_success_total{finished_reason="length",model_name="smollm2"} 1.0' in metrics
        assert f'vllm:request_success_total{{finished_reason="stop",model_name="{EMBEDDER}"}} 2.0' in metrics

        embedder.close()
        context = gateway.app.state.gateway
        wait_until(lambda: not context.others[0].can_serve(), "the embedder's replica is still counted", 3 * TTL_S)
        assert context.is_ready()

        async def after() -> tuple[int, int]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gateway",
                                         timeout=60) as http:
                chat = await http.post("/v1/chat/completions", json={
                    "model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
                vectors = await http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "Hi"})
                return chat.status_code, vectors.status_code

        assert asyncio.run(after()) == (200, 503)
    finally:
        gateway.close()
        embedder.close()
        lease.stop()
        server.stop(0)
        registry.close()
