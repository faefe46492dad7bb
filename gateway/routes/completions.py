"""POST /v1/completions: one prompt or a batch, text or token ids, streamed or not."""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.generation import merge, prime_all
from gateway.logprobs import CompletionLogprobsBuilder
from gateway.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from gateway.sampling import to_sampling_params
from gateway.sse import DONE, event, sse_response
from services.output_processor import TextDelta
from tokenizer_svc.tokenizer import Tokenizer

router = APIRouter()


@dataclass
class _Prompt:
    text: str  # what echo shows
    token_ids: list[int]


@dataclass
class _Choice:
    """One prompt's output as it accumulates."""

    prompt: _Prompt
    logprobs: CompletionLogprobsBuilder | None
    echo: bool
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    if body.echo and body.logprobs is not None:
        raise bad_request("echo", "echo with logprobs needs prompt logprobs, which are not supported yet")
    prompts = _prompts(body.prompt, ctx.tokenizer)
    params = to_sampling_params(body, ctx.tokenizer, body.max_tokens, body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await prime_all(
        [ctx.generate(f"{request_id}-{i}", prompt.token_ids, params) for i, prompt in enumerate(prompts)]
    )
    choices = [
        _Choice(
            prompt,
            CompletionLogprobsBuilder(ctx.tokenizer, body.logprobs, len(prompt.text) if body.echo else 0)
            if body.logprobs is not None else None,
            body.echo,
        )
        for prompt in prompts
    ]
    head = CompletionResponse(id=request_id, model=ctx.served_model_name, choices=[])
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(_events(head, choices, merge(streams), include_usage))
    async for index, delta in merge(streams):
        choice = choices[index]
        choice.text.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            choice.token_logprobs.extend(delta.logprobs)
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    head.choices = [
        CompletionChoice(
            index=index,
            text=(choice.prompt.text if choice.echo else "") + "".join(choice.text),
            logprobs=choice.logprobs.build(choice.token_ids, choice.token_logprobs) if choice.logprobs else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        for index, choice in enumerate(choices)
    ]
    head.usage = _usage(choices)
    return JSONResponse(head.model_dump())


async def _events(
    head: CompletionResponse,
    choices: list[_Choice],
    deltas: AsyncGenerator[tuple[int, TextDelta], None],
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    async with aclosing(deltas):
        async for index, delta in deltas:
            choice = choices[index]
            text = delta.text
            if choice.echo:  # the prompt goes out with the first chunk
                text, choice.echo = choice.prompt.text + text, False
            choice.token_ids.extend(delta.token_ids)
            logprobs = (
                choice.logprobs.build(delta.token_ids, delta.logprobs) if choice.logprobs and delta.logprobs else None
            )
            if text or logprobs or delta.finish_reason:
                chunk = CompletionChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                )
                yield event(head.model_copy(update={"choices": [chunk]}))
    if include_usage:
        yield event(head.model_copy(update={"usage": _usage(choices)}))
    yield DONE


def _usage(choices: list[_Choice]) -> Usage:
    return Usage.of(
        sum(len(choice.prompt.token_ids) for choice in choices), sum(len(choice.token_ids) for choice in choices)
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[_Prompt]:
    if isinstance(prompt, str):
        return [_Prompt(prompt, tokenizer.encode(prompt))]
    if not prompt:
        raise bad_request("prompt", "the prompt must not be empty")
    if isinstance(prompt[0], int):
        return [_Prompt(tokenizer.decode(prompt), list(prompt))]
    if isinstance(prompt[0], str):
        return [_Prompt(text, tokenizer.encode(text)) for text in prompt]
    return [_Prompt(tokenizer.decode(ids), list(ids)) for ids in prompt]
