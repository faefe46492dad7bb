"""The worker's start-up summary: what it loaded, how it runs the weights, and its KV cache."""
from __future__ import annotations

from typing import TYPE_CHECKING

from worker_svc.model.q4_linear import Q4Linear
from worker_svc.model.q8_linear import Q8Linear
from worker_svc.runtime.kv_cache import bytes_per_block

if TYPE_CHECKING:
    from worker_svc.runtime.worker import Worker


def summary_lines(worker: Worker) -> list[str]:
    """The lines a worker logs once it is up: its model, weights and KV cache (a group's rank says which)."""
    model, dtype = worker.model_config, str(worker.dtype).removeprefix("torch.")
    if worker.runs_q4:
        int16 = [module.vnni for module in worker.model.modules()
                 if isinstance(module, (Q4Linear, Q8Linear)) and module.panels is not None]
        isa = "AVX-512 VNNI, AMX from 48 rows" if int16 and int16[0].amx else "AVX-512 VNNI"
        activations = f" against int16 activations ({isa})" if int16 else ""
        stored = (f"{model.quantization}, its 4-bit projections and 8-bit embedding run as stored{activations}, "
                  f"the rest in {dtype}")
    else:
        stored = f"{model.quantization} dequantized to {dtype}" if model.quantization else dtype
    if worker.encoder:
        return [f"model {worker.config.model}: {worker.source.path} ({model.architecture} encoder, "
                f"{model.num_hidden_layers} layers), pooling {worker.pooler_config.pooling_type}"
                f"{' normalized' if worker.pooler_config.normalize else ''}, inputs up to {worker.max_model_len} tokens",
                f"weights: {dtype} on {worker.device}, {worker.weights_bytes / 1e9:.2f} GB, loaded in "
                f"{worker.load_seconds:.1f} s; no KV cache (an encoder)"]
    kv_tokens = worker.num_blocks * worker.block_size
    kv_bytes = worker.num_blocks * bytes_per_block(worker.local_config, worker.block_size, worker.kv_dtype)
    shard, local = worker.group.shard, worker.local_config
    rank = [f"rank {shard.rank} of {shard.tp_size} TP x {shard.pp_size} PP: {local.num_hidden_layers} layers, "
            f"{local.num_attention_heads} heads, {local.num_key_value_heads} KV heads"] if worker.group.distributed else []
    return [
        f"model {worker.config.model}: {worker.source.path} ({model.architecture}, {model.num_hidden_layers} layers)",
        *rank,
        f"weights: {stored} on {worker.device}, {worker.weights_bytes / 1e9:.2f} GB, loaded in {worker.load_seconds:.1f} s",
        f"KV cache: {worker.num_blocks} blocks of {worker.block_size} tokens = {kv_tokens} tokens "
        f"({kv_bytes / 2**30:.2f} GiB of {str(worker.kv_dtype).removeprefix('torch.')}); maximum concurrency at "
        f"max_model_len {worker.max_model_len}: {kv_tokens / worker.max_model_len:.1f}x",
        *([worker.kv_transfer.describe()] if worker.config.has_kv_connector else []),
    ]
