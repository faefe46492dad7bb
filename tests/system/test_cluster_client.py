"""ClusterEngineClient end to end: a worker gRPC server, a scheduler (StepLoop with a
NatsOutputHub) and a tokenizer server, each with a registry lease, over real NATS and
Redis processes. Greedy tokens equal the offline LLM.generate; bad input raises
InvalidParameter naming the parameter; a consumer that leaves aborts its request;
a scheduler killed mid-stream ends its request with an explicit error within its lease.

The servers run in this process over the module LLM's own Worker (its reference run
is done first). The killed scheduler is a subprocess; it drives the same worker, so
its test comes last, when nothing else uses that worker's blocks any more."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path

import msgspec
import nats as nats_client
import pytest
import redis

from gateway.cluster.client import ClusterEngineClient
from kvfleet import LLM
from kvfleet.processes import free_port
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.lora_announce import reannounce_loras
from scheduler_svc.main import lease_metadata
from scheduler_svc.nats_publisher import NatsOutputHub
from scheduler_svc.server import start_scheduler_server
from scheduler_svc.step_loop import StepLoop
from scheduler_svc.worker_client import RemoteWorker
from services.config import EngineConfig
from services.engine_client import EngineOverloaded, RequestFailed
from services.invalid_parameter import InvalidParameter
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.nats_link import subject
from services.registry import Lease, Member, Registry
from services.sampling_params import SamplingParams
from services.scheduler_messages import StepOutputs
from tokenizer_svc.server import start_tokenizer_server
from worker_svc.server import start_worker_server

from corpus import TEXT
from servers import nats, redis_url  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
# It pools as well as it generates (a --pooler-config): pooling requests take the cluster's path too.
# LoRA enabled (two slots): requests without an adapter run exactly as without it.
ENGINE = dict(dtype="float32", num_gpu_blocks_override=16, max_model_len=128, pooler_config='{"pooling_type": "LAST"}',
              enable_lora=True, max_loras=2)
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "16", "--max-model-len", "128"]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
TTL_S = 2.0


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The offline SDK (not conftest's `llm`: the cluster reuses its Worker, so its
    scheduler cannot account for that worker's state)."""
    return LLM("smollm2", **ENGINE)


@pytest.fixture(scope="module")
def prompts(offline: LLM) -> list[list[int]]:
    ids = offline.get_tokenizer().encode(TEXT)
    return [ids[start:start + length] for start, length in [(0, 5), (40, 12), (90, 20), (150, 30)]]


@pytest.fixture(scope="module")
def reference(offline: LLM, prompts) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in offline.generate(prompts, GREEDY, use_tqdm=False)]


class Cluster:
    """Worker, tokenizer and scheduler servers, each listed in the registry at `redis_url`."""

    def __init__(self, offline: LLM, nats_url: str, redis_url: str) -> None:
        self.registry = Registry(redis_url)
        self.worker_state = offline.engine.worker
        self.worker = start_worker_server(self.worker_state, "127.0.0.1:0")
        self.tokenizer = start_tokenizer_server(offline.get_tokenizer(), "127.0.0.1:0")
        self.remote = RemoteWorker(self.worker.address)
        core = EngineCore(EngineConfig(**ENGINE), self.remote)
        self.hub = NatsOutputHub(nats_url, core.instance_id)
        self.loop = StepLoop(core, self.hub)
        self.scheduler = start_scheduler_server(self.loop, self.hub, "127.0.0.1:0")
        self.leases = [
            Lease(self.registry, member, TTL_S).start()
            for member in (Member("worker", "w", self.worker.address), Member("tokenizer", "t", self.tokenizer.address))
        ]
        # As scheduler_svc/main.py leases a scheduler: its runtime-loaded adapters announced again on re-registering.
        self.leases.append(Lease(self.registry, Member("scheduler", "s", self.scheduler.address,
                                                       lease_metadata(self.worker.address, "smollm2", self.loop.core)),
                                 TTL_S, on_registered=reannounce_loras(self.registry, self.loop.core)).start())

    def idle(self) -> bool:
        """Every request has ended: no block leaked, and the worker dropped every request's state."""
        scheduler = self.loop.core.scheduler
        pool = scheduler.block_pool
        return not scheduler.has_unfinished_requests and pool.num_free_blocks == pool.num_blocks and not (
            self.worker_state.requests
        )

    def close(self) -> None:
        for lease in self.leases:
            lease.stop()
        for server in (self.scheduler, self.tokenizer, self.worker):
            server.stop(0)
        self.remote.close()
        self.registry.close()


