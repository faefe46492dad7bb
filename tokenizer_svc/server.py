"""The tokenizer role's gRPC service: tokenize text and chats (one at a time or in
batches), detokenize, describe, and hand out the tokenizer's files (GetTokenizer)."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from services.invalid_parameter import InvalidParameter
from services.messages import Empty
from services.packed_token_ids import pack_token_ids
from services.tokenizer_api import EncodedPrompt
from services.tokenizer_archive import chunks
from services.tokenizer_messages import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeBatchRequest,
    TokenizeBatchResponse,
    TokenizerChunk,
    TokenizerDescription,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeResult,
)
from services.transport.role_services import TOKENIZER
from services.transport.server import RoleServer
from tokenizer_svc.in_process import encode_chat
from tokenizer_svc.tokenizer import Tokenizer

SERVICE_NAME = TOKENIZER.name


def _response(request: TokenizeRequest, encoded: EncodedPrompt) -> TokenizeResponse:
    prompt = encoded.text if request.chat is not None else ""
    if request.packed_token_ids:
        return TokenizeResponse(prompt=prompt, token_ids_packed=pack_token_ids(encoded.token_ids))
    return TokenizeResponse(encoded.token_ids, prompt)


class TokenizerServicer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer resets its truncation state on every call, and concurrent
        # calls then fail with "Already borrowed": one call at a time.
        self._lock = threading.Lock()
        self._archive = tokenizer.archive()

    def Tokenize(self, request: TokenizeRequest, context: grpc.ServicerContext) -> TokenizeResponse:
        try:
            encoded = self._encode(request)
        except InvalidParameter as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return _response(request, encoded)

    def TokenizeBatch(self, request: TokenizeBatchRequest, context: grpc.ServicerContext) -> TokenizeBatchResponse:
        results = []
        for item in request.requests:
            try:
                encoded = self._encode(item)
            except InvalidParameter as exc:  # this input's error; the others are answered
                results.append(TokenizeResult(invalid_argument=str(exc)))
                continue
            results.append(TokenizeResult(_response(item, encoded)))
        return TokenizeBatchResponse(results)

    def _encode(self, request: TokenizeRequest) -> EncodedPrompt:
        if (request.text is None) == (request.chat is None):
            raise InvalidParameter("input", "set text or chat")
        if request.chat is not None:
            if not request.chat.messages:
                raise InvalidParameter("messages", "must not be empty")
            with self._lock:
                return encode_chat(self._tokenizer, request.chat)
        with self._lock:
            return EncodedPrompt(request.text,
                                 self._tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))

    def Detokenize(self, request: DetokenizeRequest, context: grpc.ServicerContext) -> DetokenizeResponse:
        with self._lock:
            text = self._tokenizer.decode(request.token_ids, skip_special_tokens=request.skip_special_tokens,
                                          spaces_between_special_tokens=request.spaces_between_special_tokens)
        return DetokenizeResponse(text)

    def Describe(self, request: Empty, context: grpc.ServicerContext) -> TokenizerDescription:
        tokenizer = self._tokenizer
        return TokenizerDescription(tokenizer.name, tokenizer.vocab_size, tokenizer.eos_token_id,
                                    tokenizer.bos_token_id, tokenizer.has_chat_template)

    def GetTokenizer(self, request: Empty, context: grpc.ServicerContext) -> Iterator[TokenizerChunk]:
        for data, sha256 in chunks(self._archive):
            yield TokenizerChunk(data, sha256)


def start_tokenizer_server(tokenizer: Tokenizer, address: str) -> RoleServer:
    """Serves `tokenizer` on `address` ("host:port"; port 0 picks a free one)."""
    server = RoleServer(
        address,
        SERVICE_NAME,
        lambda s: s.add_generic_rpc_handlers([TOKENIZER.handler(TokenizerServicer(tokenizer))]),
        max_workers=8,
    )
    server.start()
    return server
