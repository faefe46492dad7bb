"""The replicas' Stats and lease metadata as one engine's, for /metrics and the
gateway's limits."""
from __future__ import annotations

import msgspec

from services.histogram_counts import HistogramCounts
from services.messages import (
    CacheConfigInfo,
    EngineInfo,
    EngineStats,
    KvTierStats,
    KvTransferStats,
    LoraStats,
    SpecDecodingStats,
)
from services.metric_buckets import ITERATION_TOKENS
from services.pooling_params import PoolerConfig
from services.registry import Member


def engine_info(schedulers: list[Member]) -> EngineInfo:
    """What the schedulers know from their workers; replicas of one model agree on it."""
    eos = schedulers[0].metadata["eos_token_ids"]
    pooler = schedulers[0].metadata.get("pooler")
    return EngineInfo(min(int(s.metadata["max_model_len"]) for s in schedulers),
                      tuple(int(t) for t in eos.split(",") if t),
                      msgspec.json.decode(pooler, type=PoolerConfig) if pooler else None)


def total(stats: list[EngineStats]) -> EngineStats:
    """Every replica's stats as one: gauges, counters and histograms add up, usage is block-weighted."""
    blocks = sum(s.num_kv_blocks for s in stats)
    return EngineStats(
        num_requests_running=sum(s.num_requests_running for s in stats),
        num_requests_waiting=sum(s.num_requests_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / blocks if blocks else 0.0,
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_kv_blocks=blocks,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        iteration_tokens=sum((s.iteration_tokens for s in stats), HistogramCounts.zero(ITERATION_TOKENS)),
        cache_config=_fleet_cache_config([s.cache_config for s in stats if s.cache_config is not None]),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in stats),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in stats),
        kv_tiers=_fleet_tiers([tier for s in stats for tier in s.kv_tiers]),
        spec_decoding=_fleet_spec_decoding([s.spec_decoding for s in stats if s.spec_decoding is not None]),
        prompt_tokens_by_source=_summed([s.prompt_tokens_by_source for s in stats]),
        kv_transfer=_fleet_kv_transfer([s.kv_transfer for s in stats if s.kv_transfer is not None]),
        lora=_fleet_lora([s.lora for s in stats if s.lora is not None]),
    )


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for replica in counts:
        for key, count in replica.items():
            total[key] = total.get(key, 0) + count
    return total


def _fleet_kv_transfer(replicas: list[KvTransferStats]) -> KvTransferStats | None:
    if not replicas:
        return None
    return KvTransferStats(sum((r.bytes_transferred for r in replicas[1:]), replicas[0].bytes_transferred),
                           sum((r.xfer_time_seconds for r in replicas[1:]), replicas[0].xfer_time_seconds),
                           sum(r.expired_requests for r in replicas), sum(r.failed_blocks for r in replicas),
                           sum(r.held_blocks for r in replicas))


def _fleet_lora(replicas: list[LoraStats]) -> LoraStats | None:
    """The adapters any replica runs or queues, each once; max_lora the largest replica's."""
    if not replicas:
        return None
    return LoraStats(max(r.max_lora for r in replicas), list(dict.fromkeys(n for r in replicas for n in r.running)),
                     list(dict.fromkeys(n for r in replicas for n in r.waiting)))


def _fleet_spec_decoding(replicas: list[SpecDecodingStats]) -> SpecDecodingStats | None:
    """The replicas' speculative decoding counters summed, position by position."""
    if not replicas:
        return None
    per_pos = [0] * max(len(r.num_accepted_tokens_per_pos) for r in replicas)
    for replica in replicas:
        for position, count in enumerate(replica.num_accepted_tokens_per_pos):
            per_pos[position] += count
    return SpecDecodingStats(sum(r.num_drafts for r in replicas), sum(r.num_draft_tokens for r in replicas),
                             sum(r.num_accepted_tokens for r in replicas), per_pos)


def _fleet_tiers(tiers: list[KvTierStats]) -> list[KvTierStats]:
    """Each medium's counters summed over the replicas."""
    by_medium: dict[str, KvTierStats] = {}
    for tier in tiers:
        if (seen := by_medium.get(tier.medium)) is None:
            by_medium[tier.medium] = tier
            continue
        summed = {name: getattr(seen, name) + getattr(tier, name) for name in tier.__struct_fields__ if name != "medium"}
        by_medium[tier.medium] = KvTierStats(medium=tier.medium, **summed)
    return list(by_medium.values())


def _fleet_cache_config(configs: list[CacheConfigInfo]) -> CacheConfigInfo | None:
    """The replicas' KV cache as one, as their other stats are: the blocks of all of them,
    with the settings they share (replicas of one model run one configuration)."""
    if not configs:
        return None
    return msgspec.structs.replace(configs[0], num_gpu_blocks=sum(c.num_gpu_blocks for c in configs),
                                   num_cpu_blocks=sum(c.num_cpu_blocks for c in configs))