@pytest.fixture(scope="module")
def reference_vectors(offline: LLM, prompts) -> list[list[float]]:
    """The offline SDK's embeddings, taken before the cluster reuses its worker."""
    return [output.outputs.embedding for output in offline.embed(prompts, use_tqdm=False)]


@pytest.fixture(scope="module")
def cluster(offline: LLM, reference, reference_vectors, nats, redis_url) -> Iterator[Cluster]:
    cluster = Cluster(offline, nats.url, redis_url)
    yield cluster
    cluster.close()


@pytest.fixture(autouse=True)
def _cluster_ends_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "client" in request.fixturenames:  # the killed scheduler's test leaves its request behind
        cluster = request.getfixturevalue("cluster")
        deadline = time.monotonic() + 5  # drops ride on the scheduler's next (empty) step
        while not cluster.idle():
            assert time.monotonic() < deadline, "a request, its blocks or its worker state leaked"
            time.sleep(0.05)


def started_client(redis_url: str, nats_url: str) -> ClusterEngineClient:
    client = ClusterEngineClient(redis_url, nats_url, poll_interval_s=0.2)
    client.start()
    deadline = time.monotonic() + 10
    while not client.is_ready():
        assert time.monotonic() < deadline, "the client never became ready"
        time.sleep(0.05)
    return client


@pytest.fixture(scope="module")
def client(cluster, nats, redis_url) -> Iterator[ClusterEngineClient]:
    client = started_client(redis_url, nats.url)
    yield client
    client.shutdown()


async def collect(stream: AsyncIterator[TokenDelta]) -> list[int]:
    tokens: list[int] = []
    async with aclosing(stream) as deltas:
        async for delta in deltas:
            tokens.extend(delta.new_token_ids)
    assert delta.finish_reason == "length"
    return tokens


async def spy_on(url: str, gateway_id: str) -> tuple[object, list[StepOutputs]]:
    messages: list[StepOutputs] = []

    async def keep(msg) -> None:
        messages.append(msgspec.msgpack.decode(msg.data, type=StepOutputs))

    connection = await nats_client.connect(url)
    await connection.subscribe(subject(gateway_id), cb=keep)
    await connection.flush()
    return connection, messages


def test_greedy_tokens_equal_the_offline_llm_one_message_per_step(client, cluster, nats, prompts, reference) -> None:
    async def main() -> tuple[list[list[int]], list[StepOutputs]]:
        spy, messages = await spy_on(nats.url, client.gateway_id)
        outputs = await asyncio.gather(
            *(collect(client.generate(f"parity-{i}", prompt, GREEDY)) for i, prompt in enumerate(prompts))
        )
        await spy.close()
        return outputs, messages

    outputs, messages = asyncio.run(main())
    assert outputs == reference
    # One message per step for the whole batch: at most one step per token plus one per
    # late joiner, against 32 messages if every token went alone.
    assert len(messages) <= NEW_TOKENS + len(prompts)
    assert max(len({d.request_id for d in m.deltas}) for m in messages) == len(prompts)  # a step of all four
    assert client.stats().num_kv_blocks == 16


