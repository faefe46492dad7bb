"""Prefill/decode disaggregation as an operator starts it (real processes: nats-server,
Redis, a tokenizer, one prefill replica and two decode replicas, each a `kvfleet worker`
and a `kvfleet scheduler` given `--kv-transfer-config` with vLLM's NixlConnector, so the
decode workers read the blocks over NIXL, and two gateways), its faults as kill -9
leaves them, and the planner's moves (docs/disaggregation.md, docs/planner.md). The
prefill replica is kv_both, given the prefill pool, as the chart starts it for the
planner:

- every parity prompt gives, split, the text the decode replicas give it computed
  there (the `local` gateway never splits: a combined replica's answer), and the decode
  replicas' own metrics say they computed at most the last partial block of a split
  prompt, the rest arriving from the prefill replica;
- the prefill replica's worker, then its scheduler, killed while the prompt's blocks
  stream to the decode side: the decode side recomputes what did not arrive at once (not
  after its fetch timeout), the client gets the undisturbed text, and no block stays held
  or taken on either side;
- the prefill replica moved to the decode pool while split streams decode (what the
  planner asks when the prompts leave it idle): they finish with the undisturbed text,
  and it then decodes requests itself, with the text the decode replicas give; moved
  back, it prefills for them again;
- a decode replica's worker killed while split streams decode there: they migrate and
  finish with the undisturbed text.
They run in this order on one cluster; each killed role is started again after it, but
the last, which ends the cluster.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvfleet.processes import free_port
from services.model_source import resolve_model
from tokenizer_svc.tokenizer import Tokenizer

from corpus import TEXT, parity_prompts
from role_cluster import RoleCluster, serving
from servers import HOST, RoleProcess, nats, redis_url  # noqa: F401  (fixtures)
from test_worker_failover import wait_for

BLOCK = 16
LEASE_TTL_S = 3.0
# Long: a fetch from a dead prefill replica must end at once, not when the consumer gives up.
FETCH_TIMEOUT_S = 30.0
# Dense float32: a request whose blocks did not all arrive computes the rest as one
# prefill, and only the dense path computes those tokens as its decode steps would
# whatever the batch (as in test_migration.py). The prefill replica computes 32 tokens a
# step, so a long prompt's blocks stream to the decode side over many steps.
ENGINE_FLAGS = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
                "--kv-cache-memory", str(256 * 2**20)]
PREFILL_STEP_TOKENS = 32
REPLICAS = {"prefill": "kv_both", "decode-a": "kv_consumer", "decode-b": "kv_consumer"}


def transfer_config(kv_role: str) -> str:
    # The decode replicas read the blocks over NIXL (tests/system/test_disaggregation.py's
    # pair moves them in the gRPC stream): vLLM's connector, as its users name it. The
    # kv_both replica serves the prefill pool until the planner moves it.
    pool = {"pool": "prefill"} if kv_role == "kv_both" else {}
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                       "kv_connector_extra_config": {"fetch_timeout_s": FETCH_TIMEOUT_S, **pool}})


class Cluster(RoleCluster):
    def __init__(self, nats_url: str, redis_url: str) -> None:
        super().__init__(redis_url, num_replicas=len(REPLICAS))
        registry = ["--redis-url", redis_url, "--lease-ttl", str(LEASE_TTL_S)]
        self.roles["tokenizer"] = RoleProcess("tokenizer", "--port", "0", *registry)
        for name, kv_role in REPLICAS.items():
            worker_port, metrics_port = free_port(), free_port()
            self.metrics[name] = f"http://{HOST}:{metrics_port}/metrics"
            config = ["--kv-transfer-config", transfer_config(kv_role)]
            self.roles[f"worker-{name}"] = RoleProcess("worker", *ENGINE_FLAGS, *config, "--port", str(worker_port),
                                                       *registry)
            chunks = ["--max-num-batched-tokens", str(PREFILL_STEP_TOKENS)] if name == "prefill" else []
            self.roles[f"scheduler-{name}"] = RoleProcess(
                "scheduler", *ENGINE_FLAGS, *config, *chunks, "--port", str(free_port()),
                "--worker-address", f"{HOST}:{worker_port}", "--metrics-port", str(metrics_port),
                "--nats-url", nats_url, *registry)
        # `local` never splits: the decode replica computes the prompt, as a combined replica does.
        for name, flags in (("split", []), ("local", ["--pd-min-prefill-tokens", str(10**6)])):
            port = free_port()
            self.roles[name] = RoleProcess("gateway", "--port", str(port), "--nats-url", nats_url, *registry, *flags)
            self.urls[name] = f"http://{HOST}:{port}"

    def prompt_tokens(self, replica: str) -> dict[str, float]:
        """vllm:prompt_tokens_by_source_total on `replica`, by source."""
        return {source: self.metric(replica, "vllm:prompt_tokens_by_source_total", source=source)
                for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}

    def decode_tokens(self) -> dict[str, float]:
        """The same, summed over both decode replicas."""
        by_replica = [self.prompt_tokens(name) for name in REPLICAS if name.startswith("decode")]
        return {source: sum(tokens[source] for tokens in by_replica) for source in by_replica[0]}

    def settled(self) -> bool:
        """No request running or waiting, no block taken or held, on any replica."""
        return all(self.metric(name, metric) == 0 for name in REPLICAS for metric in (
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "kvfleet:kv_transfer_held_blocks"))


@pytest.fixture(scope="module")
def cluster(nats, redis_url) -> Iterator[Cluster]:
    with serving(Cluster(nats.url, redis_url)) as started:
        yield started


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return parity_prompts(Tokenizer.load(resolve_model("smollm2")).encode(TEXT))


def complete_all(url: str, prompts: list[list[int]], salt: str, max_tokens: int = 8) -> list[str]:
    """Each prompt's text, the requests at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: complete(url, prompt, salt, max_tokens), prompts))


