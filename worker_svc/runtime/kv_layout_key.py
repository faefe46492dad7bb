"""The key a file tier keeps a model's KV blocks under: two workers share blocks only
when they would have computed the same bytes, so it covers the weights (a fingerprint
of their files' contents, the same on every machine), how they run (dtype, 4-bit
kernels or dequantized, device type), and the block's shape in memory."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from services.model_source import ModelFormat, ModelSource
from worker_svc.formats.model_config import ModelConfig

_SAMPLE_BYTES = 2**20


def layout_key(source: ModelSource, config: ModelConfig, *, dtype: torch.dtype, kv_dtype: torch.dtype,
               runs_q4: bool, device: torch.device, block_size: int) -> str:
    parts = [
        weights_fingerprint(source), str(dtype), str(kv_dtype), f"q4-as-stored={runs_q4}", device.type,
        f"block={block_size}", f"layers={config.num_hidden_layers}", f"kv_heads={config.num_key_value_heads}",
        f"head_dim={config.head_dim}", "layout=[layer][k|v][token][head][dim]",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def weights_fingerprint(source: ModelSource) -> str:
    """Each weights file's size and its first and last MiB: cheap, and it tells apart
    revisions and quantizations of one model wherever the files were copied."""
    if source.format is ModelFormat.GGUF:
        files = [source.path]
    else:
        files = sorted(source.path.glob("*.safetensors")) or sorted(source.path.glob("*.bin"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(_sample(path))
    return digest.hexdigest()


def _sample(path: Path) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(_SAMPLE_BYTES)
        file.seek(max(size - _SAMPLE_BYTES, 0))
        tail = file.read(_SAMPLE_BYTES)
    return f"{path.name}:{size}:".encode() + head + tail
