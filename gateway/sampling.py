"""Request fields to SamplingParams, which checks the values (and names the field).
The checks that need the prompt (truncation, context length) are services.prompt's,
shared with the SDK."""
from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request
from gateway.protocol import ResponseFormat, SamplingFields
from services.invalid_parameter import InvalidParameter
from services.prompt import bad_word_spellings, bad_words_token_ids
from services.sampling_params import SamplingParams
from services.structured_outputs import StructuredOutputsParams
from services.tokenizer_api import PromptEncoder

# Fields passed only when the client set them, so SamplingParams' (vLLM's) defaults hold.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "best_of",
             "truncate_prompt_tokens")
_ALWAYS = ("n", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
           "include_stop_str_in_output")


async def to_sampling_params(
    request: SamplingFields,
    encoder: PromptEncoder,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """`constraint`: the output constraint the endpoint sets itself (e.g. chat's
    response_format or a forced tool call), besides what the shared fields ask for."""
    _check_extras(request, logprobs, prompt_logprobs)
    # The model's generation-config defaults (--generation-config) for what the request
    # leaves unset; its max_tokens caps the request's, as in vLLM.
    defaults = dict(encoder.decoder.sampling_defaults)
    max_tokens = min((n for n in (max_tokens, defaults.pop("max_tokens", None)) if n is not None), default=None)
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in _ALWAYS} | defaults
    kwargs["structured_outputs"] = _one_constraint(request, constraint)
    kwargs.update((name, value) for name in _OPTIONAL if (value := getattr(request, name)) is not None)
    if request.bad_words:  # the engine bans token sequences
        spellings = await encoder.encode(bad_word_spellings(request.bad_words), add_special_tokens=False)
        kwargs["bad_words_token_ids"] = bad_words_token_ids(spellings)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kwargs)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _one_constraint(
    request: SamplingFields, constraint: StructuredOutputsParams | None
) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field carries it: two are a 400."""
    given = [constraint] if constraint is not None else []
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        given.append(_constraint("structured_outputs", fields))
    given += [_constraint(name, {kind: value}) for name, kind in _GUIDED.items()
              if (value := getattr(request, name)) is not None]
    if len(given) > 1:
        names = ", ".join(c.field_name for c in given)
        raise bad_request(given[1].field_name, f"only one field may constrain the output; got {names}")
    if given and request.use_beam_search:
        raise bad_request(given[0].field_name, "structured outputs are not available with use_beam_search")
    return given[0] if given else None


def response_format_constraint(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a constraint; None for plain text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _constraint("response_format", {"json_object": True})
    if response_format.type == "json_schema":
        schema = response_format.json_schema.json_schema if response_format.json_schema else None
        if schema is None:
            raise bad_request("response_format", "json_schema.schema is required when type is json_schema")
        return _constraint("response_format", {"json": schema})
    tag = response_format.model_dump(exclude_none=True, exclude={"json_schema"})
    return _constraint("response_format", {"structural_tag": json.dumps(tag)})


def _constraint(field_name: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields, field_name=field_name)
    except InvalidParameter as exc:
        raise bad_request(field_name, str(exc)) from exc


def _check_extras(request: SamplingFields, logprobs: int | None, prompt_logprobs: int | None) -> None:
    if request.cache_salt is not None and not request.cache_salt:
        raise bad_request("cache_salt", "cache_salt must be a non-empty string if provided")
    if request.prompt_logprobs is not None and request.stream:  # as vLLM: they come whole, with the response
        raise bad_request("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    if request.use_beam_search:
        # Beams are ranked by cumulative logprob; their per-token logprobs are not kept.
        if logprobs is not None:
            raise bad_request("logprobs", "logprobs are not available with use_beam_search")
        if prompt_logprobs is not None:
            raise bad_request("prompt_logprobs", "prompt_logprobs are not available with use_beam_search")
