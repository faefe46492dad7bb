"""The sampling defaults a model's creator recommends, from its generation_config.json,
applied as vLLM's `--generation-config` does: to every request that leaves the field
unset, in the SDK and the OpenAI server alike."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.config import GENERATION_CONFIGS, ConfigError
from services.model_source import ModelFormat, ModelSource

FILE_NAME = "generation_config.json"
# generation_config.json's name -> SamplingParams' (vLLM's list).
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model: ModelSource, setting: str) -> dict[str, Any]:
    """SamplingParams fields: {} for "vllm", and for a GGUF file under "auto" (it has no generation config)."""
    if setting == "vllm" or (setting == "auto" and model.format is ModelFormat.GGUF):
        return {}
    path = (model.path if setting == "auto" else Path(setting).expanduser()) / FILE_NAME
    if setting not in GENERATION_CONFIGS and not path.is_file():
        raise ConfigError(f"--generation-config {setting}: no {FILE_NAME} there (or use auto, or vllm)")
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
