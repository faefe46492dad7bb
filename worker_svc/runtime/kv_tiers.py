"""Building a worker's offload tiers (docs/kv_connector.md) from its flags: host memory
beside the device pool, then the local and the shared directory, in the order a load
tries them."""
from __future__ import annotations

from typing import Protocol

import torch

from services.config import EngineConfig
from services.kv_block_files import file_tiers
from services.kv_transfer_config import DEFAULT_FETCH_TIMEOUT_S, nixl_installed
from services.model_source import ModelSource
from worker_svc.formats.model_config import ModelConfig
from worker_svc.runtime.kv_cache import allocate_kv_cache, bytes_per_block
from worker_svc.runtime.kv_layout_key import layout_key
from worker_svc.runtime.kv_nixl import NixlBlocks
from worker_svc.runtime.kv_peer import GrpcKvBlocks
from worker_svc.runtime.kv_transfer import KvTransfer


class TieredWorker(Protocol):
    config: EngineConfig
    source: ModelSource
    local_config: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype
    runs_q4: bool
    device: torch.device
    block_size: int
    kv_caches: list[torch.Tensor]


def build_kv_transfer(worker: TieredWorker) -> tuple[KvTransfer, int, str]:
    """The tiers' mover (and, with a --kv-transfer-config, the worker-to-worker transport:
    docs/disaggregation.md), the host tier's block count and the file tiers' layout key."""
    config = worker.config
    block_bytes = bytes_per_block(worker.local_config, worker.block_size, worker.kv_dtype)
    num_host_blocks = int(config.kv_offloading_size * 2**30) // block_bytes
    host_caches = []
    if num_host_blocks:
        host_caches = allocate_kv_cache(worker.local_config, num_host_blocks, worker.block_size, worker.kv_dtype,
                                        torch.device("cpu"))
        if worker.device.type == "cuda":  # pinned: copies to and from the device run asynchronously
            host_caches = [cache.pin_memory() for cache in host_caches]
    files, key = [], ""
    if config.kv_offloading_dir or config.kv_shared_dir:  # the key fingerprints the weights' files: only when used
        key = layout_key(worker.source, worker.local_config, dtype=worker.dtype, kv_dtype=worker.kv_dtype,
                         runs_q4=worker.runs_q4, device=worker.device, block_size=worker.block_size)
        files = file_tiers(config, key)
    transfer = config.kv_transfer
    # Where NIXL is installed, any worker serves consumers that read over it, and reads
    # over it when its scheduler's plan says so. Its agent is made now where its config
    # names a side of P/D (else at the first NIXL fetch): the half second it takes would
    # otherwise hold up the first transfer.
    nixl = NixlBlocks(worker.kv_caches) if nixl_installed() else None
    if nixl is not None and transfer is not None:
        nixl.agent()
    peer = GrpcKvBlocks(worker.kv_caches, transfer.fetch_timeout_s if transfer is not None else DEFAULT_FETCH_TIMEOUT_S,
                        nixl)
    return KvTransfer(worker.kv_caches, host_caches, files, peer, worker.scheduler_gone), num_host_blocks, key
