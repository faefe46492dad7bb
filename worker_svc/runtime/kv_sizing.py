"""How many KV blocks a worker allocates: a fixed count when given, what its share of
the GPU's memory holds once a full step's activations are profiled, or on CPU the
budget given outright (worker_svc/runtime/kv_cache.py has the arithmetic)."""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from services.config import EngineConfig
from services.messages import StepPlan
from services.sampling_params import SamplingParams
from worker_svc.attention.backend import AttentionBackend
from worker_svc.formats.model_config import ModelConfig
from worker_svc.group.rank_group import RankGroup
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.runtime.batch import InputBatch, RequestState
from worker_svc.runtime.draft_model import DraftModel
from worker_svc.runtime.eagle_drafter import EagleDrafter
from worker_svc.runtime.kv_cache import allocate_kv_cache, bytes_per_block, check_fits_one_request

logger = logging.getLogger(__name__)


class SizedWorker(Protocol):
    """What sizing reads of a worker (runtime/worker.py, which calls this module as it starts)."""

    config: EngineConfig
    device: torch.device
    local_config: ModelConfig  # the heads and layers this rank computes
    block_size: int
    kv_dtype: torch.dtype
    max_model_len: int
    batch: InputBatch
    attention_backend: AttentionBackend
    model: LlamaForCausalLM
    group: RankGroup
    # Speculative decoding's draft model or EAGLE head: its KV shares the target's block ids.
    drafter: DraftModel | EagleDrafter | None


def size_kv_cache(worker: SizedWorker) -> int:
    """Blocks that fit the memory budget once a full step's activations are accounted for
    (on CPU the budget is each rank's). `worker` has its model and batch, no KV cache yet."""
    config, device = worker.config, worker.device
    block_bytes = bytes_per_block(worker.local_config, worker.block_size, worker.kv_dtype)
    if worker.drafter is not None:  # every block id is a block in both caches
        block_bytes += worker.drafter.bytes_per_block(worker.block_size, worker.kv_dtype)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        fits = num_blocks * worker.block_size
        if config.max_model_len is None and fits < worker.max_model_len:
            # A pool sized outright, and no length asked for: the context is what the pool holds
            # (vLLM starts too, and leaves longer requests waiting forever).
            logger.warning("--num-gpu-blocks-override %d holds %d tokens: max_model_len lowered from the model's %d "
                           "to %d (give --max-model-len to choose)", num_blocks, fits, worker.max_model_len, fits)
            worker.max_model_len = fits
    elif device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        profile_run(worker)
        free, total = torch.cuda.mem_get_info(device)
        # Weights plus the profiled step's peak, and whatever else holds memory.
        in_use = torch.cuda.max_memory_allocated(device) + (total - free - torch.cuda.memory_allocated())
        num_blocks = (int(total * config.gpu_memory_utilization) - in_use) // block_bytes
    else:
        # On CPU the KV budget is given outright, as vLLM's VLLM_CPU_KVCACHE_SPACE, and
        # activations come from the host heap: there is nothing for a profile to size.
        num_blocks = config.kv_cache_memory // block_bytes
    check_fits_one_request(num_blocks, worker.block_size, worker.max_model_len, block_bytes)
    return num_blocks


def profile_run(worker: SizedWorker) -> None:
    """Run one step of `max_num_batched_tokens` prompt tokens through a scratch cache, so
    the activation peak is known (and any OOM happens now, not mid-serving). Its requests
    take rows of the worker's batch for the step only; the worker's own are left alone."""
    block_size, max_model_len = worker.block_size, worker.max_model_len
    total = worker.config.max_num_batched_tokens
    lengths = [max_model_len] * (total // max_model_len) + [total % max_model_len]
    lengths = [n for n in lengths if n]
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    scratch = allocate_kv_cache(worker.local_config, sum(blocks_per_seq), block_size, worker.kv_dtype, worker.device)
    plan = StepPlan(step_id=-1)
    requests: dict[str, RequestState] = {}
    first_block = 0
    try:
        for index, (length, num_blocks) in enumerate(zip(lengths, blocks_per_seq)):
            request_id = f"profile-{index}"
            requests[request_id] = state = RequestState([0] * length, length, 0, SamplingParams(), None)
            worker.batch.add(state, list(range(first_block, first_block + num_blocks)))
            first_block += num_blocks
            plan.num_scheduled_tokens[request_id] = length
        inputs = worker.batch.prepare(plan, requests)
        metadata = worker.attention_backend.build_metadata(inputs.layout)
        hidden = worker.model(inputs.input_ids, inputs.positions, scratch, metadata)
        if worker.group.shard.is_last_stage:
            worker.model.compute_logits(hidden[: worker.config.max_num_seqs])
    finally:
        for state in requests.values():
            worker.batch.remove(state)
