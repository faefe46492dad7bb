"""An EAGLE or EAGLE-3 head (speculative decoding's `eagle` and `eagle3` methods) in the
checkpoint format vLLM loads: a directory with a Llama-style config.json and safetensors
weights, checked from the config and the safetensors header alone (no torch), so a head
that cannot serve the target is refused before anything loads.

- EAGLE (Li et al. 2024; vLLM's EagleLlamaForCausalLM): `fc` [H, 2H] maps the token's
  embedding and the target's last hidden state (after its final norm) to one input of
  `layers.{i}` (Llama decoder layers, the first without an input norm); its output goes
  through the target's LM head as it is. The target's embedding is shared.
- EAGLE-3 (vLLM's Eagle3LlamaForCausalLM): `fc` [H, 3·target H] maps hidden states the
  target's layers take as input (layers 2, L/2 and L-3 by default, or
  eagle_config.eagle_aux_hidden_state_layer_ids) to one; its one decoder layer
  (`midlayer.*` or `layers.0.*`) attends over [input_layernorm(embedding),
  hidden_norm(hidden)] (2H wide), then `norm` and its own `lm_head` over `draft_vocab_size`
  tokens, which `d2t` (target id minus draft id) maps to the target's vocabulary.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from services.config import ConfigError
from worker_svc.formats.model_config import ModelConfig


@dataclass(frozen=True)
class EagleHead:
    method: str  # "eagle" or "eagle3"
    path: Path
    files: tuple[Path, ...]
    # The head's decoder layers as a ModelConfig: what its KV cache and attention need.
    config: ModelConfig
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input hidden states feed fc
    draft_vocab_size: int
    fc_bias: bool
    # vLLM's config keys: HASS's norms of both fc inputs (EAGLE); the hidden norm before the
    # residual is taken (EAGLE-3).
    add_para_norm: bool
    norm_before_residual: bool
    has_embedding: bool  # its own embed_tokens (EAGLE-3 only: an EAGLE head shares the target's, as vLLM)
    has_lm_head: bool  # its own (EAGLE-3); else the target's is shared


def read_eagle_head(path: str, method: str, target: ModelConfig) -> EagleHead:
    """The head at `path`, checked against the target; a ConfigError naming what is wrong."""
    directory = Path(path)
    where = f"--speculative-config model {path!r}"
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{where}: no config.json there; an {method} head is a directory with config.json and "
                          "*.safetensors weights")
    files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        raise ConfigError(f"{where}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    try:
        raw = json.loads((directory / "config.json").read_text())
        shapes = {name: shape for file in files for name, shape in _header_shapes(file).items()}
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"{where}: unreadable ({exc})") from exc
    try:
        return _check(directory, files, raw, shapes, method, target)
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: config.json lacks or mistypes {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _check(directory: Path, files: tuple[Path, ...], raw: dict, shapes: dict[str, list[int]], method: str,
           target: ModelConfig) -> EagleHead:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r}: only silu (Llama) heads are supported")
    if int(raw.get("vocab_size", target.vocab_size)) != target.vocab_size:
        raise ValueError(f"its vocabulary has {raw['vocab_size']} tokens, the target's {target.vocab_size}: "
                         "a head is trained for one target model")
    fc = shapes.get("fc.weight")
    if fc is None:
        raise ValueError("no fc.weight: not an EAGLE head")
    inputs = 3 if method == "eagle3" else 2
    if fc[1] != inputs * target.hidden_size or fc[0] != hidden:
        kind = {2 * target.hidden_size: "an EAGLE head (use method 'eagle')",
                3 * target.hidden_size: "an EAGLE-3 head (use method 'eagle3')"}.get(fc[1], "not for this target")
        raise ValueError(f"fc.weight is {fc[0]}x{fc[1]}; an {method} head for a target of hidden size "
                         f"{target.hidden_size} has {hidden}x{inputs * target.hidden_size}: it is {kind}")
    layers = int(raw["num_hidden_layers"])
    if method == "eagle" and hidden != target.hidden_size:
        raise ValueError(f"hidden_size {hidden}: an EAGLE head shares the target's embedding and LM head "
                         f"({target.hidden_size})")
    if method == "eagle3" and layers != 1:
        raise ValueError(f"num_hidden_layers {layers}: an EAGLE-3 head has one decoder layer")
    draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
    has_embedding = method == "eagle3" and "embed_tokens.weight" in shapes
    if method == "eagle3" and not has_embedding and hidden != target.hidden_size:
        raise ValueError(f"hidden_size {hidden} and no embed_tokens.weight: the target's embedding "
                         f"({target.hidden_size} wide) cannot be shared")
    has_lm_head = method == "eagle3" and "lm_head.weight" in shapes  # an EAGLE head uses the target's
    if method == "eagle3":
        if not has_lm_head and (draft_vocab != target.vocab_size or hidden != target.hidden_size):
            raise ValueError("no lm_head.weight, and the target's LM head does not fit the head")
        if has_lm_head and shapes["lm_head.weight"] != [draft_vocab, hidden]:
            raise ValueError(f"lm_head.weight is {shapes['lm_head.weight']}, expected [{draft_vocab}, {hidden}] "
                             "(draft_vocab_size, hidden_size)")
        if draft_vocab != target.vocab_size and shapes.get("d2t") != [draft_vocab]:
            raise ValueError(f"draft_vocab_size {draft_vocab} needs d2t [{draft_vocab}], the draft-to-target "
                             "token id offsets")
    aux = _aux_layers(raw, target.num_hidden_layers) if method == "eagle3" else ()
    config = ModelConfig(
        architecture="llama", vocab_size=target.vocab_size, hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", target.max_position_embeddings)),
        tie_word_embeddings=False, attention_bias=bool(raw.get("attention_bias", False)),
        rope_scaling=raw.get("rope_scaling"))
    _check_layers(shapes, config, method)
    return EagleHead(method, directory, files, config, aux, draft_vocab, "fc.bias" in shapes,
                     bool(raw.get("add_para_norm", False)),
                     bool(raw.get("norm_before_residual", False)), has_embedding, has_lm_head)


def _aux_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """vLLM's default (2, L/2, L-3), or the checkpoint's eagle_config.eagle_aux_hidden_state_layer_ids."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2,
                                                                                      num_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)}: three layer indices of the target's "
                         f"{num_layers}")
    return tuple(ids)


