"""The tokenizer every role uses: encode, decode and chat templates for a ModelSource.

A GGUF file carries its tokenizer and chat template in its metadata; transformers
converts that into a fast tokenizer. The conversion is slow (seconds), so the result
is saved once under the kvfleet cache and later loads read the saved files.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.model_source import ModelFormat, ModelSource

logger = logging.getLogger(__name__)


class NoChatTemplateError(ValueError):
    """Chat was asked of a model whose tokenizer has no chat template."""


def cache_root() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE_DIR", "~/.cache/kvfleet")).expanduser()


def gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    # The converted tokenizer depends on the file and on the converter, so a new
    # transformers release converts again instead of trusting an old result.
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|transformers={transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()


def _load_gguf(gguf: Path) -> PreTrainedTokenizerBase:
    cached = gguf_cache_dir(gguf)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    started = time.perf_counter()
    hf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    logger.info("converted the tokenizer of %s in %.1f s", gguf.name, time.perf_counter() - started)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Save next to the final place and rename: several roles may start at once,
        # and none may read a half-written directory. The loser of the race drops its copy.
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
        hf.save_pretrained(staging)
        try:
            staging.rename(cached)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:  # a read-only home must not stop serving, only slow the next start
        logger.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return hf


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, name: str) -> None:
        self._hf = hf
        self.name = name
        self.vocab_size: int = len(hf)
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        added = hf.added_tokens_decoder
        # The tokenizers library skips every added token flagged special, while
        # transformers' all_special_ids lists only the named ones (bos, eos, ...):
        # for SmolLM2 "<repo_name>" is in the first set only. Use the first so the
        # incremental detokenizer and decode() drop the same tokens.
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_tokens = frozenset(t.content for t in added.values())

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        if source.format is ModelFormat.GGUF:
            hf = _load_gguf(source.path)
        else:
            hf = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
        return cls(hf, source.name)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word as token ids, alone and after a space (mid-sentence spelling), as vLLM bans them."""
        sequences: list[list[int]] = []
        for word in words:
            for spelling in (word, " " + word.lstrip()):
                ids = self.encode(spelling, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    @property
    def has_chat_template(self) -> bool:
        return self._hf.chat_template is not None

    def save_pretrained(self, directory: Path) -> None:
        """Write HF tokenizer files, e.g. to make a model directory complete."""
        self._hf.save_pretrained(directory)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        # Built from the same two steps as the incremental detokenizer, so streamed
        # text and decoded text cannot drift apart.
        tokens = self.convert_ids_to_tokens(token_ids, skip_special_tokens)
        return self.convert_tokens_to_string(tokens, spaces_between_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int], skip_special_tokens: bool) -> list[str]:
        if skip_special_tokens:
            token_ids = [i for i in token_ids if i not in self._special_ids]
        # Models often have more embedding rows than the tokenizer has tokens; an id
        # past the vocabulary decodes to nothing, as in vLLM, instead of failing.
        return [t or "" for t in self._hf.convert_ids_to_tokens(list(token_ids))]

    def convert_tokens_to_string(self, tokens: Sequence[str], spaces_between_special_tokens: bool = True) -> str:
        if spaces_between_special_tokens:
            return self._hf.convert_tokens_to_string(list(tokens))
        # Decoding the runs between added tokens separately keeps the decoder (e.g.
        # WordPiece, Metaspace) from putting spaces around the added tokens.
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_tokens:
                if run:
                    pieces.append(self._hf.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self._hf.convert_tokens_to_string(run))
        return "".join(pieces)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        if not self.has_chat_template:
            raise NoChatTemplateError(f"model {self.name!r} has no chat template; use a completion request")
        return self._hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        # The template already writes the special tokens it wants, so encoding must
        # not add a BOS of its own (vLLM's chat does the same).
        prompt = self.render_chat(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(prompt, add_special_tokens=False)
