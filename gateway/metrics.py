"""Prometheus metrics with vLLM V1's names, types, labels and buckets, so vLLM dashboards
and autoscaling triggers work.

Each app has its own CollectorRegistry: several apps in one process (tests, or one
process serving two ports) must not collide in the global one. What the scheduler
knows (its gauges, the tokens of each engine step, the cache config) is read from the
engine client's stats at scrape time; request counters and histograms are recorded by
the gateway as deltas stream through it.

Several gateway processes on one port (`cluster up --api-server-count N`) share their
counters and histograms through prometheus_client's multiprocess files in
$PROMETHEUS_MULTIPROC_DIR, as vLLM's API servers do: a scrape, whichever process
answers it, shows them summed over all (those of a process that exited included, so
they never go back). The per-process `process_*` and `python_*` series are left out then.

A request's phases come from both sides without comparing two clocks: the scheduler
measures queue and prefill time and sends them with the first token; decode time is
the gateway's own, from the first token it received to the last.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from services.engine_client import EngineClient
from services.messages import FirstTokenTimes
from services.metric_buckets import (
    INTER_TOKEN_LATENCY,
    REQUEST_LATENCY,
    REQUEST_PARAMS_N,
    TIME_TO_FIRST_TOKEN,
    token_count_buckets,
)
from services.telemetry import EngineStatsCollector

FINISH_REASONS = ("stop", "length", "abort")
# Read by prometheus_client when it is first imported: the process's values then live in files there.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# As vLLM does: no `<name>_created` series next to every counter and histogram. The
# switch is process-wide in prometheus_client.
disable_created_metrics()


@dataclass(frozen=True)
class TokenCountHistograms:
    """vLLM buckets these by max_model_len, which a cluster's gateway learns only once a
    scheduler has registered: they are made then."""

    max_model_len: int
    prompt: Histogram
    generation: Histogram
    max_tokens: Histogram
    max_generation: Histogram  # the longest choice of an API request


class GatewayMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        engine_stats = EngineStatsCollector(engine, model_name)
        self.registry.register(engine_stats)
        shared = os.environ.get(MULTIPROCESS_DIR_ENV)
        if shared:
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped, shared)
            self._scraped.register(engine_stats)  # the schedulers' own state, the same seen from every gateway
        else:
            # process_*, python_gc_* and python_info, which vLLM's /metrics also has.
            for collector in (ProcessCollector, PlatformCollector, GCCollector):
                collector(registry=self.registry)
            self._scraped = self.registry
        self._engine = engine
        self._engine_stats = engine_stats
        self._model_name = model_name
        self._token_counts: TokenCountHistograms | None = None
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY
        )
        self.e2e_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Seconds from arrival at the scheduler to first scheduled.",
            REQUEST_LATENCY,
        )
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds", "Seconds from first scheduled to the first token.", REQUEST_LATENCY
        )
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds", "Seconds from the first token to the last.", REQUEST_LATENCY
        )
        self.inference_time = self._histogram(
            "vllm:request_inference_time_seconds", "Seconds from first scheduled to the last token.", REQUEST_LATENCY
        )
        # Prefill/decode disaggregation (docs/disaggregation.md): a split request's time to
        # first token, phase by phase. No vLLM names: vLLM's proxy sees only the two requests.
        self.pd_queue_time = self._histogram(
            "kvfleet:pd_queue_time_seconds", "Split requests: seconds queued on the prefill and decode replicas.",
            TIME_TO_FIRST_TOKEN)
        self.pd_prefill_time = self._histogram(
            "kvfleet:pd_prefill_time_seconds", "Split requests: seconds of prefill on the prefill replica.",
            TIME_TO_FIRST_TOKEN)
        self.pd_transfer_time = self._histogram(
            "kvfleet:pd_kv_transfer_time_seconds",
            "Split requests: seconds the decode replica waited for the prompt's KV from the prefill replica.",
            TIME_TO_FIRST_TOKEN)
        self.pd_first_decode_time = self._histogram(
            "kvfleet:pd_first_decode_step_seconds",
            "Split requests: seconds from the KV's arrival to the first token (the uncached tail and one decode).",
            TIME_TO_FIRST_TOKEN)
        self.params_n = self._histogram("vllm:request_params_n", "The n of each API request.", REQUEST_PARAMS_N)
        # No vLLM name for it: vLLM queues without bound.
        self.requests_rejected = self._counter(
            "kvfleet:requests_rejected", "Requests answered 429 because every replica's queue was full.")

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, ["model_name"], registry=self.registry).labels(self._model_name)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(
            name, documentation, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self._model_name)

    def token_counts(self) -> TokenCountHistograms | None:
        """None while the engine is unknown (no request can have run then)."""
        if self._token_counts is None:
            info = self._engine.engine_info()
            if info is None:
                return None
            buckets = token_count_buckets(info.max_model_len)
            self._token_counts = TokenCountHistograms(
                info.max_model_len,
                self._histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.", buckets),
                self._histogram("vllm:request_generation_tokens", "Tokens generated by each finished request.",
                                buckets),
                self._histogram("vllm:request_params_max_tokens", "The max_tokens of each finished request.",
                                buckets),
                self._histogram("vllm:request_max_num_generation_tokens",
                                "Tokens generated by the longest choice of each API request.", buckets),
            )
        return self._token_counts

    def render(self, others: Sequence[GatewayMetrics] = ()) -> bytes:
        """The scrape; with `others`, the other models' series a gateway fronting several
        serves (gateway/model_router.py) too, each family once, its samples told apart by
        model_name."""
        for metrics in (self, *others):
            metrics.token_counts()  # shown from the first scrape that knows the engine, as vLLM shows them from the start
        if not others:
            return generate_latest(self._scraped)
        families: dict[str, Metric] = {}
        for family in [*self._scraped.collect(), *(f for other in others for f in other._own_families())]:
            if family.name in families:
                families[family.name].samples += family.samples
            else:
                families[family.name] = family
        return generate_latest(_Families(families.values()))

    def _own_families(self) -> list[Metric]:
        """This model's series alone, for another model's scrape: with shared multiprocess
        files those already hold its counters, and the process's own series are there once."""
        if self._scraped is not self.registry:
            return list(self._engine_stats.collect())
        return [family for family in self.registry.collect() if not family.name.startswith(("process_", "python_"))]

    def request(self, num_prompt_tokens: int, max_tokens: int | None) -> RequestMeter:
        """One engine request; `max_tokens` None: up to the context length."""
        return RequestMeter(self, num_prompt_tokens, max_tokens)

    def pooled(self, num_prompt_tokens: int, seconds: float) -> None:
        """One pooling request done (an embedding, a score, labels' scores, docs/pooling.md):
        counted as vLLM counts any request, its prompt tokens processed and its end a `stop`."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_success["stop"].inc()
        self.e2e_latency.observe(seconds)

    def choices_finished(self, n: int, max_generation_tokens: int) -> None:
        """Once per API request, when the last of its choices has ended."""
        self.params_n.observe(n)
        token_counts = self.token_counts()
        if token_counts is not None:
            token_counts.max_generation.observe(max_generation_tokens)


class _Families(list):
    """Metric families as generate_latest takes a registry."""

    def collect(self) -> list[Metric]:
        return self


class RequestMeter:
    """One engine request's timings and token counts. Inter-token latency is observed once
    per delta (one engine step), as vLLM does per iteration."""

    def __init__(self, metrics: GatewayMetrics, num_prompt_tokens: int, max_tokens: int | None) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._max_tokens = max_tokens
        self._arrival = time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None
        self._first_token_times: FirstTokenTimes | None = None
        self.num_generation_tokens = 0

    def tokens(self, count: int, first_token_times: FirstTokenTimes | None = None) -> None:
        """`first_token_times`: the scheduler's, which come with the first token."""
        if not count:
            return
        now = time.perf_counter()
        metrics = self._metrics
        if self._last is None:
            # The first token means the prompt has been processed.
            metrics.time_to_first_token.observe(now - self._arrival)
            metrics.prompt_tokens.inc(self._num_prompt_tokens)
            self._first = now
            self._first_token_times = first_token_times
        else:
            metrics.inter_token_latency.observe(now - self._last)
        self._last = now
        self.num_generation_tokens += count
        metrics.generation_tokens.inc(count)

    def finished(self, reason: str) -> None:
        metrics = self._metrics
        metrics.e2e_latency.observe(time.perf_counter() - self._arrival)
        metrics.request_success[reason].inc()
        times = self._first_token_times
        if times is not None:  # it reached a first token through the scheduler
            decode = self._last - self._first
            metrics.queue_time.observe(times.queued_s)
            metrics.prefill_time.observe(times.prefill_s)
            metrics.decode_time.observe(decode)
            metrics.inference_time.observe(times.prefill_s + decode)
            if times.remote_prefill_s:  # split: prefilled on a prefill replica, its KV moved here
                metrics.pd_queue_time.observe(times.remote_queued_s + times.queued_s)
                metrics.pd_prefill_time.observe(times.remote_prefill_s)
                metrics.pd_transfer_time.observe(times.kv_transfer_s)
                metrics.pd_first_decode_time.observe(times.prefill_s - times.kv_transfer_s)
        token_counts = metrics.token_counts()
        if token_counts is not None:
            token_counts.prompt.observe(self._num_prompt_tokens)
            token_counts.generation.observe(self.num_generation_tokens)
            max_tokens = self._max_tokens
            # vLLM's server fills in an absent max_tokens as what the context leaves.
            token_counts.max_tokens.observe(
                max_tokens if max_tokens is not None else token_counts.max_model_len - self._num_prompt_tokens
            )
