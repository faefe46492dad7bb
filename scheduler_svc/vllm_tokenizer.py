"""The tokenizer files a router needs to detokenize what the engine protocol returns
(GetTokenizer), found from the scheduler's engine config, zipped as the protocol (and
the tokenizer role's own GetTokenizer) ships them: services/tokenizer_archive.py.

A GGUF model keeps its tokenizer inside the weights file: turning that into
tokenizer.json is the tokenizer role's work (it needs transformers), so a GGUF
replica sends routers there rather than loading a tokenizer into the scheduler.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from services.config import EngineConfig
from services.model_source import ModelFormat, resolve_tokenizer
from services.tokenizer_archive import pack

# What a HF tokenizer is made of (transformers' file names); weights and the rest stay out.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "config.json",
)


class NoTokenizerFiles(Exception):
    """The model's tokenizer is not a set of files this process can send."""


def tokenizer_archive(config: EngineConfig) -> bytes:
    """The zip of the tokenizer's files (config.tokenizer's, else the model's)."""
    name = config.tokenizer or config.model
    revision = config.tokenizer_revision if config.tokenizer else config.revision
    try:
        source = resolve_tokenizer(name, revision)
    except ValueError as exc:  # ModelNotFoundError: a ConfigError
        raise NoTokenizerFiles(str(exc)) from exc
    if source.format is ModelFormat.GGUF:
        raise NoTokenizerFiles(
            f"the tokenizer of {name!r} is inside its GGUF file; the tokenizer role's GetTokenizer "
            "(kvfleet.v1.Tokenizer) serves it as files")
    with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-") as directory:
        for file_name in TOKENIZER_FILES:
            if (source.path / file_name).is_file():
                shutil.copyfile(source.path / file_name, Path(directory) / file_name)
        return pack(Path(directory))
