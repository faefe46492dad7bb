"""Pooling: what a request asks of the model's hidden states instead of tokens (vLLM's
PoolingParams), and how a model pools them (vLLM's --pooler-config).

A pooling request travels the generation path unchanged, as a SamplingParams whose
`pooling` is set: it is prefilled only, its last prefill step returns the pooled
vector instead of a token, and it ends there (docs/pooling.md).
"""
from __future__ import annotations

import msgspec

from services.invalid_parameter import InvalidParameter
from services.json_flag import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize", "dimensions")


class PoolingParams(msgspec.Struct, omit_defaults=True, repr_omit_defaults=True):
    """One request's pooling: None leaves the model's pooler config to decide."""

    normalize: bool | None = None
    # Matryoshka: keep the first `dimensions` of the vector (before normalizing).
    dimensions: int | None = None
    # A cross-encoder's pair (query, document) in one prompt: where the second text starts;
    # an encoder gives its tokens from there token type 1.
    second_segment_start: int | None = None
    # A classifier's scores through its activation (sigmoid for one label, else softmax)
    # or as raw logits (vLLM's use_activation).
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidParameter("dimensions", f"must be at least 1, got {self.dimensions}")


class PoolerConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a model pools: vLLM's --pooler-config keys; the model's own defaults fill the rest."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka models say which prefixes of their vectors are embeddings themselves.
    is_matryoshka: bool = False
    hidden_size: int = 0
    # The vector length returned when a request gives no `dimensions` (None: the whole vector).
    dimensions: int | None = None
    # A classification head's labels (a cross-encoder has one): its vector is their scores.
    labels: tuple[str, ...] = ()


def parse_pooler_config(value: str | dict) -> dict:
    """--pooler-config's JSON as the PoolerConfig fields it sets; ValueError naming what is wrong."""
    raw = dict(json_object(value, POOLER_CONFIG_KEYS, '{"pooling_type": "MEAN", "normalize": true}', ValueError))
    if "pooling_type" in raw:
        raw["pooling_type"] = str(raw["pooling_type"]).upper()
        if raw["pooling_type"] not in POOLING_TYPES:
            raise ValueError(f"pooling_type {raw['pooling_type']!r}: choose one of {', '.join(POOLING_TYPES)}")
    if "normalize" in raw and not isinstance(raw["normalize"], bool):
        raise ValueError("normalize must be true or false")
    if "dimensions" in raw and not (isinstance(raw["dimensions"], int) and raw["dimensions"] >= 1):
        raise ValueError("dimensions must be a positive integer")
    return raw
