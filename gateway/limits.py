"""Bounds on what one request may ask of the server, so that no single valid-looking
request can stall or flood it: the body's size (refused with 413 before it is read in
full, let alone parsed), the sequences it fans out to (prompts × n or best_of) and the
logprobs it asks for per token (vLLM's --max-logprobs), each past its bound a 400
naming the field."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import bad_request, error_response
from services.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from services.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_logprobs: int = MAX_LOGPROBS  # -1: the whole vocabulary

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(args.max_request_body_bytes, args.max_sequences_per_request, args.max_logprobs)

    def check_fan_out(self, num_prompts: int, per_prompt: int, param: str) -> None:
        count = num_prompts * per_prompt
        if count > self.max_sequences_per_request:
            shape = f"{num_prompts} prompts x {per_prompt}" if num_prompts > 1 else f"{per_prompt}"
            raise bad_request(param, f"this request would run {count} sequences ({shape}); at most "
                                     f"{self.max_sequences_per_request} per request (--max-sequences-per-request)")


    def logprobs(self, count: int | None, param: str, kind: str, vocab_size: int) -> int | None:
        """A request's logprob count as the engine takes it, with vLLM's rules and words:
        -1 asks for the whole vocabulary; more than --max-logprobs is refused. `kind` is
        "sample" or "prompt"."""
        if count is None:
            return None
        if count < -1:
            raise bad_request(param, f"`{param}` must be a positive value or -1.")
        count = vocab_size if count == -1 else count
        bound = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if count > bound:
            raise bad_request(param, f"Requested {kind} logprobs of {count}, which is greater than max allowed: {bound}")
        return count


class BodySizeMiddleware:
    """413 for a body over the limit: at once from its Content-Length (the server never
    delivers more than that), or, for a chunked body, as soon as its bytes pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        # Chunked: read it here, within the limit, and hand it on as it came.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replaying_receive() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replaying_receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is larger than {self.max_bytes} bytes "
                                       "(--max-request-body-bytes)", code="request_too_large")
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)
