"""Serves a Tokenizer over gRPC: the tokenizer role's process."""
from __future__ import annotations

import threading

import grpc

from services.pb.kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.transport.grpc_server import RoleServer
from tokenizer_svc.tokenizer import NoChatTemplateError, Tokenizer

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def _message_dict(message: tokenizer_pb2.ChatMessage) -> dict[str, str]:
    entry = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        entry["name"] = message.name
    return entry


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer resets its truncation state on every call, and concurrent
        # calls then fail with "Already borrowed": one call at a time.
        self._lock = threading.Lock()

    def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input: set text or chat")
        # As in Tokenizer: text gets the special tokens; a chat template writes its own.
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else kind == "text"
        if kind == "text":
            prompt = request.text
        else:
            prompt = self._render(request.chat, context)
        with self._lock:
            token_ids = self._tokenizer.encode(prompt, add_special_tokens=add_special)
        return tokenizer_pb2.TokenizeResponse(token_ids=token_ids, prompt=prompt)

    def _render(self, chat: tokenizer_pb2.Chat, context: grpc.ServicerContext) -> str:
        if not chat.messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "messages: must not be empty")
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            with self._lock:
                return self._tokenizer.render_chat([_message_dict(m) for m in chat.messages], add_generation_prompt)
        except NoChatTemplateError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages: {exc}")

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
