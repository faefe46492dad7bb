"""API-key check for the OpenAI routes (`/v1/...`), as vLLM's `--api-key` does.

A plain ASGI middleware rather than a route dependency, so that every /v1 path,
unknown ones included, answers 401 without the key, and streaming responses pass
through untouched. Under --root-path the prefixed paths (`/llm/v1/...`) are guarded
alike. /invocations, which runs the same completions and chats, is guarded too (vLLM
leaves it open: its issue #58144). /health, /metrics and the rest stay open for probes
and scrapers. The scheme is matched case-insensitively (RFC 7235, as vLLM does), and
the key by the SHA-256 digests of both sides, so the comparison's time tells nothing,
not even the length.
"""
from __future__ import annotations

import hashlib
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_response
from gateway.root_path import route_path

_GUARDED = ("/v1", "/invocations")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = hashlib.sha256(api_key.encode()).digest()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        given = hashlib.sha256(key.strip()).digest()
        return secrets.compare_digest(given, self._expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and route_path(scope).startswith(_GUARDED):
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                response = error_response(401, "invalid or missing API key", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
