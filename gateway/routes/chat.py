"""POST /v1/chat/completions: n choices, streamed in OpenAI's chunk format or answered whole.

vLLM's extras: `add_generation_prompt` false and `continue_final_message` let the model
go on with the last message, which `echo` puts before the reply (when the reply's role,
the last message's then, is its role); `return_token_ids` adds the prompt's token ids
(streamed: with each choice's first chunk) and each choice's.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.chat_messages import message_dicts, tool_dicts
from gateway.choices import ChoiceDelta
from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.generation import prime
from gateway.json_body import OffLoopJsonRoute
from gateway.logprobs import chat_logprobs, prompt_logprobs
from gateway.protocol import ChatCompletionRequest
from gateway.response_options import StreamUsage
from gateway.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    Usage,
)
from gateway.sampling import response_format_constraint, to_sampling_params
from gateway.sse import DONE, event, sse_response
from gateway.tool_calls import OutputReader, StreamingOutputReader
from gateway.tool_parsers import StreamDelta, new_tool_call_id
from gateway.tool_parsers.reasoning import END_THINK
from services.kv_transfer_messages import KvTransferParams
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
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message",
                          "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    uses_completion_tokens = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if uses_completion_tokens else body.max_tokens
    num_top = ctx.limits.logprobs(body.top_logprobs, "top_logprobs", "sample", ctx.vocab_size) or 0
    num_prompt_logprobs = ctx.limits.logprobs(body.prompt_logprobs, "prompt_logprobs", "prompt", ctx.vocab_size)
    reader = OutputReader.of(body, ctx.chat_options)
    tools = reader.tools
    constraint = response_format_constraint(body.response_format)
    forced = tools.constraint if tools is not None else None
    if forced is not None:
        if constraint is not None:
            raise bad_request("response_format", f"response_format cannot be combined with tool_choice {tools.choice!r}")
        constraint = forced
    params = await to_sampling_params(
        body, ctx.encoder, max_tokens, num_top if body.logprobs else None, num_prompt_logprobs, constraint,
    )
    messages = message_dicts(body.messages)
    prompt = await ctx.encoder.encode_chat(ChatPrompt(messages, body.add_generation_prompt, tools=tool_dicts(body.tools),
                                                      continue_final_message=body.continue_final_message))
    if params.structured_outputs is not None and reader.reasoning is not None and reader.reasoning.thinks_after(prompt.text):
        [end] = await ctx.encoder.encode([END_THINK], add_special_tokens=False)
        # The grammar starts once the reasoning has ended.
        constraint = msgspec.structs.replace(params.structured_outputs, reasoning_end_token_ids=tuple(end))
        params = msgspec.structs.replace(params, structured_outputs=constraint)
    prompt_token_ids = fit_prompt(
        prompt.token_ids, params, ctx.max_model_len, "messages",
        "max_completion_tokens" if uses_completion_tokens else "max_tokens",
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await prime(ctx.generate(request_id, prompt_token_ids, params, body))
    as_ids = ctx.options.tokens_as_ids(body.return_tokens_as_token_ids)

    def logprobs_of(delta: TextDelta) -> list[ChatTokenLogprob]:
        return chat_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, num_top, as_ids) if delta.logprobs else []

    # As vLLM: without a generation prompt the reply goes on in the last message's role.
    role = "assistant" if body.add_generation_prompt else messages[-1]["role"]
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""
    if body.stream:
        head = ChatCompletionChunk(id=request_id, model=ctx.response_model(body.model), choices=[])
        shape = _StreamShape(role, echo, prompt_token_ids, bool(body.return_token_ids),
                             ctx.options.stream_usage(body.stream_options))
        return sse_response(_events(head, params.n, stream, logprobs_of, shape, reader), stream)
    text: list[list[str]] = [[] for _ in range(params.n)]
    token_ids: list[list[int]] = [[] for _ in range(params.n)]
    content_logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(params.n)]
    last: list[TextDelta | None] = [None] * params.n  # each choice's last delta carries its finish reason
    num_cached_tokens = 0
    entries = None
    handoff = None  # vLLM's kv_transfer_params, when the request asked its KV held
    async with aclosing(stream):  # a cancelled request (its client left) ends its engine requests now
        async for item in stream:
            handoff = item.kv_transfer_params or handoff
            delta = item.text
            text[item.index].append(delta.text)
            token_ids[item.index].extend(delta.token_ids)
            content_logprobs[item.index].extend(logprobs_of(delta))
            last[item.index] = delta
            num_cached_tokens = max(num_cached_tokens, item.num_cached_tokens)
            entries = entries or item.prompt_logprobs
    choices = []
    for index, delta in enumerate(last):
        reasoning, parsed = reader.read("".join(text[index]))
        calls = [ToolCallOut(id=new_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.tool_calls]
        content = echo + (parsed.content or "") if echo else parsed.content
        choices.append(ChatChoice(
            index=index,
            message=ChatMessage(role=role, content=content, tool_calls=calls, reasoning=reasoning),
            logprobs=ChatLogprobs(content=content_logprobs[index]) if body.logprobs else None,
            finish_reason=tools.finish_reason(bool(calls), delta.finish_reason) if tools else delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=token_ids[index] if body.return_token_ids else None,
        ))
    num_tokens = sum(map(len, token_ids))
    response = ChatCompletionResponse(
        id=request_id, model=ctx.response_model(body.model), choices=choices,
        usage=Usage.of(len(prompt_token_ids), num_tokens,
                       num_cached_tokens if ctx.options.prompt_tokens_details else None),
        prompt_logprobs=prompt_logprobs(ctx.tokenizer, entries or [], num_prompt_logprobs)
        if num_prompt_logprobs is not None else None,
        prompt_token_ids=prompt_token_ids if body.return_token_ids else None,
        kv_transfer_params=handoff.as_dict() if handoff is not None else None,
    )
    # pydantic writes the JSON itself: many times faster than json.dumps on a big answer
    # (logprobs of the whole vocabulary), and the same writer as the streams'.
    return Response(response.model_dump_json(), media_type="application/json")


@dataclass(frozen=True)
class _StreamShape:
    """What a stream sends besides the model's text."""

    role: str  # each choice's first chunk
    echo: str  # then the last message's content, with echo
    prompt_token_ids: list[int]
    with_ids: bool  # return_token_ids: the prompt's with each choice's first chunk, then each chunk's own
    usage: StreamUsage


