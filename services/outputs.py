"""vLLM-shaped results of a generation."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # When SamplingParams.logprobs is set: per token, {token id: logprob} of the top
    # tokens (best first) plus the sampled one.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # When SamplingParams.prompt_logprobs is set: None for the first prompt token,
    # then {token id: logprob} of the top tokens plus the actual one.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0  # of the prompt, those the prefix cache supplied
