"""OpenAI's request bodies, with vLLM's extra sampling fields.

Value checks live in SamplingParams (one source of truth for every front end); these
models check types and the bounds of gateway/request_body.py. Logprob counts are
bounded by the server's --max-logprobs, which the endpoints check (gateway/limits.py).
The responses are in gateway/responses.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from gateway.request_body import Body, Int64, RequestModel, TokenId


class StreamOptions(RequestModel):
    include_usage: bool | None = False  # a last chunk tells the usage
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk tells the usage so far


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs` extra body field: exactly one constraint."""

    # "json" would shadow a pydantic attribute; the wire name is kept by the alias.
    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


class SamplingFields(Body):
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


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(RequestModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, OpenAI's shape
    tool_call_id: str | None = None  # a tool turn answers this call


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a pydantic attribute; the wire name is kept by the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
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


class TokenizeRequest(Body):
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


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]
