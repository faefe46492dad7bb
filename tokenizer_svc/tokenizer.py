"""The tokenizer: encode, decode and chat templates for a ModelSource.

It runs on transformers' fast tokenizer, loaded from `tokenizer.json` files, which
needs no torch: the tokenizer and gateway processes never load it. A model without
such files (a GGUF file carries its tokenizer in its metadata; old checkpoints have
a sentencepiece model) is converted once, in a child process
(`python -m tokenizer_svc.convert`, since transformers' converters load torch), and
the result is saved under the kvfleet cache, so later loads read the saved files.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.config import EngineConfig
from services.file_cache import derived_path
from services.generation_config import sampling_defaults
from services.model_source import ModelFormat, ModelSource, resolve_model, resolve_tokenizer
from services.prompt import bad_word_spellings, bad_words_token_ids
from services.tokenizer_archive import pack
from tokenizer_svc.encode_process import HUGE_TEXT_CHARS, EncodeProcess

logger = logging.getLogger(__name__)

# Saved beside the tokenizer's files, so a cluster's gateways get them with the files.
SAMPLING_DEFAULTS_FILE = "kvfleet_sampling_defaults.json"


def _json_ready(value: Any) -> Any:
    """Special tokens (AddedToken) as their text, through dicts and lists, as vLLM shows them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return value


class NoChatTemplateError(ValueError):
    """Chat was asked of a model whose tokenizer has no chat template."""


def converted_cache_dir(source: Path) -> Path:
    # transformers converts, so a new release converts again.
    return derived_path("tokenizers", source, f"transformers={transformers.__version__}")


def _fast_tokenizer_dir(source: ModelSource) -> Path:
    """A directory with the model's tokenizer.json: its own, or a cached conversion."""
    if source.format is ModelFormat.HF_DIR and (source.path / "tokenizer.json").is_file():
        return source.path
    cached = converted_cache_dir(source.path)
    if cached.is_dir():
        return cached
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Converted next to the final place and renamed: several roles may start at once,
        # and none may read a half-written directory. The loser of the race drops its copy.
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
    except OSError as exc:  # a read-only home must not stop serving, only slow the next start
        logger.warning("could not cache the tokenizer in %s: %s", cached, exc)
        staging = cached = Path(tempfile.mkdtemp(prefix="kvfleet-tokenizer-"))
    _convert(source, staging)
    if staging != cached:
        try:
            staging.rename(cached)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return cached


def _convert(source: ModelSource, destination: Path) -> None:
    started = time.perf_counter()
    argv = [sys.executable, "-m", "tokenizer_svc.convert", source.format.value, str(source.path), str(destination)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"could not load the tokenizer of {source.path}: {done.stderr.strip().splitlines()[-1:]}")
    logger.info("converted the tokenizer of %s in %.1f s", source.path.name, time.perf_counter() - started)


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, name: str, sampling_defaults: dict[str, Any] | None = None) -> None:
        # A prompt is its tokens, no more, no fewer: a tokenizer.json may pad and truncate
        # (sentence-transformers' do, to 128); the engine checks lengths itself.
        hf.backend_tokenizer.no_padding()
        hf.backend_tokenizer.no_truncation()
        self._hf = hf
        self.name = name
        # SamplingParams fields that requests leaving them unset get (services/generation_config.py).
        self.sampling_defaults = sampling_defaults or {}
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
        self._encode_process = EncodeProcess(hf.backend_tokenizer)

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        return cls.from_files(_fast_tokenizer_dir(source), source.name)

    @classmethod
    def for_engine(cls, config: EngineConfig, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer `config` names (--tokenizer, else the model's), with --chat-template
        in place of its own and the sampling defaults --generation-config gives."""
        model = resolve_model(config.model, config.revision, require_tokenizer=config.tokenizer is None)
        tokenizer = cls.load(resolve_tokenizer(config.tokenizer, config.tokenizer_revision) if config.tokenizer else model)
        if chat_template is not None:
            tokenizer._hf.chat_template = chat_template
        tokenizer.sampling_defaults = sampling_defaults(model, config.generation_config)
        if tokenizer.sampling_defaults:
            logger.info("sampling defaults from the model's generation config: %s (--generation-config vllm: none)",
                        tokenizer.sampling_defaults)
        return tokenizer

    @classmethod
    def from_files(cls, directory: Path, name: str) -> Tokenizer:
        """From a directory holding tokenizer.json (and its config and chat template)."""
        defaults_file = directory / SAMPLING_DEFAULTS_FILE
        defaults = json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}
        return cls(PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True), name, defaults)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        return bad_words_token_ids([self.encode(s, add_special_tokens=False) for s in bad_word_spellings(words)])

    def info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (tokenizer_config.json's),
        its special tokens as their text, less file paths; its class; and the chat
        template it renders with (--chat-template's where given). The name is the
        model's: the files' directory differs between a server and its cluster's gateways."""
        info = {key: _json_ready(value) for key, value in self._hf.init_kwargs.items()
                if key not in ("vocab_file", "merges_file")}
        info["name_or_path"] = self.name
        info["tokenizer_class"] = type(self._hf).__name__
        if self._hf.chat_template is not None:
            info["chat_template"] = self._hf.chat_template
        return info

    @property
    def has_chat_template(self) -> bool:
        return self._hf.chat_template is not None

    def save_pretrained(self, directory: Path) -> None:
        """Write HF tokenizer files (and the sampling defaults), e.g. to make a model directory complete."""
        self._hf.save_pretrained(directory)
        if self.sampling_defaults:
            (directory / SAMPLING_DEFAULTS_FILE).write_text(json.dumps(self.sampling_defaults))

    def archive(self) -> bytes:
        """Its files zipped (services/tokenizer_archive.py), as GetTokenizer ships them: a
        GGUF's tokenizer too, which lives inside the weights file."""
        with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-") as directory:
            self.save_pretrained(Path(directory))
            return pack(Path(directory))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The Rust tokenizer itself, in its batch form: it lets go of the GIL while it
        # works (its one-text form does not), so a megabyte prompt never stalls the
        # threads beside it; and transformers' wrapper adds ~20% of Python around it.
        # Its post-processor adds the special tokens, as transformers' encode() does.
        if len(text) > HUGE_TEXT_CHARS:
            return self._encode_process.encode(text, add_special_tokens)
        [encoding] = self._hf.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

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
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """`continue_final_message`: the rendering ends inside the last message, for the
        model to go on with it; a ValueError if the template does not show that message."""
        if not self.has_chat_template:
            raise NoChatTemplateError(f"model {self.name!r} has no chat template; use a completion request")
        return self._hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
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
