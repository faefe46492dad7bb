"""Preparing a tokenized prompt for the engine, the same way for the SDK and the gateway:
truncate_prompt_tokens, the context-length check, and bad words as token sequences.

Context length, as vLLM does it: a request whose prompt plus max_tokens exceeds
max_model_len is refused ("This model's maximum context length is X tokens. However,
you requested Y tokens (P in the prompt, M in the completion)..."), never silently
shortened. Without max_tokens (chat's default) the completion may fill the rest of
the context, so only a prompt that leaves no room is refused.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.invalid_parameter import InvalidParameter
from services.sampling_params import SamplingParams


def fit_prompt(
    token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> list[int]:
    """The prompt after truncate_prompt_tokens, checked against the context length.
    `prompt_param` and `max_tokens_param` name the fields an error blames."""
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if keep > max_model_len:
            raise InvalidParameter(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                "Please, select a smaller truncation size.",
            )
        token_ids = token_ids[-(max_model_len if keep == -1 else keep) :]
    num_prompt, num_completion = len(token_ids), params.max_tokens
    head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
    if num_completion is None:
        if num_prompt >= max_model_len:
            raise InvalidParameter(
                prompt_param,
                f"{head} {num_prompt} tokens in the {prompt_param}. Please reduce the length of the {prompt_param}.",
            )
    elif num_prompt + num_completion > max_model_len:
        raise InvalidParameter(
            prompt_param if num_prompt >= max_model_len else max_tokens_param,
            f"{head} {num_prompt + num_completion} tokens ({num_prompt} in the {prompt_param}, {num_completion} in "
            f"the completion). Please reduce the length of the {prompt_param} or completion.",
        )
    return token_ids


def bad_word_spellings(words: Sequence[str]) -> list[str]:
    """Each word alone and after a space (its mid-sentence spelling), as vLLM bans them."""
    return [spelling for word in words for spelling in (word, " " + word.lstrip())]


def bad_words_token_ids(encoded_spellings: Sequence[list[int]]) -> list[list[int]]:
    """The distinct, non-empty token sequences of bad_word_spellings(), encoded without special tokens."""
    sequences: list[list[int]] = []
    for ids in encoded_spellings:
        if ids and ids not in sequences:
            sequences.append(list(ids))
    return sequences
