"""vLLM's POST /tokenize and /detokenize, for clients that count or inspect tokens."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse

from gateway.chat_messages import message_dicts, tool_dicts
from gateway.context import GatewayContext, get_context
from gateway.errors import bad_request
from gateway.json_body import OffLoopJsonRoute
from gateway.protocol import DetokenizeRequest, TokenizeRequest
from gateway.responses import DetokenizeResponse, TokenizeResponse
from services.tokenizer_api import ChatPrompt
from tokenizer_svc.tokenizer import Tokenizer

router = APIRouter(route_class=OffLoopJsonRoute)
# About 0.5 ms of writing each: a request served meanwhile takes a few dozen passes
# of the event loop, each of which may wait for one slice.
_IDS_PER_SLICE = 4096
# Freeing a few million ints at once is one loop in C with the GIL held (30 ms on a fast
# CPU, ten times that on a slow, loaded one); this many at a time, the loop free between.
_IDS_FREED_PER_SLICE = 65536


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: GatewayContext = Depends(get_context)) -> Response:
    ctx.check_model(body.model)
    ctx.check_ready()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt", "give either prompt or messages")
    if body.messages is not None:
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request("continue_final_message",
                              "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        # The chat template writes its own special tokens.
        chat = ChatPrompt(message_dicts(body.messages), body.add_generation_prompt, bool(body.add_special_tokens),
                          tool_dicts(body.tools), continue_final_message=body.continue_final_message)
        tokens = (await ctx.encoder.encode_chat(chat)).token_ids
    else:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        [tokens] = await ctx.encoder.encode([body.prompt], add_special_tokens)
    token_strs = ctx.tokenizer if body.return_token_strs else None
    return StreamingResponse(_reply(tokens, ctx.max_model_len, token_strs), media_type="application/json")


async def _reply(tokens: list[int], max_model_len: int, token_strs: Tokenizer | None) -> AsyncIterator[bytes]:
    """vLLM's TokenizeResponse, its JSON in slices, the event loop free between them: a
    multi-megabyte prompt's ids take half a second to write (with the GIL held, so a
    thread would not help). `token_strs`: the tokenizer that names each token, when asked."""
    yield f'{{"count": {len(tokens)}, "max_model_len": {max_model_len}, "tokens": ['.encode()
    for start in range(0, len(tokens), _IDS_PER_SLICE):
        # A list of ints prints as its JSON, twice as fast as json.dumps.
        ids = repr(tokens[start:start + _IDS_PER_SLICE])[1:-1]
        yield (", " + ids if start else ids).encode()
        await asyncio.sleep(0)
    if token_strs is None:
        yield b'], "token_strs": null}'
    else:
        yield b'], "token_strs": ['
        for start in range(0, len(tokens), _IDS_PER_SLICE):
            strs = json.dumps(token_strs.convert_ids_to_tokens(tokens[start:start + _IDS_PER_SLICE], False))[1:-1]
            yield (", " + strs if start else strs).encode()
            await asyncio.sleep(0)
        yield b"]}"
    while tokens:  # the reply's last reference
        del tokens[-_IDS_FREED_PER_SLICE:]
        await asyncio.sleep(0)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: GatewayContext = Depends(get_context)) -> DetokenizeResponse:
    ctx.check_model(body.model)
    # As vLLM's: the special tokens are text like any other.
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False))
