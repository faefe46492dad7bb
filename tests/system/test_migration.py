"""Routing and requests that outlive their replica (real processes: nats-server, Redis, a
tokenizer, two replicas of a worker and a scheduler each, gateways). Requests sharing a
long prefix go to the replica that holds it, seen in the replicas' own
vllm:prefix_cache_hits, through a gateway started after the prefix was cached too (it
loads the replicas' KV snapshots). Then, with 8 greedy streams in flight,
kill -9 of a worker, then of a scheduler, then a worker stopped (SIGSTOP: hung, not
dead), and every stream completes with exactly the text an uninterrupted run gives, no
error event, each migrated by its gateway to the other replica; the hung worker is
declared lost within its step deadline, and rejoins once continued. A gateway with
--migration-limit 0 gives its clients the error instead; and when it is killed, the
schedulers abort its requests once its lease lapses. Last, the planner scales the pool
down under load by draining a replica, and no stream loses a token.
They run in this order on one cluster; each fault's role is restarted after it.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvfleet.processes import free_port
from planner.actuator import Actuator
from planner.decision import Capacity, Decision
from planner.fleet import FleetReader
from planner.kube import Deployments

from fake_kube import FakeKubeApi
from role_cluster import RoleCluster, serving
from servers import HOST, RoleProcess, nats, redis_url  # noqa: F401  (fixtures)
from streamed_chat import StreamedChat, in_flight
from test_worker_failover import health, wait_for

LEASE_TTL_S = 3.0
STEP_TIMEOUT_S = 5.0  # per 512 tokens: these steps hold under 300
# Dense weights: a migrated request's tokens so far are recomputed as one prefill, and only
# the dense path computes them exactly as its decode steps did, whatever the batch (the
# 4-bit path's large steps take another GEMM, so under load a near-tie could flip a token).
ENGINE_FLAGS = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "256",
                "--kv-cache-memory", str(256 * 2**20)]
TOKENS = 64
STREAMS = 8


def request(index: int, max_tokens: int = TOKENS) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": f"Write about the number {index}."}],
            "max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


class Cluster(RoleCluster):
    def __init__(self, nats_url: str, redis_url: str) -> None:
        super().__init__(redis_url, num_replicas=2)
        registry = ["--redis-url", redis_url, "--lease-ttl", str(LEASE_TTL_S)]
        self.roles["tokenizer"] = RoleProcess("tokenizer", "--port", "0", *registry)
        for name in ("a", "b"):
            worker_port, metrics_port = free_port(), free_port()
            self.metrics[name] = f"http://{HOST}:{metrics_port}/metrics"
            self.roles[f"worker-{name}"] = RoleProcess("worker", *ENGINE_FLAGS, "--port", str(worker_port), *registry)
            self.roles[f"scheduler-{name}"] = RoleProcess(
                "scheduler", *ENGINE_FLAGS, "--port", str(free_port()), "--worker-address", f"{HOST}:{worker_port}",
                "--worker-step-timeout", str(STEP_TIMEOUT_S), "--metrics-port", str(metrics_port),
                "--nats-url", nats_url, *registry)
        self.nats_url, self.registry_flags = nats_url, registry
        for name, flags in (("gateway", []), ("gateway-no-migration", ["--migration-limit", "0"])):
            port = free_port()
            self.roles[name] = RoleProcess("gateway", "--port", str(port), "--nats-url", nats_url, *registry, *flags)
            self.urls[name] = f"http://{HOST}:{port}"


@pytest.fixture(scope="module")
def cluster(nats, redis_url) -> Iterator[Cluster]:
    with serving(Cluster(nats.url, redis_url)) as started:
        yield started


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> list[str]:
    """Each request's text, uninterrupted."""
    client = openai.OpenAI(base_url=f"{cluster.urls['gateway']}/v1", api_key="none", max_retries=0, timeout=300)
    return [client.chat.completions.create(**request(index)).choices[0].message.content for index in range(STREAMS)]


def prefix_metrics(cluster: Cluster) -> dict[str, dict[str, float]]:
    metrics = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return {name: {metric: cluster.metric(name, metric) for metric in metrics} for name in cluster.metrics}


def complete(url: str, prompt: str, max_tokens: int = 2) -> None:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200


