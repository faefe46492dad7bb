"""vLLM's --speculative-config (and LLM(speculative_config=...)): which proposer drafts
tokens for the target model to verify, checked before anything loads.

The `ngram` (prompt lookup) and `suffix` (suffix decoding) methods draft from tokens the
scheduler holds, so they need no model; `draft_model` drafts with a smaller model (`model`,
same tokenizer) that the worker runs beside the target, and `eagle` / `eagle3` with an
EAGLE head (`model`, in the checkpoint format vLLM loads) fed by the target's hidden
states. Other methods (`mtp`) and keys are refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from services.json_flag import json_object


class SpeculativeConfigError(ValueError):
    """What is wrong with a speculative config, in one line (services.config wraps it)."""


METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
# Methods whose drafts a model in the worker makes (`model`), one step ahead of their verification.
WORKER_METHODS = ("draft_model", "eagle", "eagle3")
DRAFT_KEYS = ("model", "quantization", "draft_tensor_parallel_size")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
        *SUFFIX_KEYS, *DRAFT_KEYS)
# The most drafts per step: a verification step's tokens grow with it. Suffix decoding
# proposes up to its tree depth (vLLM's default 24) when its matches are long.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # vLLM's: no drafts in a step while this many requests (or more) are running.
    disable_by_batch_size: int | None = None
    # Suffix decoding, vLLM's defaults: the trees' depth (match plus drafts), how many ended
    # requests' outputs the global tree keeps (FIFO), the most drafts per matched token,
    # and the least estimated probability (from the trees' counts) of a draft.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # The draft model (an alias, a .gguf file or a model directory) and how its weights run:
    # None as the target's --quantization, "none" dequantized, "gguf" 4-bit as stored.
    model: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int = 1

    def to_json(self) -> str:
        return json.dumps({key: getattr(self, key) for key in KEYS})


def parse_speculative_config(value: str | dict) -> SpeculativeConfig:
    """A JSON object (the flag's text) or a dict (the SDK's) -> a checked SpeculativeConfig."""
    value = json_object(value, KEYS, '{"method": "ngram", "num_speculative_tokens": 4}', SpeculativeConfigError)
    method = value.get("method")
    if method == "mtp":
        # vLLM refuses it for a target without MTP layers; no architecture kvfleet serves has them.
        raise SpeculativeConfigError("method 'mtp' drafts with the target's own multi-token-prediction layers "
                                     "(DeepSeek-V3, MiMo, Qwen3-Next, GLM-4.5 checkpoints); the Llama and Qwen2 "
                                     "models kvfleet serves have none: use eagle, eagle3, draft_model, ngram or suffix")
    if method not in METHODS:
        raise SpeculativeConfigError(f"method {method!r}: kvfleet implements {', '.join(METHODS)} only")
    depth = _positive(value, "suffix_decoding_max_tree_depth", 24)
    # vLLM's default for suffix decoding: as many drafts as the tree is deep.
    num = _positive(value, "num_speculative_tokens", depth if method == "suffix" else None)
    if num > MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(f"num_speculative_tokens {num}: at most {MAX_SPECULATIVE_TOKENS}")
    # vLLM's defaults: both 5 when neither is given, otherwise the one given for both.
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    low = _positive(value, "prompt_lookup_min", high if high is not None else 5)
    high = _positive(value, "prompt_lookup_max", low)
    if low > high:
        raise SpeculativeConfigError(f"prompt_lookup_min {low} is more than prompt_lookup_max {high}")
    disable = value.get("disable_by_batch_size")
    if disable is not None:
        disable = _positive(value, "disable_by_batch_size", None)
    return SpeculativeConfig(method, num, low, high, disable, depth, *_suffix_keys(value), *_draft_keys(value, method))


def _suffix_keys(value: dict) -> tuple[int, float, float]:
    """suffix_decoding_max_cached_requests, _max_spec_factor and _min_token_prob, checked."""
    cached = value.get("suffix_decoding_max_cached_requests", 10000)
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise SpeculativeConfigError(f"suffix_decoding_max_cached_requests {cached!r}: give an integer >= 0")
    return (cached, _number(value, "suffix_decoding_max_spec_factor", 1.0, 0.0, None),
            _number(value, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0))


def _draft_keys(value: dict, method: str) -> tuple[str | None, str | None]:
    """The draft model and its quantization, checked (whether the model exists is the worker's check)."""
    model, quantization = value.get("model"), value.get("quantization")
    if method == "draft_model" and not isinstance(model, str):
        raise SpeculativeConfigError("method 'draft_model' needs \"model\": the draft model (same tokenizer)")
    if method in ("eagle", "eagle3") and not isinstance(model, str):
        raise SpeculativeConfigError(f"method {method!r} needs \"model\": the directory of an {method.upper()} head "
                                     "for the target (config.json and safetensors weights)")
    if quantization not in (None, "none", "gguf"):
        raise SpeculativeConfigError(f"quantization {quantization!r}: the draft's weights run as \"gguf\" "
                                     "(4-bit as stored) or \"none\" (dequantized)")
    if value.get("draft_tensor_parallel_size", 1) != 1:
        raise SpeculativeConfigError("draft_tensor_parallel_size: only 1 (one-rank workers)")
    return model, quantization


def _positive(value: dict, key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise SpeculativeConfigError(f"{key} is required")
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise SpeculativeConfigError(f"{key} {number!r}: give a positive integer")
    return number


def _number(value: dict, key: str, default: float, low: float, high: float | None) -> float:
    number = value.get(key, default)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not (
            low <= number and (high is None or number <= high)):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise SpeculativeConfigError(f"{key} {number!r}: give a number {bounds}")
    return float(number)
