"""Engine configuration, with vLLM's names and defaults where vLLM has them."""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16")


@dataclass
class EngineConfig:
    model: str = "smollm2"
    # "auto" is float32 on CPU (this CPU's bf16 matmuls gain little and lose parity) and bfloat16 on GPU.
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int = 4 * 2**30  # bytes of KV on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE default)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
