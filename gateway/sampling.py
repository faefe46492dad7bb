"""Request fields to SamplingParams, which checks the values (and names the field).
The checks that need the prompt (truncation, context length) are services.prompt's,
shared with the SDK."""
from __future__ import annotations

from typing import Any

from gateway.errors import bad_request
from gateway.protocol import SamplingFields
from services.prompt import bad_word_spellings, bad_words_token_ids
from services.sampling_params import SamplingParams
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
) -> SamplingParams:
    _check_extras(request, logprobs, prompt_logprobs)
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in _ALWAYS}
    kwargs.update((name, value) for name in _OPTIONAL if (value := getattr(request, name)) is not None)
    if request.bad_words:  # the engine bans token sequences
        spellings = await encoder.encode(bad_word_spellings(request.bad_words), add_special_tokens=False)
        kwargs["bad_words_token_ids"] = bad_words_token_ids(spellings)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **kwargs)


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
