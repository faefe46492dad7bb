"""Which replica takes a request (`--routing-policy`).

- `prefix` (the default): the replica where the request costs least, counting in KV
  blocks of work: cost = (prompt blocks it does not hold) + LOAD_BLOCKS x (requests it
  runs or queues). The first term is the prefill the replica must compute before the
  first token; the second stands for the wait behind what it already has. Why this
  weight: a replica with a request more in flight is preferred only by a prefix of
  LOAD_BLOCKS blocks (64 tokens at block size 16), so a long shared prompt (a system
  prompt, a chat's earlier turns) sticks to where it is cached, while short or cold
  prompts, which save little, spread by load. Ties go to the less loaded replica.
  Dynamo's router weighs prefill blocks against the replica's active decode blocks;
  the gateway sees request counts (Stats, every poll) rather than block counts, hence
  the per-request weight.
  A block the replica can load from one of its KV offload tiers (host memory, disk, the
  shared store; docs/kv_connector.md) costs TIER_BLOCK_COST of a block recomputed: on
  this project's CPU machine a 16-token block of the default model loads from disk in
  about 1 ms where computing it takes about 50 ms, and the load adds a step's wait
  (docs/benchmarks.md, benchmarks/kv_tiers.py), so a tenth of a block is generous.
- `least-load`: the fewest requests running or queued.
- `round-robin`: each replica in turn.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "least-load", "round-robin")
LOAD_BLOCKS = 4
TIER_BLOCK_COST = 0.1


@dataclass(frozen=True)
class CachedPrefix:
    """How many leading blocks of a prompt a replica holds in its device pool, and how
    many after those it can load from its offload tiers."""

    device: int = 0
    tiers: int = 0


NOT_CACHED = CachedPrefix()


@dataclass(frozen=True)
class Candidate:
    load: int  # requests running or queued there
    cached: CachedPrefix  # the prompt's leading blocks it holds


def pick(policy: str, candidates: Sequence[Candidate], prompt_blocks: int, turn: int) -> int:
    """The index of the candidate that takes the request; `turn` counts requests (round-robin)."""
    if policy == "round-robin":
        return turn % len(candidates)
    if policy == "least-load":
        return min(range(len(candidates)), key=lambda i: candidates[i].load)

    def cost(i: int) -> tuple[float, int]:
        candidate, cached = candidates[i], candidates[i].cached
        computed = prompt_blocks - cached.device - cached.tiers
        return (computed + TIER_BLOCK_COST * cached.tiers + LOAD_BLOCKS * candidate.load, candidate.load)

    return min(range(len(candidates)), key=cost)
