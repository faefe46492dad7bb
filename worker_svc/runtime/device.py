"""Where and in what precision a worker computes: EngineConfig's device, dtype and KV cache
dtype as torch objects, refused with a ConfigError when this torch cannot use them, and whether a GGUF
file's 4-bit weights run as stored."""
from __future__ import annotations

import logging

import torch

from services.config import ConfigError, EngineConfig
from worker_svc.formats.model_config import ModelConfig

logger = logging.getLogger(__name__)


def torch_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """`rank`: a worker group's rank, which takes the GPU of its number (one device per rank)."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"--device {config.device}: this torch ({torch.__version__}, {build}) sees no CUDA "
                              "device; use --device cpu, or a CUDA build of torch on a GPU machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {config.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type == "cuda" and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if torch.cuda.device_count() < world:
            raise ConfigError(f"--tensor-parallel-size x --pipeline-parallel-size = {world} GPUs, but this machine "
                              f"has {torch.cuda.device_count()}")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    return device


def torch_dtype(config: EngineConfig, device: torch.device, encoder: bool) -> torch.dtype:
    """"auto" is bfloat16 on GPU. On CPU it is float32, where a decoder's greedy tokens are
    transformers' and AVX2's bfloat16 matmuls gain little; but an encoder only pools, and
    on a CPU with AMX its bfloat16 matmuls ran all-MiniLM-L6-v2 2.2x as fast as float32,
    every vector at cosine 0.9999 or more to float32's (docs/pooling.md)."""
    if config.dtype == "auto":
        if device.type == "cuda" or (encoder and amx_bfloat16()):
            return torch.bfloat16
        return torch.float32
    if config.dtype == "float16" and device.type == "cpu":
        logger.warning("--dtype float16 on CPU: computing in float32 instead (CPU float16 matmuls are slow, "
                       "and float32 keeps the outputs equal to transformers')")
        return torch.float32
    return getattr(torch, config.dtype)


def amx_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in its AMX tiles (oneDNN uses them)."""
    return torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype, runs_q4: bool) -> torch.dtype:
    """The KV cache's element type: the 16 bits asked for, or with --kv-cache-dtype auto float16 for
    GGUF weights run as stored (llama.cpp's default for these files: twice the tokens in the same
    memory) and the model's dtype otherwise (the dense path keeps transformers' exact tokens)."""
    if config.kv_cache_dtype != "auto":
        return getattr(torch, config.kv_cache_dtype)
    return torch.float16 if runs_q4 else model_dtype


def runs_q4_as_stored(config: EngineConfig, device: torch.device, model: ModelConfig) -> bool:
    """Whether a quantized GGUF file's 4-bit projections run as stored: with --quantization
    gguf, the default for GGUF files as in vLLM, on CPU (the kernels are CPU kernels;
    elsewhere the weights are dequantized, as with --quantization none)."""
    if model.quantization is None or config.quantization == "none":  # unquantized weights, or not GGUF
        return False
    if device.type != "cpu":
        if config.quantization == "gguf":
            logger.warning("--quantization gguf: 4-bit weights run as stored on CPU only; dequantizing them on %s",
                           device)
        return False
    return True
