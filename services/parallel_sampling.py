"""Parallel sampling (`n`, `best_of`): one request fans out into child requests.

The scheduler computes the prompt once for the first child and forks the others
from it (shared blocks, copy-on-write of the partly filled last one). The front end
gathers the children back into one RequestOutput.
"""
from __future__ import annotations

import msgspec

from services.sampling_params import SamplingParams


def num_children(params: SamplingParams) -> int:
    return params.best_of or params.n


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def engine_request_ids(request_id: str, count: int) -> list[str]:
    """The ids a request runs under in the engine: its own, or one per child."""
    return [request_id] if count == 1 else [child_request_id(request_id, i) for i in range(count)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each child samples once; seeds differ per child so children differ but stay reproducible.
    best_of ranks children by cumulative logprob, so they must report it."""
    seed = None if params.seed is None else params.seed + index
    logprobs = params.logprobs
    if params.best_of and params.best_of > params.n and logprobs is None:
        logprobs = 0
    return msgspec.structs.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs)
