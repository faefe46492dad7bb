"""vLLM-named engine flags, shared by every kvfleet command that builds an engine."""
from __future__ import annotations

import argparse
from dataclasses import fields

from services.config import EngineConfig

_HELP = {
    "model": "alias (smollm2), a .gguf file, or a HuggingFace model directory",
    "dtype": "auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16",
    "device": "auto, cpu or cuda",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (the per-step token budget)",
    "max_model_len": "context length; defaults to the model's",
    "num_gpu_blocks_override": "KV blocks to allocate, ignoring the memory budget",
    "kv_cache_memory": "bytes of KV cache on CPU",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "enable_prefix_caching": "reuse the KV of cached prompt prefixes",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "preemption_mode": "recompute or swap, when KV blocks run out",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "seed": "engine seed",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(EngineConfig):
        flag, help_text = f"--{f.name.replace('_', '-')}", f"{_HELP[f.name]} (default: %(default)s)"
        kind = str(f.type).split(" ")[0]
        if kind == "bool":  # --enable-x / --no-enable-x, as in vLLM
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind], default=f.default,
                                help=help_text)


def engine_args(namespace: argparse.Namespace) -> dict:
    return {f.name: getattr(namespace, f.name) for f in fields(EngineConfig)}
