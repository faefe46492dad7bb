"""The text side of vLLM's engine protocol on a scheduler, which otherwise speaks token
ids: prompts sent as text, stop strings (matched on incrementally detokenized output,
as kvfleet's gateway matches them) and the tokenizer's files for GetTokenizer.

It uses the tokenizer role's modules as a library, as the gateway does; they need
transformers but no torch, and a GGUF's tokenizer is converted out of the scheduler's
process (tokenizer_svc/tokenizer.py), so the scheduler still never loads torch.
"""
from __future__ import annotations

import threading
from functools import cached_property

import msgspec

from services.config import EngineConfig
from services.invalid_parameter import InvalidParameter
from services.messages import TokenDelta
from services.sampling_params import SamplingParams
from tokenizer_svc.text_output import TextStream
from tokenizer_svc.tokenizer import Tokenizer


class StopStrings:
    """Watches one output for its stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams) -> None:
        self._stream = TextStream(tokenizer, prompt, params)

    def check(self, delta: TokenDelta) -> tuple[TokenDelta, bool]:
        """`delta`, finished by the stop string it completes if it completes one (then a
        copy: the step loop's delta may have other readers), and whether the engine's
        request is still running and must be aborted."""
        text = self._stream.apply(delta)
        if not isinstance(text.stop_reason, str):
            return delta, False
        return msgspec.structs.replace(delta, finish_reason="stop", stop_reason=text.stop_reason), text.hit_stop_string


class EngineText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # Encoding runs on the server's threads; one at a time keeps the Rust tokenizer
        # from seeing concurrent calls (the tokenizer role serializes them too).
        self._encode_lock = threading.Lock()

    @classmethod
    def for_engine(cls, config: EngineConfig) -> EngineText:
        """The tokenizer `config` names (--tokenizer, else the model's own)."""
        return cls(Tokenizer.for_engine(config))

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids, with the special tokens a completion's prompt gets (as vLLM's)."""
        with self._encode_lock:
            token_ids = self._tokenizer.encode(text)
        if not token_ids:
            raise InvalidParameter("text", "the prompt must not be empty")
        return token_ids

    def stop_strings(self, prompt: list[int], params: SamplingParams) -> StopStrings | None:
        return StopStrings(self._tokenizer, prompt, params) if params.stop else None

    @cached_property
    def archive(self) -> bytes:
        """The tokenizer's files, zipped once: they do not change."""
        return self._tokenizer.archive()
