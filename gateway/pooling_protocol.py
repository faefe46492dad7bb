"""The pooling endpoints' request and response bodies, with vLLM's and OpenAI's names
(docs/pooling.md)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from gateway.request_body import RequestModel, TokenId

# Text, texts, token ids, or token-id lists: what OpenAI's embeddings input takes.
EmbeddingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class _PoolingInputs(RequestModel):
    """What every request that pools its inputs one by one takes."""

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None
    # vLLM's extra parameters.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingRequest(_PoolingInputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a string when encoding_format is base64


class PoolingUsage(BaseModel):
    """vLLM's UsageInfo for a pooling request: prompt tokens only."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int) -> PoolingUsage:
        return cls(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


Data = TypeVar("Data", bound=BaseModel)


class _PoolingList(BaseModel, Generic[Data]):
    """The envelope of every pooling answer but rerank's; each kind names its id's prefix."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[Data]
    usage: PoolingUsage


def _new_id(prefix: str) -> Any:
    return Field(default_factory=lambda: f"{prefix}-{uuid.uuid4().hex}")


class EmbeddingResponse(_PoolingList[EmbeddingData]):
    id: str = _new_id("embd")


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: an embeddings request whose answer is the pooler's raw output."""


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(_PoolingList[PoolingData]):
    id: str = _new_id("pool")


class ClassificationRequest(_PoolingInputs):
    use_activation: bool | None = None


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_PoolingList[ClassificationData]):
    id: str = _new_id("classify")


class _ScoringFields(RequestModel):
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


class ScoreResponse(_PoolingList[ScoreData]):
    id: str = _new_id("score")


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
    id: str = _new_id("rerank")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
