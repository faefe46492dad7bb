"""OpenAI's request and response shapes, with vLLM's extra sampling fields.

Unknown request fields are ignored, as vLLM's server does, so clients that send newer
or vendor-specific fields keep working; like vLLM, each request that carries any logs
them once, at warning level, so a misspelt field does not pass unnoticed. Value checks live in SamplingParams (one
source of truth for every front end); these models check types, and the bounds
that keep a value representable where it goes: floats are finite, seeds and top_k
fit torch's int64 and token ids are below 2**31 (what a tokenizer can decode). Logprob
counts are bounded by the server's --max-logprobs, which the endpoints check
(gateway/limits.py).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

logger = logging.getLogger(__name__)

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _valid_unicode(value: Any) -> bool:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    if isinstance(value, str):
        # UTF-8 encoding refuses exactly the surrogates, in C: fast on a multi-megabyte prompt.
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, (list, tuple)):
        return all(_valid_unicode(v) for v in value)
    if isinstance(value, dict):
        return all(_valid_unicode(k) and _valid_unicode(v) for k, v in value.items())
    return True


class _Request(BaseModel):
    # NaN and infinities pass every range check by comparison rules of their own; refuse them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if not _valid_unicode(value):
            raise ValueError("contains a lone UTF-16 surrogate, which is not valid Unicode text")
        return value


# The most ignored fields one log line names; the rest are counted.
_MAX_IGNORED_NAMED = 20
# Per model class: the key each field is read from (its alias, else its name), and the
# keys of the fields that may hold models of their own, each with its field's name.
_WIRE_KEYS: dict[type[BaseModel], tuple[frozenset[str], dict[str, str]]] = {}


def _holds_models(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_models(arg) for arg in get_args(annotation))


def _wire_keys(cls: type[BaseModel]) -> tuple[frozenset[str], dict[str, str]]:
    keys = _WIRE_KEYS.get(cls)
    if keys is None:
        fields = cls.model_fields.items()
        keys = _WIRE_KEYS[cls] = (frozenset(field.alias or name for name, field in fields),
                                  {field.alias or name: name for name, field in fields if _holds_models(field.annotation)})
    return keys


def _ignored_fields(model: BaseModel, raw: dict[str, Any], path: str = "") -> list[str]:
    """The keys of `raw` that validating it into `model` dropped, nested ones as
    `messages[0].key`, in the body's order. Walks down only the fields that hold models."""
    cls = type(model)
    known, nested = _wire_keys(cls)
    found = [] if cls.model_config.get("extra") == "allow" else [f"{path}{key}" for key in raw if key not in known]
    for key, name in nested.items():
        if (value := raw.get(key)) is None:
            continue
        parsed = getattr(model, name)
        if isinstance(parsed, BaseModel) and isinstance(value, dict):
            found += _ignored_fields(parsed, value, f"{path}{key}.")
        elif isinstance(parsed, list) and isinstance(value, list):
            for index, (item, raw_item) in enumerate(zip(parsed, value)):
                if isinstance(item, BaseModel) and isinstance(raw_item, dict):
                    found += _ignored_fields(item, raw_item, f"{path}{key}[{index}].")
    return found


class _Body(_Request):
    """A whole request body. Fields it does not know are dropped, and logged once per
    request in vLLM's words."""

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler: ModelWrapValidatorHandler[_Body]) -> _Body:
        body = handler(data)
        if isinstance(data, dict) and (ignored := _ignored_fields(body, data)):
            named = ", ".join(repr(key) for key in ignored[:_MAX_IGNORED_NAMED])
            more = f" and {len(ignored) - _MAX_IGNORED_NAMED} more" if len(ignored) > _MAX_IGNORED_NAMED else ""
            logger.warning("The following fields were present in the request but ignored: {%s}%s", named, more)
        return body


class StreamOptions(_Request):
    include_usage: bool | None = False  # a last chunk tells the usage
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk tells the usage so far


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extra body field: exactly one constraint."""

    # "json" would shadow a pydantic attribute; the wire name is kept by the alias.
    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Body):
    """What completions and chat share, named as in OpenAI and vLLM."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted for vLLM's sake: kvfleet keeps nothing per end user (nor "
                             "does vLLM's server)")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI sends the token ids as strings
    # vLLM's extras
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # -1: the whole vocabulary
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len of them
    cache_salt: str | None = None  # keeps this request's prefix-cache entries apart from other salts'
    # vLLM's, as its disaggregation proxy sends them: do_remote_decode (compute the prompt's
    # KV and hold it), or do_remote_prefill with where it waits (docs/disaggregation.md).
    kv_transfer_params: dict[str, Any] | None = None
    # Beam search with beam width best_of or n, as vLLM's server runs it; the n best beams come back.
    use_beam_search: bool = False
    # |length_penalty| <= 10 keeps length ** length_penalty a finite, non-zero float.
    length_penalty: float = Field(1.0, ge=-10, le=10)
    # Structured outputs: vLLM's field, and its older guided_* spellings.
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prompt's and each choice's token ids come back (a stream sends the
    # prompt's with the first chunk, then each chunk's new ones).
    return_token_ids: bool | None = None
    # vLLM's: logprobs name each token "token_id:N"; None: as --return-tokens-as-token-ids says.
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingFields):
    # Text, a batch of texts, token ids, or a batch of token-id lists; None (as vLLM allows it) is a 400 later,
    # in vLLM's words.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None  # -1: the whole vocabulary


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessageParam(_Request):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, OpenAI's shape
    tool_call_id: str | None = None  # a tool turn answers this call


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a pydantic attribute; the wire name is kept by the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag format: its fields as they come, handed to the compiler as JSON.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam]
    # None: up to the model's context length.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # -1: the whole vocabulary
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    # None: "auto" when tools are given, else "none" (as OpenAI and vLLM).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: how the template ends the prompt, a new assistant turn or the last message
    # left open for the model to continue (not both); echo puts that last message's
    # content before the reply when its role is the reply's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either a prompt or chat messages (with the tools their template renders)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    # None: add them for a prompt, not for messages (the chat template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message stays open, for the model to go on with
    tools: list[ToolParam] | None = None
    return_token_strs: bool | None = False  # also each token's string, as the vocabulary writes it


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# -- responses -------------------------------------------------------------------------


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
