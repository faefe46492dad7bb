"""The routing policies: prefix weighs the prefill a replica saves against its load."""
from __future__ import annotations

from gateway.cluster.routing import LOAD_BLOCKS, TIER_BLOCK_COST, CachedPrefix, Candidate, pick


def test_prefix_goes_where_the_prompt_is_cached_unless_that_replica_is_much_busier() -> None:
    cold, warm = Candidate(load=0, cached=CachedPrefix(0)), Candidate(load=1, cached=CachedPrefix(10))
    assert pick("prefix", [cold, warm], prompt_blocks=12, turn=0) == 1  # saves 10 blocks for one request more
    busy = Candidate(load=4, cached=CachedPrefix(10))
    assert pick("prefix", [cold, busy], prompt_blocks=12, turn=0) == 0  # 16 blocks of load outweigh 10 saved
    short = Candidate(load=1, cached=CachedPrefix(LOAD_BLOCKS - 1))
    assert pick("prefix", [cold, short], prompt_blocks=LOAD_BLOCKS, turn=0) == 0  # a short prefix saves little


def test_ties_and_cold_prompts_go_by_load() -> None:
    candidates = [Candidate(load=3, cached=CachedPrefix(0)), Candidate(load=1, cached=CachedPrefix(0))]
    assert pick("prefix", candidates, prompt_blocks=5, turn=0) == 1
    assert pick("prefix", candidates, prompt_blocks=0, turn=0) == 1


def test_least_load_and_round_robin_ignore_the_cache() -> None:
    candidates = [Candidate(load=2, cached=CachedPrefix(9)), Candidate(load=1, cached=CachedPrefix(0))]
    assert pick("least-load", candidates, prompt_blocks=9, turn=0) == 1
    assert [pick("round-robin", candidates, prompt_blocks=9, turn=t) for t in range(4)] == [0, 1, 0, 1]


def test_a_tier_hit_is_cheaper_than_recomputing_and_dearer_than_a_device_hit() -> None:
    on_device = Candidate(load=0, cached=CachedPrefix(device=10))
    in_tiers = Candidate(load=0, cached=CachedPrefix(device=2, tiers=8))
    cold = Candidate(load=0, cached=CachedPrefix())
    assert pick("prefix", [in_tiers, on_device], prompt_blocks=12, turn=0) == 1
    assert pick("prefix", [cold, in_tiers], prompt_blocks=12, turn=0) == 1
    # Loading 8 blocks outweighs a request more in flight; it costs TIER_BLOCK_COST of a block each.
    busier = Candidate(load=1, cached=CachedPrefix(tiers=8))
    assert pick("prefix", [cold, busier], prompt_blocks=12, turn=0) == 1
    assert 0 < TIER_BLOCK_COST < 1
