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
    "seed": "engine seed",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(EngineConfig):
        kind = {"int": int, "float": float, "str": str}[str(f.type).split(" ")[0]]
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=f"{_HELP[f.name]} (default: %(default)s)"
        )


def engine_args(namespace: argparse.Namespace) -> dict:
    return {f.name: getattr(namespace, f.name) for f in fields(EngineConfig)}
