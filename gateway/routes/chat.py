"""POST /v1/chat/completions: n choices, streamed in OpenAI's chunk format or answered whole."""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.chat_messages import message_dicts
from gateway.choices import ChoiceDelta
from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.generation import prime
from gateway.json_body import OffLoopJsonRoute
from gateway.logprobs import chat_logprobs, prompt_logprobs
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    Usage,
)
from gateway.sampling import to_sampling_params
from gateway.sse import DONE, event, sse_response
from services.prompt import fit_prompt
from services.tokenizer_api import ChatPrompt
from tokenizer_svc.text_output import TextDelta

router = APIRouter(route_class=OffLoopJsonRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: GatewayContext = Depends(get_context)
) -> Response:
    return await cancel_on_disconnect(request, _chat(body, ctx))


async def _chat(body: ChatCompletionRequest, ctx: GatewayContext) -> Response:
    ctx.check_model(body.model)
    ctx.check_ready()
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format", f"response_format type {body.response_format.type!r} is not supported yet")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true")
    uses_completion_tokens = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if uses_completion_tokens else body.max_tokens
    num_top = body.top_logprobs or 0
    params = await to_sampling_params(
        body, ctx.encoder, max_tokens, num_top if body.logprobs else None, body.prompt_logprobs
    )
    prompt = await ctx.encoder.encode_chat(ChatPrompt(message_dicts(body.messages)))
    prompt_token_ids = fit_prompt(
        prompt.token_ids, params, ctx.max_model_len, "messages",
        "max_completion_tokens" if uses_completion_tokens else "max_tokens",
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await prime(ctx.generate(request_id, prompt_token_ids, params, body))

    def logprobs_of(delta: TextDelta) -> list[ChatTokenLogprob]:
        return chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, num_top) if delta.logprobs else []

    if body.stream:
        head = ChatCompletionChunk(id=request_id, model=ctx.served_model_name, choices=[])
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(head, params.n, stream, logprobs_of, len(prompt_token_ids), include_usage)
        return sse_response(events, stream)
    text: list[list[str]] = [[] for _ in range(params.n)]
    content_logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(params.n)]
    last: list[TextDelta | None] = [None] * params.n  # each choice's last delta carries its finish reason
    num_tokens = 0
    entries = None
    async with aclosing(stream):  # a cancelled request (its client left) ends its engine requests now
        async for item in stream:
            delta = item.text
            text[item.index].append(delta.text)
            content_logprobs[item.index].extend(logprobs_of(delta))
            last[item.index] = delta
            num_tokens += len(delta.token_ids)
            entries = entries or item.prompt_logprobs
    choices = [
        ChatChoice(
            index=index,
            message=ChatMessage(content="".join(text[index])),
            logprobs=ChatLogprobs(content=content_logprobs[index]) if body.logprobs else None,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        for index, delta in enumerate(last)
    ]
    response = ChatCompletionResponse(
        id=request_id, model=ctx.served_model_name, choices=choices, usage=Usage.of(len(prompt_token_ids), num_tokens),
        prompt_logprobs=prompt_logprobs(ctx.tokenizer, entries or [], body.prompt_logprobs)
        if body.prompt_logprobs is not None else None,
    )
    return JSONResponse(response.model_dump())


async def _events(
    head: ChatCompletionChunk,
    n: int,
    stream: AsyncGenerator[ChoiceDelta, None],
    logprobs_of: Callable[[TextDelta], list[ChatTokenLogprob]],
    num_prompt_tokens: int,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    def chunk(
        index: int, delta: DeltaMessage, logprobs: list[ChatTokenLogprob] | None = None,
        finish_reason: str | None = None,
    ) -> str:
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=ChatLogprobs(content=logprobs) if logprobs else None,
            finish_reason=finish_reason,
        )
        return event(head.model_copy(update={"choices": [choice]}))

    for index in range(n):  # as vLLM: every choice opens with its role
        yield chunk(index, DeltaMessage(role="assistant", content=""))
    num_tokens = 0
    async with aclosing(stream):
        async for item in stream:
            delta = item.text
            num_tokens += len(delta.token_ids)
            logprobs = logprobs_of(delta)
            if delta.text or logprobs:
                yield chunk(item.index, DeltaMessage(content=delta.text), logprobs)
            if delta.finish_reason is not None:
                # OpenAI ends a choice with an empty delta that carries the reason.
                yield chunk(item.index, DeltaMessage(), finish_reason=delta.finish_reason)
    if include_usage:
        yield event(head.model_copy(update={"usage": Usage.of(num_prompt_tokens, num_tokens)}))
    yield DONE
