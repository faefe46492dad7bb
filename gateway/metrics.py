"""Prometheus metrics under vLLM's names, so vLLM dashboards and autoscaling triggers work.

Each app has its own CollectorRegistry: several apps in one process (tests, or one
process serving two ports) must not collide in the global one. Scheduler gauges are
read from the engine client's stats at scrape time; request counters and latency
histograms are recorded by the gateway as deltas stream through it.
"""
from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from services.engine_client import EngineClient
from services.telemetry import EngineStatsCollector

# vLLM's buckets, so histograms line up with its dashboards.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")

# As vLLM does: no `<name>_created` series next to every counter and histogram. The
# switch is process-wide in prometheus_client.
disable_created_metrics()


class GatewayMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engine, model_name))
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=self.registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=self.registry
        ).labels(model_name)
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry,
        ).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, num_prompt_tokens: int) -> RequestMeter:
        return RequestMeter(self, num_prompt_tokens)


class RequestMeter:
    """One request's timings. Inter-token latency is observed once per delta (one
    engine step), as vLLM does per iteration."""

    def __init__(self, metrics: GatewayMetrics, num_prompt_tokens: int) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = time.perf_counter()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        metrics = self._metrics
        if self._last is None:
            # The first token means the prompt has been processed.
            metrics.time_to_first_token.observe(now - self._arrival)
            metrics.prompt_tokens.inc(self._num_prompt_tokens)
        else:
            metrics.inter_token_latency.observe(now - self._last)
        self._last = now
        metrics.generation_tokens.inc(count)

    def finished(self, reason: str) -> None:
        self._metrics.e2e_latency.observe(time.perf_counter() - self._arrival)
        self._metrics.request_success[reason].inc()
