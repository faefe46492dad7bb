"""vLLM's --speculative-config (and LLM(speculative_config=...)): which proposer drafts
tokens for the target model to verify, checked before anything loads.

Only the `ngram` method (prompt lookup) is implemented: its drafts come from the
request's own tokens, so it needs no model. Other methods and keys are refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


class SpeculativeConfigError(ValueError):
    """What is wrong with a speculative config, in one line (services.config wraps it)."""


METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
# The most drafts per step: a verification step's tokens grow with it, and n-gram drafts
# past a few tokens are rarely all accepted.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def to_json(self) -> str:
        return json.dumps({key: getattr(self, key) for key in KEYS})


def parse_speculative_config(value: str | dict) -> SpeculativeConfig:
    """A JSON object (the flag's text) or a dict (the SDK's) -> a checked SpeculativeConfig."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"not JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(value, dict):
        raise SpeculativeConfigError("give a JSON object, such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise SpeculativeConfigError(f"{', '.join(unknown)}: not supported; kvfleet takes {', '.join(KEYS)}")
    method = value.get("method")
    if method not in METHODS:
        raise SpeculativeConfigError(f"method {method!r}: kvfleet implements {', '.join(METHODS)} (prompt lookup) "
                                     "only; suffix, draft_model, eagle, eagle3 and mtp are not supported yet")
    num = _positive(value, "num_speculative_tokens", None)
    if num > MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(f"num_speculative_tokens {num}: at most {MAX_SPECULATIVE_TOKENS}")
    # vLLM's defaults: both 5 when neither is given, otherwise the one given for both.
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    low = _positive(value, "prompt_lookup_min", high if high is not None else 5)
    high = _positive(value, "prompt_lookup_max", low)
    if low > high:
        raise SpeculativeConfigError(f"prompt_lookup_min {low} is more than prompt_lookup_max {high}")
    return SpeculativeConfig(method, num, low, high)


def _positive(value: dict, key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise SpeculativeConfigError(f"{key} is required")
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise SpeculativeConfigError(f"{key} {number!r}: give a positive integer")
    return number
