"""Which weights run as stored: --quantization gguf is a quantized GGUF file's default on
CPU, as vLLM loads a .gguf model quantized without being asked."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from services.config import EngineConfig
from services.model_source import resolve_model
from worker_svc.formats.model_config import ModelConfig, read_model_config
from worker_svc.runtime.device import runs_q4_as_stored


@pytest.fixture(scope="module")
def smollm2_config() -> ModelConfig:
    return read_model_config(resolve_model("smollm2"))


@pytest.mark.parametrize("quantization, expected", [(None, True), ("gguf", True), ("none", False)])
def test_a_quantized_gguf_file_runs_as_stored_on_cpu_unless_told_none(smollm2_config, quantization, expected):
    assert smollm2_config.quantization == "GGUF Q4_1+Q8_0"
    config = EngineConfig(model="smollm2", quantization=quantization)
    assert runs_q4_as_stored(config, torch.device("cpu"), smollm2_config) is expected


def test_float_weights_have_nothing_to_keep(smollm2_config):
    float_weights = dataclasses.replace(smollm2_config, quantization=None)  # safetensors, or an F32 GGUF file
    assert not runs_q4_as_stored(EngineConfig(model="smollm2"), torch.device("cpu"), float_weights)


def test_a_gpu_dequantizes_and_warns_only_when_gguf_was_asked_for(smollm2_config, caplog):
    with caplog.at_level(logging.WARNING, logger="worker_svc.runtime.device"):
        assert not runs_q4_as_stored(EngineConfig(model="smollm2"), torch.device("cuda"), smollm2_config)
        assert not caplog.records
        assert not runs_q4_as_stored(EngineConfig(model="smollm2", quantization="gguf"), torch.device("cuda"),
                                     smollm2_config)
    assert "run as stored on CPU only" in caplog.text
