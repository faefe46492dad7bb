"""Load a model's config and weights, from a GGUF file or a HF directory, into one layout.

Whatever the source, the state dict uses the parameter names of transformers'
LlamaForCausalLM / Qwen2ForCausalLM, so the model code knows one naming only and
any checkpoint can be checked against transformers itself.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from services.model_source import ModelFormat, ModelSource
from worker_svc.model_config import ModelConfig

GGUF_ARCHITECTURES = ("llama", "qwen2")
# HF model_type -> our architecture: Mistral is a Llama with a different name.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}

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
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MISSING = object()


def load_weights(source: ModelSource, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model's config and its HF-named state dict, every tensor contiguous in `dtype`."""
    if source.format is ModelFormat.GGUF:
        config, tensors = _load_gguf(source.path, dtype)
    else:
        config, tensors = _load_hf_dir(source.path, dtype)
    _check_names(config, tensors, source.path)
    return config, tensors


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"}
        names |= {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        if config.attention_bias:
            names |= {f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"}
    return names


def _check_names(config: ModelConfig, tensors: dict[str, torch.Tensor], path: Path) -> None:
    # A missing or extra tensor means the file is not the architecture we think it is
    # (e.g. an MLP bias we would silently ignore), so fail at load, not at first forward.
    expected = _expected_names(config)
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {config.architecture} model: "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )


# --- GGUF -------------------------------------------------------------------------------


def read_gguf(path: Path) -> gguf.GGUFReader:
    """The file's reader, parsed once per process: parsing a GGUF's metadata takes seconds
    (an object per vocabulary token), and the weights and the grammar compiler's
    vocabulary both read it. A file rewritten in place is parsed anew."""
    stat = path.stat()
    return _read_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: Path, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


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


def _gguf_config(reader: gguf.GGUFReader, arch: str, tensor_names: set[str]) -> ModelConfig:
    def meta(key: str, default: Any = _MISSING) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    vocab_size = meta("vocab_size", None)
    if vocab_size is None:
        # Counting the array's items avoids decoding every token string.
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
    # Instruct models end a turn with eot (e.g. Llama 3's <|eot_id|>), which must stop generation too.
    eos_ids = (_gguf_field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", meta("rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = read_gguf(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    config = _gguf_config(reader, arch, {t.name for t in reader.tensors})
    rotary_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {}
    for tensor in reader.tensors:
        # dequantize already yields numpy shape (rows, cols): GGUF's dims reversed,
        # which is torch's Linear layout. torch.tensor copies out of the read-only mmap.
        weight = torch.tensor(dequantize(tensor.data, tensor.tensor_type), dtype=dtype)
        kind = tensor.name.split(".")[-2]
        if arch == "llama" and kind in rotary_heads:
            weight = _unpermute_rotary(weight, rotary_heads[kind])
        tensors[_gguf_hf_name(tensor.name)] = weight.contiguous()
    return config, tensors


# --- HF directory -----------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _hf_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    architecture = HF_MODEL_TYPES[model_type]
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    # transformers 5 writes "rope_parameters" (theta and scaling in one dict); older configs
    # have "rope_theta" and "rope_scaling".
    rope_parameters = raw.get("rope_parameters") or {}
    rope = raw.get("rope_scaling") or rope_parameters
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(raw.get("rope_theta") or rope_parameters.get("rope_theta", 10000.0)),
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=architecture == "qwen2" or raw.get("attention_bias", False),
        rope_scaling=rope if scaled else None,
        bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        # generation_config.json holds the stop ids generate() uses (e.g. Llama 3's end-of-turn).
        eos_token_ids=_token_ids(generation.get("eos_token_id", raw.get("eos_token_id"))),
    )


def _tokenizer_eos(directory: Path) -> tuple[int, ...]:
    """The tokenizer's EOS, for a model whose configs name none: the worker reports
    what ends a sequence, so no other role needs the model's files for it."""
    eos = _read_json(directory / "tokenizer_config.json").get("eos_token")
    content = eos.get("content") if isinstance(eos, dict) else eos
    if content is None:
        return ()
    vocabulary = _read_json(directory / "tokenizer.json")
    for token in vocabulary.get("added_tokens", []):
        if token["content"] == content:
            return (token["id"],)
    token_id = vocabulary.get("model", {}).get("vocab", {}).get(content)
    return () if token_id is None else (token_id,)


def _safetensors_files(directory: Path) -> list[Path]:
    index = _read_json(directory / "model.safetensors.index.json")
    if index:
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)"
        )
    return files


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json, so it is not a HuggingFace model directory")
    raw = _read_json(directory / "config.json")
    config = _hf_config(raw, _read_json(directory / "generation_config.json"))
    if not config.eos_token_ids:
        config = replace(config, eos_token_ids=_tokenizer_eos(directory))
    tensors = {}
    for file in _safetensors_files(directory):
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                # Old Llama checkpoints store the rotary inverse frequencies, which we recompute.
                if not name.endswith("rotary_emb.inv_freq"):
                    tensors[name] = checkpoint.get_tensor(name).to(dtype).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, tensors
