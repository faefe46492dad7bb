"""What a sentence-transformers model directory says of its pooling: modules.json lists
its modules (Transformer, Pooling, Normalize), the Pooling module's config.json its mode,
sentence_bert_config.json the longest input it was trained on. vLLM reads the same files."""
from __future__ import annotations

from pathlib import Path

from services.config import ConfigError
from worker_svc.formats.model_config import read_json

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


def pooling_defaults(directory: Path) -> dict:
    """The PoolerConfig fields the directory sets ({} when it is no sentence-transformers model)."""
    modules = read_json(directory / "modules.json")
    if not isinstance(modules, list):
        return {}
    settings: dict = {"normalize": any(m.get("type") == _NORMALIZE_MODULE for m in modules)}
    for module in modules:
        if module.get("type") != _POOLING_MODULE:
            continue
        config = read_json(directory / module.get("path", "") / "config.json")
        modes = [name for key, name in _MODES.items() if config.get(key)]
        others = [key for key, value in config.items() if key.startswith("pooling_mode") and value and key not in _MODES]
        if others or len(modes) != 1:
            raise ConfigError(f"{directory}: sentence-transformers pooling {others or modes} is not supported; "
                              f"kvfleet pools one of {', '.join(_MODES.values())}")
        settings["pooling_type"] = modes[0]
    return settings


def max_seq_length(directory: Path) -> int | None:
    """The longest input the model was trained on, when its sentence_bert_config.json says."""
    return read_json(directory / "sentence_bert_config.json").get("max_seq_length")
