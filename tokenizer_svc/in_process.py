"""The PromptEncoder of embedded mode: the Tokenizer in this process, on one thread of
its own, so long prompts never stall the server's event loop. One thread, because a
fast tokenizer must not be entered by two calls at once ("Already borrowed")."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from jinja2 import TemplateError

from services.invalid_parameter import InvalidParameter
from services.tokenizer_api import ChatPrompt, EncodedPrompt
from tokenizer_svc.tokenizer import NoChatTemplateError, Tokenizer

T = TypeVar("T")


class InProcessEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-tokenize")

    def is_ready(self) -> bool:
        return True

    def is_started(self) -> bool:
        return True

    @property
    def decoder(self) -> Tokenizer:
        return self._tokenizer

    async def encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return await self._run(lambda: [self._tokenizer.encode(t, add_special_tokens) for t in texts])

    async def encode_chat(self, chat: ChatPrompt) -> EncodedPrompt:
        return await self._run(lambda: encode_chat(self._tokenizer, chat))

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)


def encode_chat(tokenizer: Tokenizer, chat: ChatPrompt) -> EncodedPrompt:
    """The chat rendered by the model's template, and its token ids: one definition for
    the embedded gateway and the tokenizer role's server."""
    try:
        text = tokenizer.render_chat(chat.messages, chat.add_generation_prompt, chat.tools,
                                     continue_final_message=chat.continue_final_message)
    except NoChatTemplateError as exc:
        raise InvalidParameter("messages", str(exc)) from exc
    except (ValueError, TemplateError) as exc:  # the template refused these messages (as vLLM, a 400)
        raise InvalidParameter("messages", f"the chat template cannot render these messages: {exc}") from exc
    return EncodedPrompt(text, tokenizer.encode(text, add_special_tokens=chat.add_special_tokens))
