"""The pooling endpoints' request and response bodies, with vLLM's and OpenAI's names
(docs/pooling.md)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from gateway.protocol import TokenId, _Request

# Text, texts, token ids, or token-id lists: what OpenAI's embeddings input takes.
EmbeddingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra parameters.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a string when encoding_format is base64


class PoolingUsage(BaseModel):
    """vLLM's UsageInfo for a pooling request: prompt tokens only."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
