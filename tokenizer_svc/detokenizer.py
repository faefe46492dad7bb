"""Streaming detokenization with vLLM's prefix_offset / read_offset algorithm.

Byte-level tokenizers split one character over several tokens, and some decoders
change a token's text depending on its neighbours (leading spaces), so a token
cannot be decoded alone. Each step decodes a short window that starts a few tokens
before the text not yet emitted: tokens[prefix_offset:read_offset] is text already
emitted, kept as context, and whatever the window adds past it is the new delta.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizer_svc.tokenizer import Tokenizer

# How many prompt tokens give the first output token its context (vLLM's value).
INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        # Two extra ids in case some of them are special tokens that get skipped.
        self._tokens = tokenizer.convert_ids_to_tokens(
            prompt_token_ids[-INITIAL_OFFSET - 2:], skip_special_tokens
        )
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        # Joined on demand so that step() never copies the text generated so far.
        return "".join(self._deltas)

    def step(self, new_token_ids: Sequence[int]) -> str:
        new_tokens = self._tokenizer.convert_ids_to_tokens(new_token_ids, self._skip_special_tokens)
        # One token at a time, as vLLM does, so a batch emits the same text at the
        # same token boundaries as single steps would.
        delta = "".join(self._append(token) for token in new_tokens)
        if delta:
            self._deltas.append(delta)
        return delta

    def _append(self, token: str) -> str:
        self._tokens.append(token)
        to_string = self._tokenizer.convert_tokens_to_string
        window = self._tokens[self._prefix_offset:]
        prefix_text = to_string(window[: self._read_offset - self._prefix_offset], self._spaces_between_special_tokens)
        new_text = to_string(window, self._spaces_between_special_tokens)
        # A trailing U+FFFD means the window ends inside a multi-byte character: wait
        # for the tokens that complete it rather than emit a replacement character.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):]
