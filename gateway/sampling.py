"""Request fields to SamplingParams, which checks the values (and names the field), and
the checks that need the prompt: truncation and the context length.

Context length, as vLLM's server does it: a request whose prompt plus max_tokens
exceeds max_model_len is a 400 ("This model's maximum context length is X tokens.
However, you requested Y tokens (P in the prompt, M in the completion)..."), never
silently shortened. Without max_tokens (chat's default) the completion may fill
the rest of the context, so only a prompt that leaves no room is refused.
"""
from __future__ import annotations

from typing import Any

from gateway.errors import bad_request
from gateway.protocol import SamplingFields
from services.sampling_params import SamplingParams
from tokenizer_svc.tokenizer import Tokenizer

# Fields passed only when the client set them, so SamplingParams' (vLLM's) defaults hold.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "best_of",
             "truncate_prompt_tokens")
_ALWAYS = ("n", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
           "include_stop_str_in_output")


def to_sampling_params(
    request: SamplingFields,
    tokenizer: Tokenizer,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    _check_extras(request, logprobs, prompt_logprobs)
    kwargs: dict[str, Any] = {name: getattr(request, name) for name in _ALWAYS}
    kwargs.update((name, value) for name in _OPTIONAL if (value := getattr(request, name)) is not None)
    if request.bad_words:  # the engine bans token sequences; the gateway owns the tokenizer
        kwargs["bad_words_token_ids"] = tokenizer.bad_words_token_ids(request.bad_words)
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


def fit_prompt(
    token_ids: list[int], params: SamplingParams, max_model_len: int, prompt_param: str, max_tokens_param: str
) -> list[int]:
    """The prompt after truncate_prompt_tokens, checked against the context length.
    `prompt_param` and `max_tokens_param` name the fields an error blames."""
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if keep > max_model_len:
            raise bad_request(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                "Please, select a smaller truncation size.",
            )
        token_ids = token_ids[-(max_model_len if keep == -1 else keep) :]
    num_prompt, num_completion = len(token_ids), params.max_tokens
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
    if num_completion is None:
        if num_prompt >= max_model_len:
            raise bad_request(
                prompt_param,
                f"{head} {num_prompt} tokens in the {prompt_param}. Please reduce the length of the {prompt_param}.",
            )
    elif num_prompt + num_completion > max_model_len:
        raise bad_request(
            prompt_param if num_prompt >= max_model_len else max_tokens_param,
            f"{head} {num_prompt + num_completion} tokens ({num_prompt} in the {prompt_param}, {num_completion} in "
            f"the completion). Please reduce the length of the {prompt_param} or completion.",
        )
    return token_ids
