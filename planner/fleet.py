"""What the planner sees of the fleet each interval: the replicas in the registry and
their pools (from the `kv_role` and `kv_pool` in each scheduler's lease), each one's queue from its
Stats, and the latencies and rates (requests, generated tokens), either scraped from the gateways' /metrics (the
difference between two scrapes) or asked of Prometheus (`--prometheus-url`)."""
from __future__ import annotations

import json
import logging
import math
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from planner.decision import Observation, PoolObservation
from planner.histogram import bucket_delta, quantile
from services.messages import EngineStats
from services.registry import Member, Registry
from services.scheduler_messages import StatsRequest
from services.transport.channel import open_channel
from services.transport.role_services import SCHEDULER

logger = logging.getLogger(__name__)

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
REQUESTS = "vllm:request_success"
GENERATION_TOKENS = "vllm:generation_tokens"
STATS_TIMEOUT_S = 2.0
HTTP_TIMEOUT_S = 5.0


def pool_of(member: Member) -> str:
    """A scheduler's pool, from its lease: a kv_both replica given one (`kv_pool`) is in
    that one; otherwise kv_producer replicas prefill, kv_consumer and kv_both decode
    (gateways send them requests to decode), and the others are combined."""
    role = member.metadata.get("kv_role", "")
    return member.metadata.get("kv_pool") or (
        "prefill" if role == "kv_producer" else "decode" if role in ("kv_consumer", "kv_both") else "combined")


def home_of(member: Member) -> str:
    """The pool whose Deployment holds the replica's pod: the pool it was started in."""
    return member.metadata.get("kv_home_pool") or pool_of(member)


@dataclass(frozen=True)
class Replica:
    member: Member
    pool: str
    stats: EngineStats | None  # None: it did not answer

    @property
    def load(self) -> int:
        return self.stats.num_requests_running + self.stats.num_requests_waiting if self.stats else 0

    @property
    def home(self) -> str:
        return home_of(self.member)

    @property
    def movable(self) -> bool:
        """It can serve in either pool (kv_both, given one: scheduler_svc/pool_move.py)."""
        return bool(self.member.metadata.get("kv_pool"))


@dataclass(frozen=True)
class GatewayScrape:
    """The cumulative series the planner reads, summed over the gateways."""

    ttft: dict[float, float]
    itl: dict[float, float]
    requests: float
    generation_tokens: float = 0.0


def parse_gateway_metrics(text: str) -> GatewayScrape:
    ttft: dict[float, float] = defaultdict(float)
    itl: dict[float, float] = defaultdict(float)
    requests = generation_tokens = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{TTFT}_bucket":
                ttft[float(sample.labels["le"])] += sample.value
            elif sample.name == f"{ITL}_bucket":
                itl[float(sample.labels["le"])] += sample.value
            elif sample.name == f"{REQUESTS}_total":
                requests += sample.value
            elif sample.name == f"{GENERATION_TOKENS}_total":
                generation_tokens += sample.value
    return GatewayScrape(dict(ttft), dict(itl), requests, generation_tokens)


def _add(a: GatewayScrape, b: GatewayScrape) -> GatewayScrape:
    def add(x: dict[float, float], y: dict[float, float]) -> dict[float, float]:
        return {k: x.get(k, 0.0) + y.get(k, 0.0) for k in x.keys() | y.keys()}
    return GatewayScrape(add(a.ttft, b.ttft), add(a.itl, b.itl), a.requests + b.requests,
                         a.generation_tokens + b.generation_tokens)


def _computed_prompt_tokens(stats: EngineStats) -> int:
    # Prompt tokens the replica computed itself: not its cache hits, not KV it fetched.
    return stats.prompt_tokens_by_source.get("local_compute", 0)