def test_pooling_requests_come_back_with_their_vectors_over_nats(client, prompts, reference_vectors) -> None:
    from services.pooling_params import PoolingParams

    async def deltas(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
        async with aclosing(stream) as items:
            return [delta async for delta in items]

    async def main() -> list[list[TokenDelta]]:
        pooling = SamplingParams(pooling=PoolingParams())
        return await asyncio.gather(*(deltas(client.generate(f"pool-{i}", prompt, pooling))
                                      for i, prompt in enumerate(prompts)))

    assert client.engine_info().pooler.pooling_type == "LAST"  # from the scheduler's lease
    for [delta], expected in zip(asyncio.run(main()), reference_vectors):
        assert delta.finish_reason == "stop" and delta.pooled == pytest.approx(expected, abs=1e-5)


def test_parallel_samples_come_back_under_their_child_ids(client, prompts, reference) -> None:
    async def main() -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
        async for delta in client.generate("par", prompts[0], params):
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        return tokens

    assert asyncio.run(main()) == {"par#0": reference[0], "par#1": reference[0]}


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ([], GREEDY, "prompt"),
        (list(range(1, 200)), GREEDY, "prompt"),  # longer than max_model_len
        ([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
        ([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), "logit_bias"),
    ],
)
def test_bad_input_names_the_parameter_and_disturbs_nothing(client, prompts, reference, prompt, params, param) -> None:
    async def main() -> list[int]:
        with pytest.raises(InvalidParameter) as error:
            await collect(client.generate(f"bad-{param}-{len(prompt)}", prompt, params))
        assert error.value.param == param
        return await collect(client.generate(f"after-bad-{param}-{len(prompt)}", prompts[0], GREEDY))

    assert asyncio.run(main()) == reference[0]


def test_a_consumer_that_leaves_aborts_its_request(client, cluster, nats, prompts) -> None:
    async def main() -> list[TokenDelta]:
        spy, messages = await spy_on(nats.url, client.gateway_id)
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        async with aclosing(client.generate("leaver", prompts[0], params)) as deltas:
            await anext(deltas)
        deadline = time.monotonic() + 10
        while not any(d.finish_reason for m in messages for d in m.deltas):
            assert time.monotonic() < deadline, "no final delta"
            await asyncio.sleep(0.05)
        await spy.close()
        return [d for m in messages for d in m.deltas]

    deltas = asyncio.run(main())
    assert deltas[-1].finish_reason == "abort" and not deltas[-1].error
    assert sum(len(d.new_token_ids) for d in deltas) < 100
    assert cluster.loop.stats().num_requests_running == 0


def test_a_replica_that_refuses_is_passed_over_for_another(cluster, client, nats, prompts, reference) -> None:
    """A scheduler that stopped taking requests since the last poll (draining, say)
    answers Submit with UNAVAILABLE; the request goes to another replica instead."""
    core = EngineCore(EngineConfig(**ENGINE), cluster.remote)
    hub = NatsOutputHub(nats.url, core.instance_id)
    refusing = StepLoop(core, hub)
    server = start_scheduler_server(refusing, hub, "127.0.0.1:0")
    refusing.stop()  # its server still answers Stats and health: only Submit tells
    metadata = lease_metadata(cluster.worker.address, "smollm2", refusing.core)
    lease = Lease(cluster.registry, Member("scheduler", "refusing", server.address, metadata), TTL_S).start()
    try:
        deadline = time.monotonic() + 5
        while len(client._replicas.routable()) < 2:
            assert time.monotonic() < deadline, "the client never saw the second replica"
            time.sleep(0.05)

        async def main() -> list[list[int]]:
            # Two at once: the least-loaded choice sends one of them to each replica.
            return await asyncio.gather(*(collect(client.generate(f"rerouted-{i}", prompts[i], GREEDY)) for i in (0, 1)))

        assert asyncio.run(main()) == reference[:2]
    finally:
        lease.stop()
        server.stop(0)


@pytest.mark.parametrize("tried_first", ["full", "draining"])
def test_a_replica_found_full_turns_requests_away_as_full_until_the_next_poll(cluster, nats, redis_url, prompts,
                                                                              tried_first) -> None:
    """A replica whose queue filled since the last poll refuses Submit as full: that
    request, and those that come before the next poll, are told to retry (a 429), never
    that no scheduler serves (a 503), also where the only other replica began draining,
    whichever of the two the first request tries first."""
    own_registry = redis_url.rsplit("/", 1)[0] + "/2"  # these replicas are the only ones there
    registry = Registry(own_registry)
    schedulers = []
    for name, max_queued in (("full", 0), ("draining", None)):
        core = EngineCore(EngineConfig(**ENGINE), cluster.remote)
        hub = NatsOutputHub(nats.url, core.instance_id)
        loop = StepLoop(core, hub, max_queued_requests=max_queued)
        server = start_scheduler_server(loop, hub, "127.0.0.1:0")
        # Its lease names no queue bound, and its health still says SERVING: only its
        # answer to Submit says it is full, or draining.
        # Equally loaded replicas are tried in the order of their ids.
        member_id = f"{0 if name == tried_first else 1}-{name}"
        schedulers.append((loop, server, Member("scheduler", member_id, server.address,
                                                 lease_metadata(cluster.worker.address, "smollm2", core))))
    schedulers[1][0].stop()
    leases = [Lease(registry, member, TTL_S).start() for member in (
        Member("worker", "w", cluster.worker.address), Member("tokenizer", "t", cluster.tokenizer.address),
        *(member for _, _, member in schedulers))]
    client = ClusterEngineClient(own_registry, nats.url, poll_interval_s=600)  # no poll within the test
    try:
        deadline = time.monotonic() + 10
        while len(registry.members("scheduler")) < 2:
            assert time.monotonic() < deadline, "the replicas never registered"
            time.sleep(0.05)
        client.start()
        assert client.is_ready()

        async def refused(request_id: str) -> None:
            with pytest.raises(EngineOverloaded, match="queue is full"):
                await collect(client.generate(request_id, prompts[0], GREEDY))

        async def main() -> None:
            await refused("full-0")
            await asyncio.gather(*(refused(f"full-{i}") for i in range(1, 4)))

        asyncio.run(main())
        assert client.is_ready()
    finally:
        client.shutdown()
        for lease in leases:
            lease.stop()
        for _, server, _ in schedulers:
            server.stop(0)
        registry.close()


@pytest.mark.serial
def test_a_killed_scheduler_ends_its_requests_within_a_second(cluster, nats, redis_url, prompts) -> None:
    # A registry of its own (Redis database 1): the killed scheduler is the only one there.
    own_registry = redis_url.rsplit("/", 1)[0] + "/1"
    registry = Registry(own_registry)
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    log = tempfile.TemporaryFile("w+")
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "scheduler", *ENGINE_FLAGS, "--host", "127.0.0.1",
         "--port", str(free_port()), "--worker-address", cluster.worker.address, "--nats-url", nats.url,
         "--redis-url", own_registry, "--lease-ttl", str(TTL_S)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )
    leases = [Lease(registry, Member("worker", "w", cluster.worker.address), TTL_S).start(),
              Lease(registry, Member("tokenizer", "t", cluster.tokenizer.address), TTL_S).start()]
    client = None
    try:
        deadline = time.monotonic() + 60
        while not registry.members("scheduler"):
            if scheduler.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"the scheduler never registered:\n{log.read()}")
            time.sleep(0.1)
        client = started_client(own_registry, nats.url)

        async def main() -> float:
            params = SamplingParams(temperature=0.0, max_tokens=110, ignore_eos=True)
            async with aclosing(client.generate("doomed", prompts[0], params)) as deltas:
                await anext(deltas)
                scheduler.send_signal(signal.SIGKILL)
                killed = time.monotonic()

                async def drain() -> None:
                    async for _ in deltas:
                        pass

                # Its channel fails at once: no waiting for its lease to lapse, and never a hang.
                with pytest.raises(RequestFailed, match="unreachable"):
                    await asyncio.wait_for(drain(), TTL_S + 5)
                # Its only scheduler lost, the gateway says so at once, not a poll later:
                # /health must not answer 200 to a request it would turn away.
                assert not client.is_ready()
                return time.monotonic() - killed

        assert asyncio.run(main()) < 1.0
    finally:
        scheduler.kill()
        scheduler.wait()
        if client is not None:
            client.shutdown()
        for lease in leases:
            lease.stop()
        registry.close()
        log.close()


