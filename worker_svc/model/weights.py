"""Load a model's config and weights, from a GGUF file or a HF directory, into one layout.

Whatever the source, the state dict uses the parameter names of transformers'
LlamaForCausalLM / Qwen2ForCausalLM, so the model code knows one naming only and
any checkpoint can be checked against transformers itself.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quant_shape_to_byte_shape
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.config import ConfigError
from services.file_cache import derived_path
from services.model_source import ModelFormat, ModelSource
from worker_svc.formats.gguf_header import GGUFTensor, read_gguf_header
from worker_svc.formats.model_config import ModelConfig, read_json, read_model_config
from worker_svc.formats.q4_weights import Q4_KINDS, Q4Blocks
from worker_svc.formats.q8_weights import Q8_KIND, Q8Blocks
from worker_svc.group.shard import SINGLE, Shard

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 2.0
_LOADER_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.dtype(np.float32), GGMLQuantizationType.F16: np.dtype(np.float16)}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class LoadProgress:
    """A log line every PROGRESS_EVERY_S while weights load, so a long load is seen moving."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = 0
        self.started = time.monotonic()
        self._next_report = self.started + PROGRESS_EVERY_S

    def advance(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        now = time.monotonic()
        if now >= self._next_report:
            self._next_report = now + PROGRESS_EVERY_S
            logger.info("loading weights: %3.0f%% of %.2f GB, %.0f s", 100 * self.done_bytes / self.total_bytes,
                        self.total_bytes / 1e9, now - self.started)


Weights = dict[str, torch.Tensor | Q4Blocks | Q8Blocks]
# Kept 8-bit with --quantization gguf: the token embedding (and an untied LM head), which
# every decode step reads whole as the LM head.
_Q8_NAMES = frozenset(("model.embed_tokens.weight", "lm_head.weight"))


def load_weights(
    source: ModelSource, dtype: torch.dtype, keep_quantized: bool = False, shard: Shard = SINGLE
) -> tuple[ModelConfig, Weights]:
    """The model's config and its HF-named state dict, every tensor contiguous in `dtype`;
    with `keep_quantized`, a GGUF file's 4-bit projection matrices stay 4-bit (Q4Blocks),
    and its 8-bit embedding and LM head 8-bit (Q8Blocks).

    A rank of a worker group gets only its shard: the tensors of its stage, each cut to
    its slice as it is read (its rows or block-aligned columns, before any dequantizing),
    so no rank ever holds the whole model. Layers are then numbered from the stage's first."""
    config = read_model_config(source)
    tensors = _read(source, config, dtype, _Part(shard, config), keep_quantized)
    _check_names(config, tensors, source.path, shard)
    return config, {shard.local_name(name, config): tensor for name, tensor in tensors.items()}


def load_vocab_weights(source: ModelSource, dtype: torch.dtype) -> Weights:
    """The whole embedding and, when it is not tied to it, the whole LM head: what an EAGLE
    head drafting on one rank of a worker group shares with the target, whose own are a
    slice of the vocabulary there, or on another stage."""
    config = read_model_config(source)
    return _read(source, config, dtype, _Part(SINGLE, config, _VOCAB_NAMES), keep_quantized=False)


def _read(source: ModelSource, config: ModelConfig, dtype: torch.dtype, part: _Part, keep_quantized: bool) -> Weights:
    if source.format is ModelFormat.GGUF and keep_quantized:
        return _read_gguf(source.path, config, dtype, part, keep_quantized=True)
    if source.format is ModelFormat.GGUF:
        return _load_gguf(source.path, config, dtype, part)
    return _load_hf_dir(source.path, config, dtype, part)


_VOCAB_NAMES = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


@dataclass(frozen=True)
class _Part:
    """What of each stored tensor a rank reads."""

    shard: Shard
    config: ModelConfig
    names: frozenset[str] | None = None  # only these tensors; None: all the shard holds

    @property
    def whole(self) -> bool:
        return self.shard.world_size == 1 and self.names is None

    def wants(self, name: str) -> bool:
        return name in self.names if self.names is not None else self.shard.holds(name, self.config)

    def cut(self, name: str, tensor: Any, block: int = 1, block_bytes: int = 1) -> Any:
        """Its slice of `tensor` (a torch or numpy array, or a safetensors slice). Quantized
        rows are bytes, `block_bytes` per `block` weights: columns are cut at whole blocks."""
        cut = self.shard.slice_of(name, self.config)
        if cut is None:
            return tensor[...] if not isinstance(tensor, (torch.Tensor, np.ndarray)) else tensor
        dim, start, length = cut
        if dim == 1 and (start % block or length % block):
            raise ConfigError(f"--tensor-parallel-size {self.shard.tp_size}: {name} stores its columns in blocks "
                              f"of {block}, and this rank's columns {start}..{start + length} split one")
        if dim == 1:
            start, length = start // block * block_bytes, length // block * block_bytes
        return tensor[(slice(None),) * dim + (slice(start, start + length),)]


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if config.labels:  # a ...ForSequenceClassification checkpoint: its head instead of the LM head
        names.add("score.weight")
    elif not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"}
        names |= {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        if config.attention_bias:
            names |= {f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"}
    return names


def _check_names(config: ModelConfig, tensors: Weights, path: Path, shard: Shard) -> None:
    # A missing or extra tensor means the file is not the architecture we think it is
    # (e.g. an MLP bias we would silently ignore), so fail at load, not at first forward.
    expected = {name for name in _expected_names(config) if shard.holds(name, config)}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {config.architecture} model: "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )


# --- GGUF -------------------------------------------------------------------------------


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each head's rows:
    # w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2); swap them back.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES and kind == "weight":
        return f"{_GGUF_GLOBAL_NAMES[base]}.weight"
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_GGUF_LAYER_NAMES[match[2]]}.{match[3]}"


def _load_gguf(path: Path, config: ModelConfig, dtype: torch.dtype, part: _Part) -> dict[str, torch.Tensor]:
    """Dequantizing takes seconds, so its result is cached (services/file_cache.py): a
    restarted worker reads the tensors back in a fraction of that. The key holds this
    module's source and gguf's version, so a change to either dequantizes again. A rank
    of a group reads its slices of the cache when there is one, and dequantizes only its
    slices (caching nothing) when there is not."""
    cached = derived_path("weights", path, f"dtype={dtype}", f"gguf={metadata.version('gguf')}",
                          f"loader={_LOADER_DIGEST}")
    if cached.is_file():
        logger.info("reading the dequantized weights cached in %s", cached)
        return load_file(cached) if part.whole else _read_safetensors([cached], dtype, part)
    tensors = _read_gguf(path, config, dtype, part, keep_quantized=False)
    if not part.whole:
        return tensors
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = cached.with_name(f"{cached.name}.{os.getpid()}.staging")  # several workers may start at once
        save_file(tensors, staging)
        os.replace(staging, cached)
    except OSError as exc:  # a read-only home must not stop serving, only slow the next start
        logger.warning("could not cache the dequantized weights in %s: %s", cached, exc)
    return tensors


def _read_gguf(path: Path, config: ModelConfig, dtype: torch.dtype, part: _Part, keep_quantized: bool) -> Weights:
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: Weights = {}
    progress = LoadProgress(data.size - min(tensor.offset for tensor in header.tensors.values()))
    for name, tensor in header.tensors.items():
        hf_name = _gguf_hf_name(name)
        if not part.wants(hf_name):
            continue
        kind = GGMLQuantizationType(tensor.kind)
        block, block_bytes = (1, 1) if kind in _FLOAT_TYPES else GGML_QUANT_SIZES[kind]
        raw = part.cut(hf_name, _gguf_raw(data, tensor), block, block_bytes)
        weight: torch.Tensor | Q4Blocks | Q8Blocks
        if keep_quantized and kind in Q4_KINDS and hf_name.startswith("model.layers."):
            weight = Q4Blocks.from_gguf(raw, kind)
        elif keep_quantized and kind is Q8_KIND and hf_name in _Q8_NAMES:
            weight = Q8Blocks.from_gguf(raw)
        else:
            # dequantize yields numpy shape (rows, cols): GGUF's dims reversed, which is
            # torch's Linear layout. torch.tensor copies out of the read-only map.
            weight = torch.tensor(dequantize(raw, kind), dtype=dtype)
        if config.architecture == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            # Per head, so a rank's whole heads unpermute alone.
            reorder = partial(_unpermute_rotary, n_head=weight.shape[0] // config.head_dim)
            weight = weight.map_rows(reorder) if isinstance(weight, Q4Blocks) else reorder(weight).contiguous()
        tensors[hf_name] = weight
        progress.advance(raw.nbytes)
    return tensors


def _gguf_raw(data: np.memmap, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's bytes as gguf's dequantize takes them: float arrays as such, quantized
    ones as rows of blocks' bytes."""
    kind, shape = GGMLQuantizationType(tensor.kind), tuple(reversed(tensor.dims))
    if kind in _FLOAT_TYPES:
        item = _FLOAT_TYPES[kind]
        return data[tensor.offset : tensor.offset + math.prod(shape) * item.itemsize].view(item).reshape(shape)
    byte_shape = quant_shape_to_byte_shape(shape, kind)
    return data[tensor.offset : tensor.offset + math.prod(byte_shape)].reshape(byte_shape)


# --- HF directory -----------------------------------------------------------------------


def _safetensors_files(directory: Path) -> list[Path]:
    index = read_json(directory / "model.safetensors.index.json")
    if index:
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    return files


def _load_hf_dir(directory: Path, config: ModelConfig, dtype: torch.dtype, part: _Part) -> dict[str, torch.Tensor]:
    tensors = _read_safetensors(_safetensors_files(directory), dtype, part)
    if config.tie_word_embeddings:  # some tied checkpoints store the head anyway
        tensors.pop("lm_head.weight", None)
    return tensors


def _read_safetensors(files: list[Path], dtype: torch.dtype, part: _Part) -> dict[str, torch.Tensor]:
    """The tensors `part` wants, each read as its slice only."""
    tensors = {}
    progress = LoadProgress(sum(file.stat().st_size for file in files))
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                # Old Llama checkpoints store the rotary inverse frequencies, which we recompute.
                if name.endswith("rotary_emb.inv_freq") or not part.wants(name):
                    continue
                tensor = part.cut(name, checkpoint.get_slice(name))
                progress.advance(tensor.nbytes)
                tensors[name] = tensor.to(dtype).contiguous()
    return tensors
