"""OpenAI's response and stream-chunk shapes, with vLLM's extras."""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, computed_field, model_serializer
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12


def _now() -> int:
    return int(time.time())


class _OmitsNone(BaseModel):
    """A stream chunk's vLLM extras, sent only where they say something (a client reads
    `"key" in chunk` as "this chunk carries it")."""

    OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in self.OMIT_IF_NONE:
            if data.get(key, 0) is None:
                del data[key]
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        """`cached_tokens`: of the prompt tokens, those the prefix cache supplied, when they are told."""
        return cls(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions format."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(TypedDict):
    """A dict, not a model: a request for the whole vocabulary's (-1) makes millions, and
    pydantic checks dicts many times faster than it builds models."""

    logprob: float
    rank: int | None  # 1 for the most likely token; None where unknown (the actual token past the top k)
    decoded_token: str


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: PromptLogprob}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop token or string
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra
    # vLLM's extras, with return_token_ids: the prompt's token ids and the choice's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a do_remote_decode request's KV waits


class CompletionChunkChoice(_OmitsNone, CompletionChoice):
    OMIT_IF_NONE = ("prompt_token_ids", "token_ids")


class CompletionChunk(_OmitsNone):
    OMIT_IF_NONE = ("kv_transfer_params",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    # vLLM's, streamed: where a do_remote_decode request's KV waits, on its choice's last chunk
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Reasoning(BaseModel):
    reasoning: str | None = None  # vLLM's extra, with --reasoning-parser

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reasoning_content(self) -> str | None:
        """vLLM's former name for `reasoning`, still read by many clients."""
        return self.reasoning


class ChatMessage(_Reasoning):
    role: str = "assistant"  # without add_generation_prompt, the last message's (vLLM's)
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's extra, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra
    prompt_token_ids: list[int] | None = None  # vLLM's extra, with return_token_ids
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a do_remote_decode request's KV waits


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # with the name, on a call's first delta
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Reasoning):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(_OmitsNone):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's extra, with return_token_ids: this chunk's new ones


class ChatCompletionChunk(_OmitsNone):
    OMIT_IF_NONE = ("prompt_token_ids", "kv_transfer_params")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's extra, with return_token_ids: on each choice's first chunk
    # vLLM's, streamed: where a do_remote_decode request's KV waits, on its choice's last chunk
    kv_transfer_params: dict[str, Any] | None = None


class ModelPermission(BaseModel):
    """vLLM's (after OpenAI's former API): what a client may do with the model."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvfleet"
    root: str  # the model the server loaded, as given to it (vLLM's --model)
    parent: str | None = None  # a base model's is None; a LoRA adapter's names its base
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
