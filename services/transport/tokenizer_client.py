"""RemoteTokenizer: the tokenizer role's Tokenize / Detokenize / Describe, called like
the in-process Tokenizer. Rejected input raises InvalidParameter, as in-process."""
from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message

from services.pb.kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.sampling_params import InvalidParameter
from services.transport.channel import open_channel


class TokenizerError(RuntimeError):
    """The tokenizer service could not be reached, or failed the call."""


class RemoteTokenizer:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = open_channel(address)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        request = tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._call(self._stub.Tokenize, request).token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return list(self._tokenize_chat(messages, add_generation_prompt).token_ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._tokenize_chat(messages, add_generation_prompt).prompt

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        request = tokenizer_pb2.DetokenizeRequest(
            token_ids=token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        return self._call(self._stub.Detokenize, request).text

    def describe(self) -> tokenizer_pb2.TokenizerDescription:
        return self._call(self._stub.Describe, tokenizer_pb2.DescribeTokenizerRequest())

    def close(self) -> None:
        self._channel.close()

    def _tokenize_chat(self, messages: list[dict], add_generation_prompt: bool) -> tokenizer_pb2.TokenizeResponse:
        chat = tokenizer_pb2.Chat(
            messages=[tokenizer_pb2.ChatMessage(**m) for m in messages], add_generation_prompt=add_generation_prompt
        )
        return self._call(self._stub.Tokenize, tokenizer_pb2.TokenizeRequest(chat=chat))

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: Message) -> Any:
        try:
            return method(request)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                param, _, message = exc.details().partition(": ")
                raise InvalidParameter(param, message) from exc
            raise TokenizerError(f"tokenizer at {self.address}: {exc.code().name}: {exc.details()}") from exc
