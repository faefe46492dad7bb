"""Beam search through the API (vLLM's `use_beam_search`), on the SDK's `beam_search`.

As in vLLM's server, the beam width is best_of (or n) and the n best beams are the
choices; `length_penalty` scales the ranking. `beam_search` is synchronous and asks
a callback for each round's next-token logprobs, so it runs on a worker thread and
each round runs on the event loop as ordinary engine requests (one per live beam,
one token each; the prefix cache holds what the beams share). The beams come out
whole when the search ends, streamed or not. Only EOS ends a beam; stop strings cut
the finished text, as they cut any other.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import AsyncGenerator
from contextlib import aclosing

from gateway.choices import ChoiceDelta
from gateway.metrics import GatewayMetrics
from services.beam_search import BeamSearchParams, beam_search
from services.engine_client import EngineClient
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.sampling_params import SamplingParams
from tokenizer_svc.text_output import TextStream
from tokenizer_svc.tokenizer import Tokenizer


class _Rounds:
    """beam_search's `next_tokens`, called on its thread, run as engine requests on `loop`."""

    def __init__(
        self, engine: EngineClient, request_id: str, cache_salt: str | None, loop: asyncio.AbstractEventLoop,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self._engine = engine
        self._request_id = request_id
        self._cache_salt = cache_salt
        self._lora_request = lora_request
        self._loop = loop
        self._numbers = itertools.count()
        self._cancelled = threading.Event()
        self._current: concurrent.futures.Future[list[dict[int, float]]] | None = None

    def next_tokens(self, prompts: list[list[int]], params: SamplingParams) -> list[dict[int, float]]:
        if self._cancelled.is_set():
            raise concurrent.futures.CancelledError()
        round_id = f"{self._request_id}-{next(self._numbers)}"
        self._current = asyncio.run_coroutine_threadsafe(self._round(round_id, prompts, params), self._loop)
        if self._cancelled.is_set():  # cancel() ran between the check above and the assignment
            self._current.cancel()
        return self._current.result()

    def cancel(self) -> None:
        """From the event loop: no new round starts, and the running one is aborted."""
        self._cancelled.set()
        if self._current is not None:
            self._current.cancel()

    async def _round(self, round_id: str, prompts: list[list[int]], params: SamplingParams) -> list[dict[int, float]]:
        async def top(index: int, prompt: list[int]) -> dict[int, float]:
            request = self._engine.generate(f"{round_id}-{index}", prompt, params, self._cache_salt,
                                            lora_request=self._lora_request)
            async with aclosing(request) as deltas:
                entries = [entry async for delta in deltas for entry in delta.logprobs or []]
            return entries[0]

        tasks = [asyncio.ensure_future(top(i, prompt)) for i, prompt in enumerate(prompts)]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed (e.g. rejected input): the others need not finish
            for task in tasks:
                task.cancel()


async def beam_choices(
    engine: EngineClient,
    tokenizer: Tokenizer,
    metrics: GatewayMetrics,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    length_penalty: float,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    cache_salt: str | None,
    lora_request: LoRARequest | None = None,
) -> AsyncGenerator[ChoiceDelta, None]:
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt_token_ids)
    search = BeamSearchParams(params.best_of or params.n, max_tokens, params.ignore_eos, length_penalty)
    rounds = _Rounds(engine, request_id, cache_salt, asyncio.get_running_loop(), lora_request)
    meter = metrics.request(len(prompt_token_ids), max_tokens)
    try:
        output = await asyncio.to_thread(beam_search, prompt_token_ids, search, eos_token_ids, rounds.next_tokens)
    except ValueError:  # rejected input: the request never started
        raise
    except BaseException:
        rounds.cancel()
        meter.finished("abort")
        metrics.choices_finished(params.n, 0)
        raise
    choices = []
    generated = [beam.tokens[len(prompt_token_ids):] for beam in output.sequences]  # beams carry the prompt
    for index, (beam, token_ids) in enumerate(zip(output.sequences[: params.n], generated)):
        delta = TokenDelta(request_id, token_ids, beam.finish_reason)
        choices.append(ChoiceDelta(index, TextStream(tokenizer, prompt_token_ids, params).apply(delta)))
    meter.tokens(sum(map(len, generated)))
    meter.finished(choices[0].text.finish_reason)
    metrics.choices_finished(params.n, max(map(len, generated[: params.n])))
    for choice in choices:
        yield choice
