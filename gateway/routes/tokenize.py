"""vLLM's POST /tokenize and /detokenize, for clients that count or inspect tokens."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from gateway.chat_messages import message_dicts
from gateway.context import GatewayContext, get_context
from gateway.errors import bad_request
from gateway.json_body import OffLoopJsonRoute
from gateway.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.tokenizer_api import ChatPrompt

router = APIRouter(route_class=OffLoopJsonRoute)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, ctx: GatewayContext = Depends(get_context)) -> Response:
    ctx.check_model(body.model)
    ctx.check_ready()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt", "give either prompt or messages")
    if body.messages is not None:
        # The chat template writes its own special tokens.
        chat = ChatPrompt(message_dicts(body.messages), body.add_generation_prompt, bool(body.add_special_tokens))
        tokens = (await ctx.encoder.encode_chat(chat)).token_ids
    else:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        [tokens] = await ctx.encoder.encode([body.prompt], add_special_tokens)
    # A long prompt's ids make a large body: written on a worker thread, not the event loop.
    reply = {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}
    return Response(await asyncio.to_thread(json.dumps, reply), media_type="application/json")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: GatewayContext = Depends(get_context)) -> DetokenizeResponse:
    ctx.check_model(body.model)
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))
