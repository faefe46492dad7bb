"""Prometheus exposition shared by every role, under vLLM's metric names."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from itertools import accumulate
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector
from prometheus_client.utils import floatToGoString

from services.messages import EngineStats
from services.metric_buckets import ITERATION_TOKENS, KV_LOAD_SECONDS, KV_TRANSFER_BYTES


class HasStats(Protocol):
    def stats(self) -> EngineStats: ...


class EngineStatsCollector(Collector):
    """A scheduler's gauges, counters and histograms, read at scrape time (never pushed
    from the step loop)."""

    _GAUGES = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_requests_running"),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_requests_waiting"),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    )
    _COUNTERS = (
        ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
        ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the KV offload tiers.",
         "external_prefix_cache_queries"),
        ("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the KV offload tiers.",
         "external_prefix_cache_hits"),
    )
    # Per offload tier (label `medium`: CPU, DISK or SHARED), from KvTierStats.
    _TIER_COUNTERS = (
        ("kvfleet:kv_offload_stored_blocks", "KV blocks written to the tier.", "stored_blocks"),
        ("kvfleet:kv_offload_stored_bytes", "Bytes written to the tier.", "stored_bytes"),
        ("kvfleet:kv_offload_loaded_blocks", "KV blocks loaded from the tier (prefix hits).", "loaded_blocks"),
        ("kvfleet:kv_offload_loaded_bytes", "Bytes loaded from the tier.", "loaded_bytes"),
        ("kvfleet:kv_offload_evicted_blocks", "KV blocks the tier evicted to stay in its bound.", "evicted_blocks"),
        ("kvfleet:kv_offload_evicted_bytes", "Bytes the tier evicted.", "evicted_bytes"),
        ("kvfleet:kv_offload_failures", "Bad blocks read and writes that failed (each a miss, recomputed).",
         "failed"),
    )

    def __init__(self, source: HasStats, model_name: str) -> None:
        self._source = source
        self._labels = [model_name]

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would call collect() (and the engine) on register.
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._source.stats())

    def _families(self, stats: EngineStats | None) -> Iterator[Metric]:
        for kind, specs in ((GaugeMetricFamily, self._GAUGES), (CounterMetricFamily, self._COUNTERS)):
            for name, doc, attribute in specs:
                family = kind(name, doc, labels=["model_name"])
                if stats is not None:
                    family.add_metric(self._labels, getattr(stats, attribute))
                yield family
        yield self._iteration_tokens(stats)
        yield from self._tier_families(stats)
        yield from self._spec_decoding_families(stats)
        yield from self._kv_transfer_families(stats)
        yield from _lora_requests_info(stats)
        yield _cache_config_info(stats)

    def _tier_families(self, stats: EngineStats | None) -> Iterator[Metric]:
        tiers = stats.kv_tiers if stats is not None else []
        for name, doc, attribute in self._TIER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name", "medium"])
            for tier in tiers:
                family.add_metric([*self._labels, tier.medium], getattr(tier, attribute))
            yield family
        family = HistogramMetricFamily("kvfleet:kv_offload_load_seconds",
                                       "Seconds one request's blocks took to load from the tier.",
                                       labels=["model_name", "medium"])
        bounds = [floatToGoString(bound) for bound in KV_LOAD_SECONDS] + ["+Inf"]
        for tier in tiers:
            counts = tier.load_seconds
            family.add_metric([*self._labels, tier.medium], list(zip(bounds, accumulate(counts.counts))), counts.sum)
        yield family

    _SPEC_COUNTERS = (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
    )

    def _spec_decoding_families(self, stats: EngineStats | None) -> Iterator[Metric]:
        """Samples only when speculative decoding is configured, as vLLM exports them."""
        spec = stats.spec_decoding if stats is not None else None
        for name, doc, attribute in self._SPEC_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            if spec is not None:
                family.add_metric(self._labels, getattr(spec, attribute))
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=["model_name", "position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos if spec is not None else []):
            family.add_metric([*self._labels, str(position)], count)
        yield family

    def _kv_transfer_families(self, stats: EngineStats | None) -> Iterator[Metric]:
        """Where prompt tokens' KV came from (vLLM's name), and the prefill/decode handoffs
        (docs/disaggregation.md; vLLM's NIXL connector counts the same as vllm:nixl_*)."""
        family = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                                     labels=["model_name", "source"])
        for source, count in (stats.prompt_tokens_by_source if stats is not None else {}).items():
            family.add_metric([*self._labels, source], count)
        yield family
        transfer = stats.kv_transfer if stats is not None else None
        for name, doc, attribute in (
            ("kvfleet:kv_transfer_bytes", "Bytes each fetch of a prompt's KV from a prefill replica moved.",
             "bytes_transferred"),
            ("kvfleet:kv_transfer_seconds", "Seconds each fetch of a prompt's KV from a prefill replica took.",
             "xfer_time_seconds"),
        ):
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            if transfer is not None:
                counts = getattr(transfer, attribute)
                bounds = [floatToGoString(b) for b in (KV_TRANSFER_BYTES if "bytes" in name else KV_LOAD_SECONDS)]
                family.add_metric(self._labels, list(zip([*bounds, "+Inf"], accumulate(counts.counts))), counts.sum)
            yield family
        for kind, name, doc, attribute in (
            (CounterMetricFamily, "kvfleet:kv_transfer_expired_requests",
             "Prefills whose held KV no decode replica fetched in time (freed).", "expired_requests"),
            (CounterMetricFamily, "kvfleet:kv_transfer_failed_blocks",
             "Blocks a fetch from a prefill replica did not bring (recomputed).", "failed_blocks"),
            (GaugeMetricFamily, "kvfleet:kv_transfer_held_blocks", "Blocks held for decode replicas to fetch.",
             "held_blocks"),
        ):
            family = kind(name, doc, labels=["model_name"])
            if transfer is not None:
                family.add_metric(self._labels, getattr(transfer, attribute))
            yield family

    def _iteration_tokens(self, stats: EngineStats | None) -> Metric:
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Tokens per engine step: prompts reaching a first token, plus tokens sampled.",
            labels=["model_name"],
        )
        if stats is not None:
            counts = stats.iteration_tokens
            bounds = [floatToGoString(bound) for bound in ITERATION_TOKENS] + ["+Inf"]
            family.add_metric(self._labels, list(zip(bounds, accumulate(counts.counts))), counts.sum)
        return family


