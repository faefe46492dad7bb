"""What the gateway asks of the tokenizer role: its text work, wherever it runs.

Embedded mode answers in-process (tokenizer_svc.in_process); in a cluster the gateway
calls the tokenizer role over gRPC, batching the requests that arrive together
(gateway.cluster.tokenizer_client). Either way the work never runs on the gateway's event
loop, and the gateway detokenizes locally with `decoder`: the tokenizer role's own
files, fetched at start-up in a cluster, so a gateway needs no model files.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec


class ChatPrompt(msgspec.Struct, frozen=True, omit_defaults=True):
    """A chat to render with the model's template, in process and on the wire alike:
    the template sees the same messages in every mode."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    # The chat template writes the special tokens it wants: none are added by default.
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool definitions, rendered by the template
    # The last message left open (no end of turn), for the model to continue it.
    continue_final_message: bool = False


class EncodedPrompt(msgspec.Struct, frozen=True):
    text: str  # what was encoded: the text itself, or the rendered chat
    token_ids: list[int] = []


class PromptEncoder(Protocol):
    def is_ready(self) -> bool:
        """It can encode now (the gateway's /health)."""

    def is_started(self) -> bool:
        """It takes requests: while it is not ready, they wait for it, a bounded while."""

    @property
    def decoder(self) -> Any:
        """The tokenizer_svc Tokenizer the gateway detokenizes with; only once ready."""

    async def encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]: ...

    async def encode_chat(self, chat: ChatPrompt) -> EncodedPrompt:
        """Raises InvalidParameter("messages", ...) when the model has no chat template."""