def complete(url: str, prompt: list[int], salt: str, max_tokens: int = 8) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    # The salt keeps each run's blocks apart: the split run must not find the local run's cached.
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, "cache_salt": salt}).choices[0].text


def moved_tokens(length: int) -> int:
    """A split prompt's tokens that arrive from the prefill replica: its full blocks but the
    one of its last token (whose logits the decode replica computes)."""
    return BLOCK * ((length - 1) // BLOCK)


def test_split_prompts_give_the_combined_text_computing_at_most_a_partial_block(cluster: Cluster,
                                                                                 prompts: list[list[int]]) -> None:
    local = complete_all(cluster.urls["local"], prompts, "local")
    before = cluster.decode_tokens()
    split = complete_all(cluster.urls["split"], prompts, "split")
    after = cluster.decode_tokens()
    assert split == local, cluster.logs()
    # Prompts of at most a block are computed on the decode side (a split would move nothing).
    arriving = sum(moved_tokens(len(p)) for p in prompts if len(p) > BLOCK)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == arriving
    assert after["local_compute"] - before["local_compute"] == sum(len(p) for p in prompts) - arriving
    assert after["local_cache_hit"] == before["local_cache_hit"]
    # The bytes moved over NIXL: the prefill worker made its agent when a decode worker asked to read.
    assert any("NIXL agent" in line for line in cluster.roles["worker-prefill"].log)
    wait_for(cluster.settled, 30, "a block stayed taken or held", list(cluster.roles.values()))


@pytest.mark.parametrize("killed", ["worker-prefill", "scheduler-prefill"])
def test_a_prefill_replica_killed_mid_transfer_changes_no_token(cluster: Cluster, prompts: list[list[int]],
                                                                killed: str) -> None:
    prompt = prompts[-1]  # 400 tokens: 13 prefill steps, 24 blocks to move
    salt = f"killed-{killed}"
    local = complete(cluster.urls["local"], prompt, f"local-{salt}", max_tokens=16)
    before = cluster.decode_tokens()
    result: list[str] = []
    split = threading.Thread(target=lambda: result.append(complete(cluster.urls["split"], prompt, salt, 16)))
    split.start()
    # A third of the prompt's blocks computed and held for the decode side, which fetches them as they come.
    wait_for(lambda: cluster.metric("prefill", "kvfleet:kv_transfer_held_blocks") >= 8, 60,
             "the prefill replica never held the prompt's blocks", list(cluster.roles.values()))
    cluster.roles[killed].process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        split.join(120)
        ended = time.monotonic() - killed_at
        # A dead worker's stream breaks; a dead scheduler's worker ends its holds a second on.
        assert ended < FETCH_TIMEOUT_S / 3
        assert result == [local], cluster.logs()
        after = cluster.decode_tokens()
        arrived = after["external_kv_transfer"] - before["external_kv_transfer"]
        # Some blocks arrived before the kill, not all: the rest were computed on the decode side.
        assert 0 < arrived < moved_tokens(len(prompt)), (arrived, cluster.logs())
        assert after["local_compute"] - before["local_compute"] == len(prompt) - arrived
    finally:
        cluster.restart(killed)
    wait_for(cluster.settled, 30, "a block stayed taken or held", list(cluster.roles.values()))


class SplitStreams:
    """Each prompt a split request of 32 tokens through the `split` gateway, all at once
    on threads of their own."""

    def __init__(self, cluster: Cluster, prompts: list[list[int]], salt: str) -> None:
        self.results: dict[int, str] = {}

        def run(index: int) -> None:
            self.results[index] = complete(cluster.urls["split"], prompts[index], salt, 32)

        self.threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
        for thread in self.threads:
            thread.start()

    def texts(self) -> list[str | None]:
        """Each one's text, once all ended."""
        for thread in self.threads:
            thread.join(300)
        return [self.results.get(index) for index in range(len(self.threads))]


def leased_pool(cluster: Cluster, member_id: str) -> str | None:
    return next((m.metadata["kv_pool"] for m in cluster.registry.members("scheduler") if m.id == member_id), None)


def move(cluster: Cluster, member_id: str, pool: str) -> None:
    """What the planner's actuator asks (planner/actuator.py), and until every gateway has
    seen the scheduler's lease say it (they read the registry every half second)."""
    cluster.registry.request_move("scheduler", member_id, pool, ttl_s=60)
    wait_for(lambda: leased_pool(cluster, member_id) == pool, 10, f"the replica never moved to {pool}",
             list(cluster.roles.values()))
    time.sleep(1.5)


def test_the_prefill_replica_moved_to_the_decode_pool_decodes_and_its_split_streams_finish(
        cluster: Cluster, prompts: list[list[int]]) -> None:
    long_prompts = [p for p in prompts if len(p) > 4 * BLOCK]
    local = complete_all(cluster.urls["local"], long_prompts, "local-move", max_tokens=32)
    (prefill,) = [m for m in cluster.registry.members("scheduler") if m.metadata["kv_home_pool"] == "prefill"]
    assert prefill.metadata["kv_pool"] == "prefill"
    streams = SplitStreams(cluster, long_prompts, "move")
    wait_for(lambda: cluster.metric("decode-a", "vllm:num_requests_running")
             + cluster.metric("decode-b", "vllm:num_requests_running") > 0, 120,
             "the split requests never decoded", list(cluster.roles.values()))
    move(cluster, prefill.id, "decode")
    assert streams.texts() == local, cluster.logs()
    # In the decode pool, with no prefill pool left to split with: each prompt is computed
    # whole where it decodes, on the moved replica too.
    before = {name: cluster.prompt_tokens(name)["local_compute"] for name in REPLICAS}
    assert complete_all(cluster.urls["split"], long_prompts, "moved", max_tokens=32) == local, cluster.logs()
    computed = {name: cluster.prompt_tokens(name)["local_compute"] - before[name] for name in REPLICAS}
    assert sum(computed.values()) == sum(len(p) for p in long_prompts) and computed["prefill"] > 0, computed
    # Moved back, it prefills for the decode replicas again.
    move(cluster, prefill.id, "prefill")
    before = cluster.decode_tokens()
    assert complete(cluster.urls["split"], long_prompts[-1], "moved-back", 32) == local[-1]
    assert cluster.decode_tokens()["external_kv_transfer"] - before["external_kv_transfer"] == moved_tokens(
        len(long_prompts[-1]))
    wait_for(cluster.settled, 30, "a block stayed taken or held", list(cluster.roles.values()))


def test_a_decode_replica_killed_mid_stream_migrates_its_split_streams(cluster: Cluster,
                                                                       prompts: list[list[int]]) -> None:
    long_prompts = [p for p in prompts if len(p) > 4 * BLOCK]
    local = complete_all(cluster.urls["local"], long_prompts, "local-decode-death", max_tokens=32)
    migrated = sum("migrating it with" in line for line in cluster.roles["split"].log)
    streams = SplitStreams(cluster, long_prompts, "decode-death")
    # Both decode replicas decoding split requests.
    wait_for(lambda: all(cluster.metric(name, "vllm:num_requests_running") > 0 for name in ("decode-a", "decode-b")),
             120, "the split requests did not decode on both decode replicas", list(cluster.roles.values()))
    cluster.roles["worker-decode-a"].process.send_signal(signal.SIGKILL)  # last: the cluster ends with it
    assert streams.texts() == local, cluster.logs()
    assert sum("migrating it with" in line for line in cluster.roles["split"].log) > migrated