class FleetReader:
    def __init__(self, registry: Registry, prometheus_url: str | None = None) -> None:
        self._registry = registry
        self._prometheus = prometheus_url.rstrip("/") if prometheus_url else None
        self._channels: dict[str, grpc.Channel] = {}
        # The previous interval's cumulative values, to take differences from.
        self._scrape: GatewayScrape | None = None
        self._prompt_tokens: dict[str, int] = {}
        self._at: float | None = None

    def replicas(self) -> list[Replica]:
        members = self._registry.members("scheduler")
        for gone in self._channels.keys() - {m.address for m in members}:
            self._channels.pop(gone).close()
        return [Replica(m, pool_of(m), self._stats(m)) for m in members]

    def _stats(self, member: Member) -> EngineStats | None:
        channel = self._channels.get(member.address)
        if channel is None:
            channel = self._channels[member.address] = open_channel(member.address)
        try:
            return SCHEDULER.stub(channel).Stats(StatsRequest(member.metadata.get("instance_id", "")),
                                                 timeout=STATS_TIMEOUT_S)
        except grpc.RpcError as exc:
            logger.warning("no stats from scheduler %s at %s: %s", member.id, member.address, exc.code())
            return None

    def observe(self, replicas: list[Replica], counts: dict[str, int], now_s: float, window_s: float) -> Observation:
        """The observation of the last interval. `counts`: each managed pool's replicas
        (its Deployment's, less those draining); `replicas`: the serving ones."""
        elapsed = now_s - self._at if self._at is not None else None
        self._at = now_s
        tokens = {r.member.id: _computed_prompt_tokens(r.stats) for r in replicas if r.stats}
        computed = sum(max(0, n - self._prompt_tokens[i]) for i, n in tokens.items() if i in self._prompt_tokens)
        self._prompt_tokens = tokens
        if self._prometheus:
            ttft, itl, request_rate, generation_rate = self._from_prometheus(window_s)
        else:
            ttft, itl, request_rate, generation_rate = self._from_gateways(elapsed)
        pools = {}
        for name, count in counts.items():
            members = [r for r in replicas if r.pool == name and r.stats]
            pools[name] = PoolObservation(
                count, sum(r.stats.num_requests_running for r in members),
                sum(r.stats.num_requests_waiting for r in members), serving=len(members))
        return Observation(ttft, itl, request_rate, computed / elapsed if elapsed else 0.0, pools,
                           generation_tokens_rate=generation_rate)

    def _from_gateways(self, elapsed: float | None) -> tuple[float | None, float | None, float, float | None]:
        scrape = GatewayScrape({}, {}, 0.0)
        for gateway in self._registry.members("gateway"):
            try:
                with urllib.request.urlopen(f"http://{gateway.address}/metrics", timeout=HTTP_TIMEOUT_S) as response:
                    scrape = _add(scrape, parse_gateway_metrics(response.read().decode()))
            except OSError as exc:
                logger.warning("no metrics from gateway %s at %s: %s", gateway.id, gateway.address, exc)
        before, self._scrape = self._scrape, scrape
        if before is None or not elapsed:
            return None, None, 0.0, None
        requests = scrape.requests - before.requests
        # A gateway that restarted counts from zero: no rate this interval, rather than a negative one.
        generated = scrape.generation_tokens - before.generation_tokens
        return (quantile(0.9, bucket_delta(scrape.ttft, before.ttft)), quantile(0.9, bucket_delta(scrape.itl, before.itl)),
                max(0.0, requests) / elapsed, generated / elapsed if generated >= 0 else None)

    def _from_prometheus(self, window_s: float) -> tuple[float | None, float | None, float, float | None]:
        window = f"{max(1, round(window_s))}s"

        def query(promql: str) -> float | None:
            url = f"{self._prometheus}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
            try:
                with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                    result = json.load(response)["data"]["result"]
            except (OSError, KeyError, ValueError) as exc:
                logger.warning("Prometheus query %r failed: %s", promql, exc)
                return None
            value = float(result[0]["value"][1]) if result else math.nan
            return None if math.isnan(value) else value

        def p90(name: str) -> float | None:
            return query(f"histogram_quantile(0.9, sum by (le) (rate({name}_bucket[{window}])))")

        return (p90(TTFT), p90(ITL), query(f"sum(rate({REQUESTS}_total[{window}]))") or 0.0,
                query(f"sum(rate({GENERATION_TOKENS}_total[{window}]))"))

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
