"""Amazon SageMaker's two routes, as vLLM serves them: GET/POST /ping answers as /health
does, and POST /invocations runs the request its body is: a chat completion when it
validates as one, else a completion, answered as /v1/chat/completions or
/v1/completions would (streams included)."""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from gateway.context import GatewayContext, get_context
from gateway.errors import bad_request
from gateway.json_body import OffLoopJsonRoute
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routes import chat, completions, system

router = APIRouter(route_class=OffLoopJsonRoute)

# In vLLM's order: a body with `messages` is a chat even if it has a `prompt` too.
_INVOCATIONS = ((ChatCompletionRequest, chat.create_chat_completion, "messages"),
                (CompletionRequest, completions.create_completion, "prompt"))


@router.get("/ping")
@router.post("/ping")  # two routes, not one of two methods: each gets its own OpenAPI operation id
async def ping(ctx: GatewayContext = Depends(get_context)) -> Response:
    return await system.health(ctx)


@router.post("/invocations")
async def invocations(request: Request, ctx: GatewayContext = Depends(get_context)) -> Response:
    try:
        body: Any = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(None, f"JSON decode error: {exc}") from None
    failures: list[tuple[str, ValidationError]] = []
    for model, endpoint, key in _INVOCATIONS:
        try:
            parsed: BaseModel = model.model_validate(body)
        except ValidationError as exc:
            failures.append((key, exc))
            continue
        return await endpoint(parsed, request, ctx)
    # vLLM answers only the message below; a body that shows which request it meant
    # gets that route's own 400 instead, naming the field at fault.
    for key, exc in failures:
        if isinstance(body, dict) and key in body:
            raise RequestValidationError(exc.errors())
    names = [model.__name__ for model, _, _ in _INVOCATIONS]
    raise bad_request(None, f"Cannot find suitable handler for request. Expected one of: {names}")
