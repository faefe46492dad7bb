"""POST /v1/completions: one prompt or a batch, text or token ids, n choices each, streamed or not.

Choice i of prompt p has index p * n + i, as in vLLM. echo prepends the prompt to each
choice's text, and with logprobs the prompt's tokens lead the logprobs (their first
without one), as OpenAI's legacy API does. vLLM's return_token_ids adds the prompt's and
the choice's token ids to each choice (streamed: the prompt's with its first chunk).
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.choices import ChoiceDelta
from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.generation import merge, prime_all
from gateway.json_body import OffLoopJsonRoute
from gateway.logprobs import CompletionLogprobsBuilder, prompt_logprobs
from gateway.protocol import CompletionRequest
from gateway.response_options import StreamUsage
from gateway.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from gateway.sampling import to_sampling_params
from gateway.sse import DONE, event, sse_response
from services.kv_transfer_messages import KvTransferParams
from services.parallel_sampling import num_children
from services.prompt import fit_prompt

router = APIRouter(route_class=OffLoopJsonRoute)
# Both of vLLM's wordings, older and newer, which clients match on.
_EMPTY_PROMPT = "The decoder prompt cannot be empty. Either prompt or prompt_embeds must be provided and non-empty."


@dataclass
class _Prompt:
    text: str  # what echo shows
    token_ids: list[int]


@dataclass
class _Choice:
    """One choice's output as it accumulates."""

    prompt: _Prompt
    logprobs: CompletionLogprobsBuilder | None
    echo: bool  # the prompt still has to go out
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # of the prompt, from the prefix cache
    kv_transfer_params: KvTransferParams | None = None  # vLLM's, when the request asked its KV held

    def take(self, item: ChoiceDelta) -> tuple[str, CompletionLogprobs | None]:
        """Adds a delta; returns what of it goes out: text and logprobs, the prompt's first."""
        delta = item.text
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.token_logprobs.extend(delta.logprobs or [])
        self.prompt_logprobs = self.prompt_logprobs or item.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
        self.kv_transfer_params = item.kv_transfer_params or self.kv_transfer_params
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        text, logprobs = delta.text, None
        if self.logprobs is not None:
            logprobs = (
                self.logprobs.build_echo(self.prompt.token_ids, item.prompt_logprobs or [], delta.token_ids,
                                         delta.logprobs or [])
                if self.echo else self.logprobs.build(delta.token_ids, delta.logprobs or [])
            )
        if self.echo:
            text, self.echo = self.prompt.text + text, False
        return text, logprobs


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, ctx: GatewayContext = Depends(get_context)
) -> Response:
    return await cancel_on_disconnect(request, _complete(body, ctx))


