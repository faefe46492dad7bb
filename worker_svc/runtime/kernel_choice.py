"""Which kernels a worker runs: on CUDA (or when asked, through the interpreter) Triton's
paged attention and fused decoder ops, with decode steps captured as CUDA graphs; on
CPU torch, with the C++ paged decode and prefill attention and decoder ops where they apply."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from services.config import EngineConfig
from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.cpu import TorchAttentionBackend
from worker_svc.attention.gpu import TritonAttentionBackend
from worker_svc.formats.model_config import ModelConfig
from worker_svc.group.rank_group import RankGroup
from worker_svc.kernels.cpu import paged_decode, paged_prefill
from worker_svc.kernels.cpu.decoder_ops import DecoderKernel
from worker_svc.kernels.cpu.decoder_ops import load as load_decoder_kernel
from worker_svc.model.ops import CpuOps, Ops, TorchOps, TritonOps
from worker_svc.runtime.batch import InputBatch
from worker_svc.runtime.cuda_graphs import TOKEN_IDS, DecodeGraphs, Outputs, RowInputs

logger = logging.getLogger(__name__)


def uses_triton(config: EngineConfig, device: torch.device) -> bool:
    """Whether attention and the decoder's elementwise work run as Triton kernels."""
    return config.attention_backend == "triton" or (config.attention_backend == "auto" and device.type == "cuda")


def decoder_ops(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Ops:
    """How the norms, rotary embedding and activation run: Triton's kernels with Triton's
    attention, the C++ ones for float32 on CPU where they build, else torch's operators."""
    if uses_triton(config, device):
        return TritonOps()
    kernel = _cpu_decoder_kernel(device, dtype)
    return TorchOps() if kernel is None else CpuOps(kernel)


def _cpu_decoder_kernel(device: torch.device, dtype: torch.dtype) -> DecoderKernel | None:
    """The C++ decoder kernels, for a float32 model on CPU where they build."""
    return load_decoder_kernel() if device.type == "cpu" and dtype == torch.float32 else None


def attention_backend(config: EngineConfig, device: torch.device, local: ModelConfig,
                      dtype: torch.dtype) -> AttentionBackend:
    """`local`: the heads this rank computes."""
    if uses_triton(config, device):
        return TritonAttentionBackend()
    decode = paged_decode.PagedDecodeKernel.supports(dtype, device, local.head_dim) and _enabled("DECODE")
    prefill = paged_prefill.PagedPrefillKernel.supports(dtype, device, local.head_dim) and _enabled("PREFILL")
    return TorchAttentionBackend(paged_decode.load_kernel() if decode else None, _cpu_decoder_kernel(device, dtype),
                                 paged_prefill.load_kernel() if prefill else None)


def _enabled(attention: str) -> bool:
    """KVFLEET_DECODE_KERNEL=0 or KVFLEET_PREFILL_KERNEL=0 keeps that attention on torch's SDPA
    (to compare, or to rule a kernel out)."""
    return os.environ.get(f"KVFLEET_{attention}_KERNEL", "1") != "0"


def decode_graphs(config: EngineConfig, device: torch.device, group: RankGroup, model: Callable[..., Outputs],
                  backend: AttentionBackend, kv_caches: list[torch.Tensor], batch: InputBatch,
                  inputs: RowInputs = TOKEN_IDS) -> DecodeGraphs | None:
    """CUDA graphs for decode steps (and verification steps, with speculative decoding), on a
    GPU running the Triton kernels, unless --enforce-eager."""
    if device.type != "cuda":
        if config.enforce_eager:
            logger.info("--enforce-eager has no effect on %s: only CUDA steps replay graphs", device)
        return None
    sizes = config.graph_sizes()
    if not sizes or not uses_triton(config, device):
        return None
    if group.distributed:
        logger.info("worker groups run eagerly: their collectives are not captured in CUDA graphs yet")
        return None
    spec_tokens = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return DecodeGraphs(model, backend, kv_caches, sizes, batch.max_blocks, batch.block_size, device, spec_tokens,
                        inputs)
