"""The scheduler's settings: the step's budgets, the KV pool's shape, and which
features (chunked prefill, prefix caching, swap, async scheduling, speculation,
pooling, adapters) shape its plans."""
from __future__ import annotations

from dataclasses import dataclass

from services.pooling_params import PoolerConfig
from services.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    num_host_blocks: int = 0  # the swap pool
    # A request whose step is in flight may be planned into the next step, its input the
    # token that step will sample (vLLM's async scheduling; the worker fills it in).
    async_scheduling: bool = False
    # Speculative decoding (docs/speculative.md): drafts appended to decoding requests' steps.
    speculative: SpeculativeConfig | None = None
    # Set when the worker pools (docs/pooling.md): pooling requests share its steps with the others.
    pooler: PoolerConfig | None = None
    generates: bool = True  # False: it pools only (--runner pooling)
    # Adapters one step may run (--max-loras): a waiting request of another adapter waits.
    max_loras: int = 0
