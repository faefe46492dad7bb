"""Where and in what precision a worker computes: EngineConfig's device and dtype as torch objects."""
from __future__ import annotations

import torch

from services.config import EngineConfig


def torch_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    # "auto" is float32 on CPU (this CPU's bf16 matmuls gain little and lose parity) and bfloat16 on GPU.
    if config.dtype == "auto":
        return torch.bfloat16 if torch_device(config).type == "cuda" else torch.float32
    return getattr(torch, config.dtype)
