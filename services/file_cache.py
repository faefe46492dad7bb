"""kvfleet's cache of files derived from a model's (a converted tokenizer, dequantized
weights), under $KVFLEET_CACHE_DIR (default ~/.cache/kvfleet). Each entry is keyed by
its source file's path, size and mtime and by the versions of what derived it, so a
changed source or a new converter derives it again instead of trusting an old result."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE_DIR", "~/.cache/kvfleet")).expanduser()


def derived_path(kind: str, source: Path, *derivation: str) -> Path:
    """Where what `derivation` (e.g. "transformers=5.1") makes of `source` is cached."""
    stat = source.stat()
    key = "|".join((str(source.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *derivation))
    return cache_root() / kind / hashlib.sha256(key.encode()).hexdigest()
