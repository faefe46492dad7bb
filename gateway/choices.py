"""One engine request seen as the text of its choices (n samples, or the n best of best_of).

The gateway owns detokenization and stop strings (the engine speaks token ids): each
choice gets a TextStream, and a stop-string hit finishes that choice here and aborts
its engine request (the child, for n > 1) so its blocks are freed at once. With
best_of > n the candidates are ranked by cumulative logprob once all have finished,
as the SDK does (OutputProcessor), so the chosen ones come out whole at the end.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from services.engine_client import EngineClient
from services.kv_transfer_messages import KvTransferParams
from services.lora_request import LoRARequest
from services.messages import TokenDelta
from services.parallel_sampling import child_params, engine_request_ids, num_children
from services.sampling_params import SamplingParams
from tokenizer_svc.text_output import OutputProcessor, TextDelta, TextStream
from tokenizer_svc.tokenizer import Tokenizer


@dataclass
class ChoiceDelta:
    index: int  # the choice, within its request
    text: TextDelta
    # With a choice's first delta, when prompt logprobs were asked for: one entry per
    # prompt token after the first.
    prompt_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0  # of the prompt, from the prefix cache: told with the first token
    # With the last delta of a request that asked its KV held (vLLM's do_remote_decode): where it waits.
    kv_transfer_params: KvTransferParams | None = None


class _Meters:
    """One RequestMeter per engine request: each child of a parallel request is metered as
    a request of its own, as vLLM V1 (where children are engine requests) does; the API
    request as a whole once its last child has ended, as vLLM's parent request is."""

    def __init__(self, metrics: GatewayMetrics, engine_ids: list[str], num_prompt_tokens: int,
                 params: SamplingParams) -> None:
        self._metrics = metrics
        self._n = params.n
        self._open = {i: metrics.request(num_prompt_tokens, params.max_tokens) for i in engine_ids}
        self._max_generated = 0

    def record(self, delta: TokenDelta, finish_reason: str | None) -> None:
        """`finish_reason` is the choice's, which a stop string may have set before the engine's."""
        meter = self._open.get(delta.request_id)
        if meter is None:
            return  # the engine's end of a request the gateway finished already
        meter.tokens(len(delta.new_token_ids), delta.first_token_times)
        if finish_reason is not None:
            self._finish(delta.request_id, finish_reason)

    def abort_rest(self) -> None:
        for engine_id in list(self._open):
            self._finish(engine_id, "abort")

    def _finish(self, engine_id: str, reason: str) -> None:
        meter = self._open.pop(engine_id)
        meter.finished(reason)
        self._max_generated = max(self._max_generated, meter.num_generation_tokens)
        if not self._open:
            self._metrics.choices_finished(self._n, self._max_generated)


async def generate_choices(
    engine: EngineClient,
    tokenizer: Tokenizer,
    metrics: GatewayMetrics,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    cache_salt: str | None,
    kv_transfer_params: KvTransferParams | None = None,
    lora_request: LoRARequest | None = None,
) -> AsyncGenerator[ChoiceDelta, None]:
    count = num_children(params)
    engine_ids = engine_request_ids(request_id, count)
    meters = _Meters(metrics, engine_ids, len(prompt_token_ids), params)
    ranked = params.best_of is not None and params.best_of > params.n
    rejected = False
    try:
        async with aclosing(engine.generate(request_id, prompt_token_ids, params, cache_salt,
                                            kv_transfer_params, lora_request)) as deltas:
            if ranked:
                choices = _ranked(engine, tokenizer, meters, deltas, request_id, prompt_token_ids, params)
            else:
                choices = _live(engine, tokenizer, meters, deltas, engine_ids, prompt_token_ids, params)
            async with aclosing(choices):
                async for choice in choices:
                    yield choice
    except ValueError:
        rejected = True  # rejected input: the request never started
        raise
    finally:
        if not rejected:  # whatever ended the stream before its end (disconnect, failure) is an abort
            meters.abort_rest()


async def _live(
    engine: EngineClient,
    tokenizer: Tokenizer,
    meters: _Meters,
    deltas: AsyncIterator[TokenDelta],
    engine_ids: list[str],
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> AsyncGenerator[ChoiceDelta, None]:
    """Each choice's text as it comes; ends when every choice has finished."""
    streams = {engine_id: TextStream(tokenizer, prompt_token_ids, child_params(params, i))
               for i, engine_id in enumerate(engine_ids)}
    index = {engine_id: i for i, engine_id in enumerate(engine_ids)}
    started: set[str] = set()
    # The first child computes the prompt (the others fork from it), so its first delta
    # carries the prompt logprobs.
    prompt_logprobs: list[dict[int, float]] | None = None
    async for delta in deltas:
        prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
        text = streams[delta.request_id]
        if text.finished:
            continue  # the engine's end of a choice a stop string finished
        update = text.apply(delta)
        meters.record(delta, update.finish_reason)
        if update.hit_stop_string:
            await engine.abort(delta.request_id)
        first = delta.request_id not in started
        started.add(delta.request_id)
        with_prompt = first and params.prompt_logprobs is not None
        yield ChoiceDelta(index[delta.request_id], update, (prompt_logprobs or []) if with_prompt else None,
                          delta.num_cached_tokens, delta.kv_transfer_params)
        if all(stream.finished for stream in streams.values()):
            return


async def _ranked(
    engine: EngineClient,
    tokenizer: Tokenizer,
    meters: _Meters,
    deltas: AsyncIterator[TokenDelta],
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> AsyncGenerator[ChoiceDelta, None]:
    """best_of > n: every candidate runs to its end, then the n best come out whole."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(request_id, None, prompt_token_ids, params)
    num_cached_tokens = 0
    async for delta in deltas:
        num_cached_tokens = max(num_cached_tokens, delta.num_cached_tokens)
        stopped: list[str] = []  # children a stop string finished: the engine must drop them
        finished = processor.process([delta], stopped.append)
        meters.record(delta, "stop" if stopped else delta.finish_reason)
        for child_id in stopped:
            await engine.abort(child_id)
        if finished:
            [output] = finished
            # OutputProcessor keeps vLLM's leading None (the first prompt token has no logprob).
            prompt_logprobs = output.prompt_logprobs[1:] if output.prompt_logprobs is not None else None
            for completion in output.outputs:
                text = TextDelta(completion.text, completion.token_ids, completion.logprobs,
                                 completion.finish_reason, completion.stop_reason)
                yield ChoiceDelta(completion.index, text, prompt_logprobs, num_cached_tokens)
            return