async def _events(
    head: ChatCompletionChunk,
    n: int,
    stream: AsyncGenerator[ChoiceDelta, None],
    logprobs_of: Callable[[TextDelta], list[ChatTokenLogprob]],
    shape: _StreamShape,
    reader: OutputReader,
) -> AsyncGenerator[str, None]:
    usage = shape.usage
    num_prompt_tokens = len(shape.prompt_token_ids)
    num_tokens = [0] * n  # each choice's so far
    num_cached_tokens = 0

    def chunk(
        index: int, delta: DeltaMessage, logprobs: list[ChatTokenLogprob] | None = None,
        finish_reason: str | None = None, token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
        handoff: KvTransferParams | None = None,
    ) -> str:
        choice = ChatChunkChoice(
            index=index, delta=delta, logprobs=ChatLogprobs(content=logprobs) if logprobs else None,
            finish_reason=finish_reason, token_ids=token_ids,
        )
        so_far = Usage.of(num_prompt_tokens, num_tokens[index]) if usage.continuous else None
        return event(head.model_copy(update={"choices": [choice], "usage": so_far, "prompt_token_ids": prompt_token_ids,
                                             "kv_transfer_params": handoff.as_dict() if handoff is not None else None}))

    for index in range(n):  # as vLLM: every choice opens with its role
        yield chunk(index, DeltaMessage(role=shape.role, content=""),
                    prompt_token_ids=shape.prompt_token_ids if shape.with_ids else None)
    for index in range(n if shape.echo else 0):
        yield chunk(index, DeltaMessage(content=shape.echo))
    plain = reader.reasoning is None and reader.tools is None
    readers = [StreamingOutputReader(reader) for _ in range(n)]
    called = [False] * n
    async with aclosing(stream):
        async for item in stream:
            delta = item.text
            num_tokens[item.index] += len(delta.token_ids)
            num_cached_tokens = max(num_cached_tokens, item.num_cached_tokens)
            logprobs = logprobs_of(delta)
            token_ids = delta.token_ids if shape.with_ids and delta.token_ids else None
            last = delta.finish_reason is not None
            if plain:
                messages = [DeltaMessage(content=delta.text)] if delta.text or logprobs or token_ids or last else []
            else:
                messages = _read(readers[item.index], delta.text, last)
                called[item.index] |= any(m.tool_calls for m in messages)
                # A delta that says nothing yet still sends its logprobs and token ids.
                messages = messages or [DeltaMessage()] * (bool(logprobs or token_ids) or last)
            reason = None
            if last:
                reason = delta.finish_reason
                if reader.tools is not None:
                    reason = reader.tools.finish_reason(called[item.index], reason)
            for number, message in enumerate(messages):
                # As vLLM: the choice's last delta (its last token's text) carries the finish reason,
                # and a do_remote_decode request's kv_transfer_params (on its final delta) with it.
                final = number == len(messages) - 1
                yield chunk(item.index, message, logprobs if number == 0 else None, reason if final else None,
                            token_ids if number == 0 else None, handoff=item.kv_transfer_params if final else None)
    if usage.final:
        total = Usage.of(num_prompt_tokens, sum(num_tokens), num_cached_tokens if usage.cached_details else None)
        yield event(head.model_copy(update={"usage": total}))
    yield DONE


def _read(reader: StreamingOutputReader, text: str, last: bool) -> list[DeltaMessage]:
    """One output delta as chat deltas: reasoning, content, and each tool call's name
    (with its id) before its argument fragments, as OpenAI streams them."""
    reasoning, read = reader.feed(text)
    if last:
        more_reasoning, rest = reader.finish()
        reasoning += more_reasoning
        read = StreamDelta(read.content + rest.content, read.tool_calls + rest.tool_calls)
    messages = []
    if reasoning or read.content:
        messages.append(DeltaMessage(reasoning=reasoning or None, content=read.content or None))
    for call in read.tool_calls:
        if call.name is not None:
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=call.index, id=new_tool_call_id(), type="function",
                function=DeltaFunctionCall(name=call.name, arguments=""))]))
        if call.arguments:
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=call.index, function=DeltaFunctionCall(arguments=call.arguments))]))
    return messages
