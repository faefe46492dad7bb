"""Sizing and allocating the paged KV cache."""
from __future__ import annotations

import math
import mmap

import torch

from worker_svc.formats.model_config import ModelConfig


class KVCacheTooSmall(ValueError):
    pass


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element_size


def check_fits_one_request(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int) -> None:
    """Fail at start-up, not mid-request, when a max-length request cannot fit."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise KVCacheTooSmall(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), but one request of "
            f"max_model_len={max_model_len} needs {needed} blocks ({needed * block_bytes / 2**20:.1f} MiB); "
            "lower --max-model-len, or give the cache more memory (--kv-cache-memory on CPU, "
            "--gpu-memory-utilization on GPU, or --num-gpu-blocks-override)"
        )


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.

    Zeroed, not empty: padded reads of never-written slots are masked out of the
    softmax, but NaN garbage there would still poison the weighted sum.
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [_zeros(shape, dtype, device) for _ in range(config.num_hidden_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # An anonymous mapping is zero pages the OS maps lazily, so a multi-GiB pool costs
    # nothing until blocks are used (torch.zeros would touch every page now). Huge pages:
    # first writes to 4 KB pages faulted one page at a time, 9% of a batch workload's time.
    # The mapping is shared, so the kernel grants them only where shmem may have them
    # (/sys/kernel/mm/transparent_hugepage/shmem_enabled advise or always). A private
    # mapping, which a machine with shmem's set to never would give them, ran the 64-request
    # workload slower there (31.8-32.1 s against 27.3-30.8): compaction stalled first writes.
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pool = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pool.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pool, dtype=torch.uint8).view(dtype).view(shape)


def copy_blocks(
    pairs: list[tuple[int, int]], sources: list[torch.Tensor], destinations: list[torch.Tensor]
) -> None:
    """Copy whole blocks (source id, destination id) between two per-layer caches, e.g. device and host."""
    if not pairs:
        return
    source_ids = torch.tensor([source for source, _ in pairs], device=sources[0].device)
    destination_ids = torch.tensor([destination for _, destination in pairs], device=destinations[0].device)
    for source, destination in zip(sources, destinations):
        destination[:, destination_ids] = source[:, source_ids].to(destination.device)