def _cache_config_info(stats: EngineStats | None) -> Metric:
    """An info metric as vLLM makes one: a gauge at 1 whose labels are the config (and no model_name)."""
    config = stats.cache_config if stats is not None else None
    labels = {key: str(value) for key, value in msgspec.structs.asdict(config).items()} if config is not None else {}
    family = GaugeMetricFamily("vllm:cache_config_info", "The KV cache configuration, as labels.", labels=list(labels))
    if config is not None:
        family.add_metric(list(labels.values()), 1)
    return family


def _lora_requests_info(stats: EngineStats | None) -> Iterator[Metric]:
    """vLLM's, only where LoRA is enabled: one sample whose labels are the adapters in use
    (comma-separated names) and whose value is the time it was read, which routers such as
    the Gateway API Inference Extension read to route by loaded adapters."""
    lora = stats.lora if stats is not None else None
    if lora is None:
        return
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    family.add_metric([str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running)], time.time())
    yield family


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """Every role logs the same way, to stderr, for the process supervisor to collect."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def serve_role_metrics(port: int, host: str, extra: Collector | None = None) -> None:
    """/metrics on `port` (0: off) with the process collectors, plus the role's own."""
    if not port:
        return
    registry: CollectorRegistry = REGISTRY
    if extra is not None:
        registry.register(extra)
    start_http_server(port, addr=host, registry=registry)