def _check_layers(shapes: dict[str, list[int]], config: ModelConfig, method: str) -> None:
    """Every projection of every layer present, of the config's shapes."""
    hidden, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    width = 2 * hidden if method == "eagle3" else hidden
    expected = {"self_attn.q_proj.weight": [q, width], "self_attn.k_proj.weight": [kv, width],
                "self_attn.v_proj.weight": [kv, width], "self_attn.o_proj.weight": [hidden, q],
                "mlp.gate_proj.weight": [config.intermediate_size, hidden],
                "mlp.up_proj.weight": [config.intermediate_size, hidden],
                "mlp.down_proj.weight": [hidden, config.intermediate_size],
                "post_attention_layernorm.weight": [hidden]}
    for i in range(config.num_hidden_layers):
        prefix = layer_prefix(shapes, i)
        for name, shape in expected.items():
            if shapes.get(prefix + name) != shape:
                found = shapes.get(prefix + name)
                raise ValueError(f"{prefix}{name} is {'missing' if found is None else found}, expected {shape}")


def layer_prefix(names: dict | set, index: int) -> str:
    """EAGLE-3 checkpoints name their one layer `midlayer.`; the others `layers.{i}.`."""
    return "midlayer." if index == 0 and "midlayer.self_attn.q_proj.weight" in names else f"layers.{index}."


def _header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors header: an 8-byte length, then JSON."""
    with file.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(length))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}
