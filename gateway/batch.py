"""One line of an OpenAI Batch file, answered by the gateway's own app, in vLLM's
run-batch output shape (`kvfleet run-batch`; kvfleet/run_batch.py reads and writes the
files).

A line is `{"custom_id", "method", "url", "body"}`; its body goes through the same ASGI
app, routes, validation and error handlers as a REST request, in process, so a line and a
request get the same answer. The answer is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`: on success the body is the response and `error` null; an
error the app answered has `body` null and the app's error object in `error`, with its
status; a line the runner turns away before the app (an unsupported URL or method, a
streamed request) has status 400 and its reason as a string, as vLLM's runner does. A
line that is not a batch line at all (not JSON, no custom_id, ...) has no request to
answer: `response` is null and `error` says which line and why.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message

# What the runner answers, by URL; the rest are refused by name.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
_STREAM = TypeAdapter(bool)  # read as the request models read `stream` (so "True" is true)


class BatchRequestInput(BaseModel):
    """The envelope of one line; its body is checked by the endpoint, as a REST body is."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchAnswer:
    line: str  # the output line, JSON without its newline
    ok: bool  # the request succeeded
    malformed: bool = False  # not a batch line at all


def _output(custom_id: str | None, response: dict[str, Any] | None, error: Any) -> str:
    record = {"id": f"kvfleet-{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(record, ensure_ascii=False)


def _response(status: int, body: Any = None) -> dict[str, Any]:
    return {"status_code": status, "request_id": f"kvfleet-batch-{uuid.uuid4().hex}", "body": body}


def _malformed(number: int, raw: Any, reason: str) -> BatchAnswer:
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    return BatchAnswer(_output(custom_id if isinstance(custom_id, str) else None, None, f"line {number}: {reason}"),
                       ok=False, malformed=True)


def _refused(request: BatchRequestInput, reason: str) -> BatchAnswer:
    return BatchAnswer(_output(request.custom_id, _response(400), reason), ok=False)


async def answer_line(app: ASGIApp, number: int, text: str, headers: Mapping[str, str] | None = None) -> BatchAnswer:
    """Line `number` (1-based, for error messages) of the input, answered. `headers` go
    with the request (the API key, when the app asks for one). Whatever the line holds,
    this answers it rather than raise."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        return _malformed(number, None, f"not JSON: {exc}")
    try:
        request = BatchRequestInput.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return _malformed(number, raw, f"{where}: {first['msg']}" if where else first["msg"])
    if request.method.upper() != "POST":
        return _refused(request, f"method {request.method}: only POST is supported")
    if request.url not in ENDPOINTS:
        return _refused(request, f"URL {request.url} was used. Supported endpoints: {', '.join(ENDPOINTS)}")
    try:
        streamed = _STREAM.validate_python(request.body.get("stream", False))
    except ValidationError:
        streamed = False  # the endpoint names the bad value
    if streamed:  # vLLM's words: a batch line is answered whole
        return _refused(request, "Request must not be sent in stream mode")
    try:
        status, body = await post(app, request.url, json.dumps(request.body).encode(), headers or {})
    except Exception as exc:  # a bug: this line fails, the others go on
        return BatchAnswer(_output(request.custom_id, _response(500), f"internal error: {exc!r}"), ok=False)
    if status == 200:
        return BatchAnswer(_output(request.custom_id, _response(status, body), None), ok=True)
    return BatchAnswer(_output(request.custom_id, _response(status), body), ok=False)


async def post(app: ASGIApp, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, Any]:
    """POSTs a JSON body to `app` in process, as an HTTP server would hand it over;
    returns the status and the JSON answer."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "client": None,
        "server": None, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
    }
    answered = asyncio.Event()
    delivered = False
    status, chunks = 500, []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The client stays until the answer is out, as a waiting HTTP client does.
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    except Exception:
        # Starlette answers a bug with a 500 and then re-raises it, for a server to log
        # (the gateway's handler logged it already): the answer stands.
        if not answered.is_set():
            raise
    finally:
        answered.set()
    return status, json.loads(b"".join(chunks))
