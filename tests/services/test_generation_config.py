"""--generation-config: the model's generation_config.json as sampling defaults, read as
vLLM reads it, and carried with the tokenizer's files to a cluster's gateways."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.config import ConfigError
from services.generation_config import sampling_defaults
from services.model_source import ModelFormat, ModelSource, resolve_model
from tokenizer_svc.tokenizer import Tokenizer

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300, "do_sample": True,
               "bos_token_id": 1, "repetition_penalty": None}


def test_the_fields_vllm_reads_under_its_names(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    model = ModelSource(ModelFormat.HF_DIR, tmp_path)
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert sampling_defaults(model, "auto") == expected
    assert sampling_defaults(model, "vllm") == {}
    # A directory of its own overrides the model's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert sampling_defaults(model, str(other)) == {"temperature": 0.2}
    with pytest.raises(ConfigError, match="--generation-config /nowhere: no generation_config.json there"):
        sampling_defaults(model, "/nowhere")


def test_a_gguf_file_has_none() -> None:
    assert sampling_defaults(resolve_model("smollm2"), "auto") == {}


def test_the_defaults_travel_with_the_tokenizers_files(tmp_path: Path) -> None:
    tokenizer = Tokenizer.load(resolve_model("smollm2"))
    tokenizer.sampling_defaults = {"temperature": 0.6, "max_tokens": 300}
    tokenizer.save_pretrained(tmp_path)
    assert Tokenizer.from_files(tmp_path, "x").sampling_defaults == {"temperature": 0.6, "max_tokens": 300}