PREFIX = "You are a careful assistant for a library. " + " ".join(f"Rule {i}: be kind to book {i}." for i in range(12))


def routes_by_prefix(cluster: Cluster, url: str, warm: str) -> None:
    """A long request sharing the prefix makes `warm` the busier replica; three more,
    meanwhile, must go there too (a least-load router would send them to the other)."""
    blocker = threading.Thread(target=complete, args=(url, PREFIX + " Tell a long story.", 100))
    blocker.start()
    wait_for(lambda: cluster.metric(warm, "vllm:num_requests_running") == 1, 30,
             "the long request did not go where its prefix is", list(cluster.roles.values()))
    before = prefix_metrics(cluster)
    for index in range(1, 4):
        complete(url, PREFIX + f" Question {index}: where is book {index}?")
    after = prefix_metrics(cluster)
    assert cluster.metric(warm, "vllm:num_requests_running") == 1  # still the busier one
    # Each of the three found the prefix there (at least 6 of its blocks), and the other replica got none.
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    assert after[warm][hits] - before[warm][hits] >= 3 * 96, (warm, before, after)
    assert after[other(warm)][queries] == before[other(warm)][queries], (warm, before, after)
    blocker.join(120)


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(cluster: Cluster) -> None:
    def queries() -> dict[str, float]:
        return {name: cluster.metric(name, "vllm:prefix_cache_queries_total") for name in cluster.metrics}

    before = queries()
    complete(cluster.urls["gateway"], PREFIX + " Question 0: where is the atlas?")
    after = queries()
    [warm] = [name for name in after if after[name] > before[name]]
    time.sleep(1.0)  # its KV events have reached the gateways
    routes_by_prefix(cluster, cluster.urls["gateway"], warm)

    port = free_port()  # a gateway that starts now: it has seen none of the events
    late = RoleProcess("gateway", "--port", str(port), "--nats-url", cluster.nats_url, *cluster.registry_flags)
    try:
        url = f"http://{HOST}:{port}"
        wait_for(lambda: health(url) == 200, 60, "the late gateway did not come up", [late])
        wait_for(lambda: sum("KV index: scheduler" in line for line in late.log) >= 2, 60,
                 "the late gateway did not load both replicas' snapshots", [late])
        routes_by_prefix(cluster, url, warm)
    finally:
        late.kill()


def other(name: str) -> str:
    return "b" if name == "a" else "a"


def greedy_streams(url: str, max_tokens: int = TOKENS) -> list[StreamedChat]:
    """STREAMS streamed greedy chats, each in flight (a token received)."""
    return in_flight(url, [request(index, max_tokens) for index in range(STREAMS)])


def migrations(cluster: Cluster) -> int:
    return sum("migrating it with" in line for line in cluster.roles["gateway"].log)


@pytest.mark.parametrize("killed", ["worker-a", "scheduler-b"])
def test_a_dying_replica_loses_no_token(cluster: Cluster, reference: list[str], killed: str) -> None:
    before = migrations(cluster)
    streams = greedy_streams(cluster.urls["gateway"])
    cluster.roles[killed].process.send_signal(signal.SIGKILL)
    for stream in streams:
        stream.join(300)
    assert [(s.error, s.finish_reason, s.tokens) for s in streams] == [(None, "length", TOKENS)] * STREAMS, (
        cluster.logs())
    assert [s.text for s in streams] == reference
    assert migrations(cluster) > before  # some of them ran there
    cluster.restart(killed)


def test_a_hung_worker_is_declared_lost_and_its_requests_move(cluster: Cluster, reference: list[str]) -> None:
    before = migrations(cluster)
    streams = greedy_streams(cluster.urls["gateway"])
    worker = cluster.roles["worker-a"].process
    worker.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(lambda: migrations(cluster) > before, 2 * STEP_TIMEOUT_S + 5, "the hung worker's requests did not move",
                 list(cluster.roles.values()))
        assert time.monotonic() - stopped < 2 * STEP_TIMEOUT_S + 5
        for stream in streams:
            stream.join(300)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert [(s.error, s.finish_reason, s.tokens) for s in streams] == [(None, "length", TOKENS)] * STREAMS, (
        cluster.logs())
    assert [s.text for s in streams] == reference
    cluster.wait_for_replicas()  # continued, it serves again, from an empty cache
    again = greedy_streams(cluster.urls["gateway"])
    for stream in again:
        stream.join(300)
    assert [s.text for s in again] == reference, cluster.logs()