async def _complete(body: CompletionRequest, ctx: GatewayContext) -> Response:
    ctx.check_model(body.model)
    ctx.check_ready()
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    if not body.prompt:  # absent, null, "" or []
        raise bad_request("prompt", _EMPTY_PROMPT)
    num_logprobs = ctx.limits.logprobs(body.logprobs, "logprobs", "sample", ctx.vocab_size)
    num_prompt_logprobs = ctx.limits.logprobs(body.prompt_logprobs, "prompt_logprobs", "prompt", ctx.vocab_size)
    # echo with logprobs shows the prompt's logprobs too: the engine computes them.
    prompt_top = num_prompt_logprobs if num_prompt_logprobs is not None else (num_logprobs if body.echo else None)
    params = await to_sampling_params(body, ctx.encoder, body.max_tokens, num_logprobs, prompt_top)
    num_prompts = 1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
    ctx.limits.check_fan_out(num_prompts, num_children(params), "best_of" if params.best_of else "n")
    prompts = []
    for prompt in await _prompts(body.prompt, ctx):
        if not prompt.token_ids:  # one of a batch, or a text of no tokens
            raise bad_request("prompt", _EMPTY_PROMPT)
        token_ids = fit_prompt(prompt.token_ids, params, ctx.max_model_len, "prompt", "max_tokens")
        if len(token_ids) < len(prompt.token_ids):  # truncated: echo what the model saw
            prompt = _Prompt(_echo_text(ctx, token_ids), token_ids)
        prompts.append(prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await prime_all(
        [ctx.generate(f"{request_id}-{i}", prompt.token_ids, params, body) for i, prompt in enumerate(prompts)]
    )
    as_ids = ctx.options.tokens_as_ids(body.return_tokens_as_token_ids)
    choices = [
        _Choice(prompt, CompletionLogprobsBuilder(ctx.tokenizer, num_logprobs, as_ids)
                if num_logprobs is not None else None, body.echo)
        for prompt in prompts for _ in range(params.n)
    ]
    head = CompletionResponse(id=request_id, model=ctx.response_model(body.model), choices=[])
    deltas = _flat(merge(streams), params.n)
    with_ids = bool(body.return_token_ids)
    if body.stream:
        usage = ctx.options.stream_usage(body.stream_options)
        return sse_response(_events(head, prompts, choices, deltas, params.n, usage, with_ids), *streams)
    pieces: list[list[CompletionLogprobs]] = [[] for _ in choices]
    try:
        async for index, item in deltas:
            _, logprobs = choices[index].take(item)
            pieces[index].extend([logprobs] if logprobs is not None else [])
    finally:  # a cancelled request (its client left) ends its engine requests now
        for stream in streams:
            await stream.aclose()
    head.choices = [
        CompletionChoice(
            index=index,
            text=(choice.prompt.text if body.echo else "") + "".join(choice.text),
            logprobs=_joined(pieces[index]) if choice.logprobs is not None else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=prompt_logprobs(ctx.tokenizer, choice.prompt_logprobs or [], num_prompt_logprobs)
            if num_prompt_logprobs is not None else None,
            prompt_token_ids=choice.prompt.token_ids if with_ids else None,
            token_ids=choice.token_ids if with_ids else None,
        )
        for index, choice in enumerate(choices)
    ]
    head.usage = _usage(prompts, choices, params.n, ctx.options.prompt_tokens_details)
    handoff = next((choice.kv_transfer_params for choice in choices if choice.kv_transfer_params), None)
    head.kv_transfer_params = handoff.as_dict() if handoff is not None else None
    # pydantic writes the JSON itself: many times faster than json.dumps on a big answer
    # (logprobs of the whole vocabulary), and the same writer as the streams'.
    return Response(head.model_dump_json(), media_type="application/json")


async def _flat(
    deltas: AsyncGenerator[tuple[int, ChoiceDelta], None], n: int
) -> AsyncGenerator[tuple[int, ChoiceDelta], None]:
    """(prompt, its choice) to the response's choice index."""
    async with aclosing(deltas):
        async for prompt_index, item in deltas:
            yield prompt_index * n + item.index, item


def _joined(pieces: list[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for piece in pieces:
        out.tokens += piece.tokens
        out.token_logprobs += piece.token_logprobs
        out.top_logprobs += piece.top_logprobs
        out.text_offset += piece.text_offset
    return out


async def _events(
    head: CompletionResponse,
    prompts: list[_Prompt],
    choices: list[_Choice],
    deltas: AsyncGenerator[tuple[int, ChoiceDelta], None],
    n: int,
    usage: StreamUsage,
    with_ids: bool,
) -> AsyncGenerator[str, None]:
    """`with_ids`: each chunk carries its new token ids, a choice's first also the prompt's."""
    def chunk(choices: list[CompletionChunkChoice], usage: Usage | None,
              handoff: KvTransferParams | None = None) -> str:
        return event(CompletionChunk(id=head.id, created=head.created, model=head.model, choices=choices, usage=usage,
                                     kv_transfer_params=handoff.as_dict() if handoff is not None else None))

    started: set[int] = set()  # the choices whose first chunk went out
    async with aclosing(deltas):
        async for index, item in deltas:
            choice = choices[index]
            text, logprobs = choice.take(item)
            finish_reason = item.text.finish_reason
            token_ids = item.text.token_ids if with_ids else None
            if text or logprobs or finish_reason or token_ids:
                first = index not in started
                started.add(index)
                yield chunk([CompletionChunkChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=item.text.stop_reason,
                    prompt_token_ids=choice.prompt.token_ids if with_ids and first else None, token_ids=token_ids,
                )], Usage.of(len(choice.prompt.token_ids), len(choice.token_ids)) if usage.continuous else None,
                    item.kv_transfer_params)  # on the final delta, which always goes out: it has a finish reason
    if usage.final:
        yield chunk([], _usage(prompts, choices, n, usage.cached_details))
    yield DONE


def _usage(prompts: list[_Prompt], choices: list[_Choice], n: int, cached_details: bool) -> Usage:
    """Each prompt counts once, however many choices it has (its n choices share its
    cached tokens: all but the first fork from it); every choice's tokens count."""
    cached = sum(choice.num_cached_tokens for choice in choices[::n]) if cached_details else None
    return Usage.of(sum(len(prompt.token_ids) for prompt in prompts), sum(len(choice.token_ids) for choice in choices),
                    cached)


async def _prompts(prompt: str | list[str] | list[int] | list[list[int]], ctx: GatewayContext) -> list[_Prompt]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt[0], int):
        return [_Prompt(_echo_text(ctx, prompt), list(prompt))]
    if isinstance(prompt[0], str):
        return [_Prompt(text, ids) for text, ids in zip(prompt, await ctx.encoder.encode(prompt))]
    return [_Prompt(_echo_text(ctx, ids), list(ids)) for ids in prompt]


def _echo_text(ctx: GatewayContext, token_ids: list[int]) -> str:
    """A token-id prompt as echo shows it: special tokens included, as vLLM decodes it, so
    the text holds every token that echo's logprobs list (and their text_offset count)."""
    return ctx.tokenizer.decode(token_ids, skip_special_tokens=False)
