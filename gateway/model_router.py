"""Several models behind one gateway: a request goes to the app of the model its body's
`model` names.

Each extra model (`kvfleet gateway --extra-model`) has an app of its own (its engine
client over its replicas, its tokenizer, its context length and pooler), built as the
main model's is. This middleware sits inside the main app's drain, body-size and API-key
middlewares, so those apply to every model's requests: a POST whose JSON body names an
extra model's served name is answered by that app, anything else by the main app (which
answers a model nobody serves with its 404 naming it). Only POST bodies are read here,
and only for `model`: msgspec skips every other field without building it.
"""
from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _Named(msgspec.Struct):
    model: str | None = None


class ModelRouter:
    def __init__(self, app: ASGIApp, apps: Mapping[str, ASGIApp]) -> None:
        """`apps`: each extra model's app, by each of its served names."""
        self.app = app
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self.apps:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: the main app sees it so
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        app = self.apps.get(_model(bytes(body)) or "", self.app)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await app(scope, replay, send)


def _model(body: bytes) -> str | None:
    try:
        named = msgspec.json.decode(body, type=_Named)
    except (msgspec.DecodeError, msgspec.ValidationError):  # not ours to judge: the main app answers it
        return None
    return named.model
