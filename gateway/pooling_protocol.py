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


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: an embeddings request whose answer is the pooler's raw output."""


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"pool-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationRequest(_Request):
    model: str | None = None
    input: EmbeddingInput
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    use_activation: bool | None = None
    user: str | None = None
    priority: int = 0


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"classify-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class _ScoringFields(_Request):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    use_activation: bool | None = None
    user: str | None = None
    priority: int = 0


class ScoreRequest(_ScoringFields):
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(_ScoringFields):
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