def test_an_adapter_loaded_through_one_gateway_serves_through_another_with_merged_transformers_tokens(
    client, cluster, nats, redis_url, lora_adapter_dirs, lora_references
) -> None:
    prompts, wanted = lora_references
    lora = LoRARequest("attn8", 7, str(lora_adapter_dirs["attn8"]))
    asyncio.run(client.add_lora(lora))  # every replica's worker reads and checks it; the registry lists it
    with pytest.raises(ValueError, match="No adapter found for /no/such/adapter"):
        asyncio.run(client.add_lora(LoRARequest("missing", 8, "/no/such/adapter")))
    other = started_client(redis_url, nats.url)
    try:
        assert other.lora_requests() == {"attn8": lora}  # read from the registry at its start
        params = SamplingParams(temperature=0.0, max_tokens=len(wanted["attn8"][0]), ignore_eos=True)
        tokens = asyncio.run(collect(other.generate("lora-0", prompts[0], params, lora_request=lora)))
        assert tokens == wanted["attn8"][0]
        asyncio.run(other.remove_lora(lora.lora_int_id))
        deadline = time.monotonic() + 5
        while client.lora_requests():  # the first gateway's next poll of the registry
            assert time.monotonic() < deadline, client.lora_requests()
            time.sleep(0.05)
    finally:
        other.shutdown()


def test_a_redis_restarted_empty_turns_nothing_away_and_gets_the_adapters_back(
    client, cluster, redis_url, lora_adapter_dirs
) -> None:
    lora = LoRARequest("mlp4", 9, str(lora_adapter_dirs["mlp4"]))
    asyncio.run(client.add_lora(lora))
    try:
        redis.Redis.from_url(redis_url).flushall()  # what a Redis restarted without persistence holds
        flushed = time.monotonic()
        # A lease missing before its member's next beat is no evidence of a lapse: the
        # gateway serves as it did while the beats re-register every member.
        while time.monotonic() - flushed < 2 * TTL_S:
            assert client.is_ready() and client.lora_requests() == {"mlp4": lora}
            time.sleep(0.05)
        assert "mlp4" in cluster.registry.loras()  # the scheduler's beat put its adapter back
        assert cluster.registry.members("scheduler")
    finally:
        asyncio.run(client.remove_lora(lora.lora_int_id))
