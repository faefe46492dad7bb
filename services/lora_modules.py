"""vLLM's `--lora-modules`: adapters a server loads at start, each `name=path` or the JSON
form `{"name": ..., "path": ..., "base_model_name": ...}`."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules value; ValueError (argparse shows it) naming what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not JSON: {exc}") from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"{text!r}: the JSON form needs string fields \"name\" and \"path\"")
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"{text!r}: unknown fields {sorted(unknown)}")
        return LoRAModulePath(raw["name"], raw["path"], raw.get("base_model_name"))
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"{text!r}: give name=path or the JSON form")
    return LoRAModulePath(name, path)
