"""OpenAI request fields to SamplingParams, which checks the values (and names the field)."""
from __future__ import annotations

from typing import Any

from gateway.protocol import SamplingFields
from services.sampling_params import InvalidParameter, SamplingParams
from tokenizer_svc.tokenizer import Tokenizer

# Fields passed only when the client set them, so SamplingParams' (vLLM's) defaults hold.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words")
_ALWAYS = ("n", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
           "include_stop_str_in_output")


def to_sampling_params(
    request: SamplingFields, tokenizer: Tokenizer, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in _ALWAYS}
    kwargs.update((name, value) for name in _OPTIONAL if (value := getattr(request, name)) is not None)
    if request.bad_words:  # the engine bans token sequences; the gateway owns the tokenizer
        kwargs["bad_words_token_ids"] = tokenizer.bad_words_token_ids(request.bad_words)
    params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    if params.n != 1:  # each response choice is one TextStream over one engine request, for now
        raise InvalidParameter("n", f"only n=1 is supported for now, got {params.n}")
    return params
