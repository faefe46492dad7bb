"""The architecture hyper-parameters a model file must provide, in one typed record, read
from the file's metadata alone (a GGUF header, or config.json): in milliseconds, so a
model the worker cannot run is refused before any weight is read."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from services.config import ConfigError
from services.model_source import ModelFormat, ModelSource
from worker_svc.formats.gguf_header import GGUFHeader, read_gguf_header

GGUF_ARCHITECTURES = ("llama", "qwen2")
# HF model_type -> our architecture: Mistral is a Llama with a different name.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
# Encoders, served by the pooling runner (docs/pooling.md).
ENCODER_ARCHITECTURES = ("bert",)
_UNQUANTIZED = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" (Llama 2/3, SmolLM, Mistral) or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has a bias on the q/k/v projections
    # HF "rope_scaling"/"rope_parameters" dict when it is not the default rope (e.g. llama3).
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # How the file stores its weights, e.g. "GGUF Q4_1+Q8_0"; None for float checkpoints.
    quantization: str | None = None
    # Its embeddings' prefixes are embeddings too (config.json's is_matryoshka or
    # matryoshka_dimensions, as vLLM reads them): a request may ask for fewer dimensions.
    is_matryoshka: bool = False
    # An encoder (BERT): its token type vocabulary (segments A and B of a pair); 0 for a decoder.
    type_vocab_size: int = 0
    # A sequence-classification head (a cross-encoder, a classifier): its labels, by index.
    labels: tuple[str, ...] = ()

    @property
    def is_encoder(self) -> bool:
        return self.architecture in ENCODER_ARCHITECTURES


def read_model_config(source: ModelSource) -> ModelConfig:
    if source.format is ModelFormat.GGUF:
        return _gguf_config(read_gguf_header(source.path))
    return _hf_config(source.path)


# --- GGUF -------------------------------------------------------------------------------


def _gguf_config(header: GGUFHeader) -> ModelConfig:
    arch = header.fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def meta(key: str, default: Any = None) -> Any:
        value = header.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata has no {arch}.{key}")
        return value

    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    # The vocabulary array's length, when the size is not written out.
    vocab_size = meta("vocab_size", header.fields.get("tokenizer.ggml.tokens"))
    bos = header.fields.get("tokenizer.ggml.bos_token_id")
    # Instruct models end a turn with eot (e.g. Llama 3's <|eot_id|>), which must stop generation too.
    eos_ids = (header.fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot"))
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
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in header.tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        quantization=_gguf_quantization(header),
    )


def _gguf_quantization(header: GGUFHeader) -> str | None:
    """The quantized tensor types, most used first (norms stay F32 in every file)."""
    counts = Counter(GGMLQuantizationType(tensor.kind).name for tensor in header.tensors.values())
    quantized = [name for name, _ in counts.most_common() if name not in _UNQUANTIZED]
    return "GGUF " + "+".join(quantized) if quantized else None


# --- HF directory -----------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _hf_config(directory: Path) -> ModelConfig:
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} has no config.json, so it is not a HuggingFace model directory")
    raw = read_json(directory / "config.json")
    generation = read_json(directory / "generation_config.json")
    model_type = raw.get("model_type")
    if model_type in ENCODER_ARCHITECTURES:
        return _encoder_config(raw)
    if model_type not in HF_MODEL_TYPES:
        supported = [*HF_MODEL_TYPES, *ENCODER_ARCHITECTURES]
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported)}")
    architecture = HF_MODEL_TYPES[model_type]
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    # transformers 5 writes "rope_parameters" (theta and scaling in one dict); older configs
    # have "rope_theta" and "rope_scaling".
    rope_parameters = raw.get("rope_parameters") or {}
    rope = raw.get("rope_scaling") or rope_parameters
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    config = ModelConfig(
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
        is_matryoshka=bool(raw.get("is_matryoshka") or raw.get("matryoshka_dimensions")),
        labels=_labels(raw) if _classifies(raw) else (),
    )
    if not config.eos_token_ids:
        config = replace(config, eos_token_ids=_tokenizer_eos(directory))
    return config


def _encoder_config(raw: dict[str, Any]) -> ModelConfig:
    """A BERT-family encoder's config.json; the norms' epsilon is its layer_norm_eps."""
    if raw.get("position_embedding_type", "absolute") != "absolute" or raw.get("hidden_act", "gelu") != "gelu":
        raise ConfigError("only BERT encoders with absolute positions and gelu are supported")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return ModelConfig(
        architecture=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=raw.get("layer_norm_eps", 1e-12), rope_theta=0.0,
        max_position_embeddings=raw["max_position_embeddings"], tie_word_embeddings=False, attention_bias=True,
        is_matryoshka=bool(raw.get("is_matryoshka") or raw.get("matryoshka_dimensions")),
        type_vocab_size=raw.get("type_vocab_size", 2),
        labels=_labels(raw) if _classifies(raw) else (),
    )


def _classifies(raw: dict[str, Any]) -> bool:
    """A ...ForSequenceClassification checkpoint: its head's weights are in the files."""
    return any(a.endswith("ForSequenceClassification") for a in raw.get("architectures", []))


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """A classification head's label names in index order (transformers' id2label, LABEL_i without one)."""
    names = raw.get("id2label") or {}
    count = len(names) or raw.get("num_labels", 2)
    return tuple(names.get(str(i), f"LABEL_{i}") for i in range(count))


def _tokenizer_eos(directory: Path) -> tuple[int, ...]:
    """The tokenizer's EOS, for a model whose configs name none: the worker reports
    what ends a sequence, so no other role needs the model's files for it."""
    eos = read_json(directory / "tokenizer_config.json").get("eos_token")
    content = eos.get("content") if isinstance(eos, dict) else eos
    if content is None:
        return ()
    vocabulary = read_json(directory / "tokenizer.json")
    for token in vocabulary.get("added_tokens", []):
        if token["content"] == content:
            return (token["id"],)
    token_id = vocabulary.get("model", {}).get("vocab", {}).get(content)
    return () if token_id is None else (token_id,)
