"""The tokenizer role's gRPC service: tokenize text and chats (one at a time or in
batches), detokenize, describe, and hand out the tokenizer's files (GetTokenizer)."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from services.packed_token_ids import pack_token_ids
from services.pb.kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.sampling_params import InvalidParameter
from services.tokenizer_api import EncodedPrompt
from services.tokenizer_archive import chunks
from services.transport.convert import chat_from_proto
from services.transport.server import RoleServer
from tokenizer_svc.in_process import encode_chat
from tokenizer_svc.tokenizer import Tokenizer

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def _response(request: tokenizer_pb2.TokenizeRequest, encoded: EncodedPrompt) -> tokenizer_pb2.TokenizeResponse:
    response = tokenizer_pb2.TokenizeResponse(prompt=encoded.text if request.HasField("chat") else "")
    if request.packed_token_ids:
        response.token_ids_packed = pack_token_ids(encoded.token_ids)
    else:
        response.token_ids.extend(encoded.token_ids)
    return response


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer resets its truncation state on every call, and concurrent
        # calls then fail with "Already borrowed": one call at a time.
        self._lock = threading.Lock()
        self._archive = tokenizer.archive()

    def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        try:
            encoded = self._encode(request)
        except InvalidParameter as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return _response(request, encoded)

    def TokenizeBatch(
        self, request: tokenizer_pb2.TokenizeBatchRequest, context: grpc.ServicerContext
    ) -> tokenizer_pb2.TokenizeBatchResponse:
        results = []
        for item in request.requests:
            try:
                encoded = self._encode(item)
            except InvalidParameter as exc:  # this input's error; the others are answered
                results.append(tokenizer_pb2.TokenizeResult(invalid_argument=str(exc)))
                continue
            results.append(tokenizer_pb2.TokenizeResult(response=_response(item, encoded)))
        return tokenizer_pb2.TokenizeBatchResponse(results=results)

    def _encode(self, request: tokenizer_pb2.TokenizeRequest) -> EncodedPrompt:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidParameter("input", "set text or chat")
        if kind == "chat":
            chat = chat_from_proto(
                request.chat, request.add_special_tokens if request.HasField("add_special_tokens") else False)
            with self._lock:
                return encode_chat(self._tokenizer, chat)
        # Text gets the special tokens unless told otherwise; a chat template writes its own.
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        with self._lock:
            return EncodedPrompt(request.text, self._tokenizer.encode(request.text, add_special_tokens=add_special))

    def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        with self._lock:
            text = self._tokenizer.decode(
                list(request.token_ids),
                skip_special_tokens=not request.HasField("skip_special_tokens") or request.skip_special_tokens,
                spaces_between_special_tokens=(
                    not request.HasField("spaces_between_special_tokens") or request.spaces_between_special_tokens
                ),
            )
        return tokenizer_pb2.DetokenizeResponse(text=text)

    def Describe(
        self, request: tokenizer_pb2.DescribeTokenizerRequest, context: grpc.ServicerContext
    ) -> tokenizer_pb2.TokenizerDescription:
        tokenizer = self._tokenizer
        return tokenizer_pb2.TokenizerDescription(
            name=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            has_chat_template=tokenizer.has_chat_template,
        )

    def GetTokenizer(
        self, request: tokenizer_pb2.GetTokenizerRequest, context: grpc.ServicerContext
    ) -> Iterator[tokenizer_pb2.GetTokenizerChunk]:
        for data, sha256 in chunks(self._archive):
            yield tokenizer_pb2.GetTokenizerChunk(data=data, sha256=sha256)


def start_tokenizer_server(tokenizer: Tokenizer, address: str) -> RoleServer:
    """Serves `tokenizer` on `address` ("host:port"; port 0 picks a free one)."""
    server = RoleServer(
        address,
        SERVICE_NAME,
        lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(tokenizer), s),
        max_workers=8,
    )
    server.start()
    return server
