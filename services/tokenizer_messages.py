"""The tokenizer role's messages (services/tokenizer_api.py says what the role does),
each the one definition of its message, in process and on the wire (msgpack;
services/transport/rpc.py)."""
from __future__ import annotations

import msgspec

from services.tokenizer_api import ChatPrompt


class TokenizeRequest(msgspec.Struct, omit_defaults=True):
    """A text or a chat (which says itself whether special tokens are added)."""

    text: str | None = None
    chat: ChatPrompt | None = None
    add_special_tokens: bool = True  # for a text
    # The ids as packed bytes (services/packed_token_ids.py): a long prompt's arrive in a memory copy.
    packed_token_ids: bool = False


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    token_ids: list[int] = []
    prompt: str = ""  # a chat's rendered text; empty for a text
    token_ids_packed: bytes = b""


class TokenizeBatchRequest(msgspec.Struct):
    requests: list[TokenizeRequest]


class TokenizeResult(msgspec.Struct, omit_defaults=True):
    """One request's answer in a batch: its response, or why its input is invalid
    ("param: message"), without failing the rest of the batch."""

    response: TokenizeResponse | None = None
    invalid_argument: str = ""


class TokenizeBatchResponse(msgspec.Struct):
    results: list[TokenizeResult]


class DetokenizeRequest(msgspec.Struct, omit_defaults=True):
    token_ids: list[int]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class DetokenizeResponse(msgspec.Struct):
    text: str


class TokenizerDescription(msgspec.Struct, omit_defaults=True):
    name: str
    vocab_size: int
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    has_chat_template: bool = False


class TokenizerChunk(msgspec.Struct):
    """A slice of the tokenizer's files (services/tokenizer_archive.py)."""

    data: bytes
    sha256: str