def test_without_migration_the_client_gets_the_error(cluster: Cluster) -> None:
    streams = greedy_streams(cluster.urls["gateway-no-migration"])
    cluster.roles["worker-b"].process.send_signal(signal.SIGKILL)
    for stream in streams:
        stream.join(300)
    failed = [s for s in streams if s.error is not None]
    assert failed and all(isinstance(s.error, openai.APIError) for s in failed), cluster.logs()
    assert all((s.finish_reason, s.tokens) == ("length", TOKENS) for s in streams if s.error is None)
    cluster.restart("worker-b")


def running(url: str) -> float:
    """Requests running on every replica, as a gateway's /metrics sums them."""
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_a_dead_gateways_requests_are_aborted_once_its_lease_lapses(cluster: Cluster) -> None:
    greedy_streams(cluster.urls["gateway-no-migration"], max_tokens=200)  # ~10 s or more each, uninterrupted
    witness = cluster.urls["gateway"]
    wait_for(lambda: running(witness) > 0, 5, "the requests do not show", list(cluster.roles.values()))
    cluster.roles["gateway-no-migration"].process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Its lease lapses within a TTL; then a scheduler's next registry read (every TTL/4) and
    # step, and the witness gateway's next stats poll (0.5 s).
    wait_for(lambda: running(witness) == 0, LEASE_TTL_S + 2, "a dead gateway's requests still run",
             list(cluster.roles.values()))
    assert time.monotonic() - killed < LEASE_TTL_S + 2


def test_the_planner_drains_a_replica_under_load_and_every_stream_finishes(cluster: Cluster, reference: list[str],
                                                                           tmp_path) -> None:
    """Scale-down by draining (planner/actuator.py, scheduler_svc/drain_request.py): with the
    streams in flight on both replicas, the planner takes the pool from 2 to 1 through a
    fake Kubernetes API; the replica it drains finishes its streams, each exactly the
    uninterrupted text, then leaves the registry, and only then is the scale patched."""
    api = FakeKubeApi({("llm", "kvfleet-replica"): 2})
    reader = FleetReader(cluster.registry)
    try:
        actuator = Actuator(cluster.registry, Deployments("llm", api.kubeconfig(tmp_path)),
                            {"combined": "kvfleet-replica"}, drain_timeout_s=120)
        reader.observe(reader.replicas(), {"combined": 2}, time.monotonic(), 30.0)  # the scrape to count from
        streams = greedy_streams(cluster.urls["gateway"])
        replicas = reader.replicas()
        counts = actuator.counts([r.member for r in replicas])
        assert counts == {"combined": 2}
        actuator.apply(Decision(0.0, {"combined": 1}, {"combined": 1}, Capacity(1, 1), {}), replicas, counts)
        (victim,) = actuator.draining
        assert next(r for r in replicas if r.member.id == victim).load > 0  # it had streams to finish
        deadline = time.monotonic() + 120
        while actuator.draining and time.monotonic() < deadline:
            assert not [c for c in api.calls if c.method == "PATCH"]  # no patch while it drains
            actuator.settle_drains(cluster.registry.members("scheduler"))
            time.sleep(0.2)
        for stream in streams:
            stream.join(300)
        assert [(s.error, s.finish_reason, s.tokens) for s in streams] == [(None, "length", TOKENS)] * STREAMS, (
            cluster.logs())
        assert [s.text for s in streams] == reference
        assert [(c.method, c.body) for c in api.calls if c.method == "PATCH"] == [("PATCH", {"spec": {"replicas": 1}})]
        # What the planner read of it from the gateways' /metrics and the replicas' Stats.
        seen = reader.observe(reader.replicas(), {"combined": 1}, time.monotonic(), 30.0)
        assert 0 < seen.ttft_p90_s < 60 and 0 < seen.itl_p90_s < 60 and seen.request_rate > 0, seen
        assert seen.pools["combined"].serving == 1
        assert victim not in {m.id for m in cluster.registry.members("scheduler")}
    finally:
        reader.close()
        api.close()
