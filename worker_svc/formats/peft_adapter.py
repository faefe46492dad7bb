"""A LoRA adapter as PEFT saves it: `adapter_config.json` and `adapter_model.safetensors`.

Everything that can be wrong with it is found from the config and the safetensors header
alone, before any tensor is read: a missing file, another PEFT method, a rank above
--max-lora-rank, a module this model lacks or kvfleet does not adapt, a layer past the
model's, shapes of another base model. Each is a LoraAdapterError naming the problem.

PEFT names a tensor `base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`:
A is [r, in_features], B [out_features, r], and the module's output gains
scaling * B @ A @ x, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from worker_svc.formats.model_config import ModelConfig

if TYPE_CHECKING:  # checking an adapter (cluster up, before anything loads) needs no torch
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoraAdapterError(ValueError):
    """An adapter that cannot serve with this model, named by what is wrong."""


@dataclass
class PeftAdapter:
    rank: int
    scaling: float
    # (layer, module) -> (A [r, in], B [out, r]), float32 on the host.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each module an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_peft_adapter(path: str, config: ModelConfig, max_rank: int) -> PeftAdapter:
    rank, scaling, names = check_peft_adapter(path, config, max_rank)
    directory = Path(path)
    weights = {}
    with safe_open(directory / WEIGHTS_FILE, framework="pt") as checkpoint:
        for key, (a_name, b_name) in names.items():
            weights[key] = (checkpoint.get_tensor(a_name).float().contiguous(),
                            checkpoint.get_tensor(b_name).float().contiguous())
    return PeftAdapter(rank, scaling, weights)


def check_peft_adapter(
    path: str, config: ModelConfig, max_rank: int
) -> tuple[int, float, dict[tuple[int, str], tuple[str, str]]]:
    """The adapter's rank, scaling and tensor names, from its config and header alone."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        # vLLM's words: its servers answer this one 404, every other load error 400.
        raise LoraAdapterError(f"No adapter found for {path}: it has no {CONFIG_FILE}")
    if not (directory / WEIGHTS_FILE).is_file():
        raise LoraAdapterError(f"{path} has no {WEIGHTS_FILE} (PEFT's .bin checkpoints are not supported)")
    rank, scaling = _check_config(directory / CONFIG_FILE, max_rank)
    return rank, scaling, _check_tensors(_header_shapes(directory / WEIGHTS_FILE), rank, config, path)


def _check_config(file: Path, max_rank: int) -> tuple[int, float]:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"{file}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"{file}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{file}: peft_type {raw['peft_type']!r} is not LoRA")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraAdapterError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}: raise --max-lora-rank")
    # What the merged weights would not be W + scaling * B @ A: refused rather than served wrong.
    for key, fine in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if raw.get(key, fine) not in (fine, None):
            raise LoraAdapterError(f"{file}: {key}={raw[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if raw.get(key):
            raise LoraAdapterError(f"{file}: {key} is not supported (one rank and alpha for every module, "
                                   "decoder projections only)")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors header: an 8-byte length, then JSON."""
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise LoraAdapterError(f"{file}: not a safetensors file ({exc})") from exc
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def _check_tensors(
    shapes: dict[str, list[int]], rank: int, config: ModelConfig, path: str
) -> dict[tuple[int, str], tuple[str, str]]:
    """Each adapted (layer, module) and the names of its A and B, once every shape is checked."""
    expected = module_shapes(config)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise LoraAdapterError(f"{path}: tensor {name!r} adapts a module kvfleet does not (the decoder's "
                                   f"{', '.join(expected)})")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in expected or (module in ATTENTION_MODULES) != (block == "self_attn"):
            raise LoraAdapterError(f"{path}: tensor {name!r} targets {block}.{module}, a module this model lacks")
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"{path}: tensor {name!r} is for layer {layer}; this model has "
                                   f"{config.num_hidden_layers} layers (an adapter of another base model?)")
        found.setdefault((layer, module), {})[which] = name
    if not found:
        raise LoraAdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA tensor")
    names = {}
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"{path}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        in_features, out_features = expected[module]
        want = {"A": [rank, in_features], "B": [out_features, rank]}
        for which in "AB":
            if shapes[pair[which]] != want[which]:
                raise LoraAdapterError(
                    f"{path}: {pair[which]} has shape {shapes[pair[which]]}, this model's {module} with r={rank} "
                    f"needs {want[which]} (an adapter of another base model?)")
        names[(layer, module)] = (pair["A"], pair["B"])
    return names
