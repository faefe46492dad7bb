"""What is checked of a worker's configuration before anything loads: the model's files
and metadata against the flags, and whether the machine has the device asked for.
Each failure is a ConfigError naming the setting and what to do, raised in
milliseconds (no torch import), where loading first would fail a minute later.
worker_svc/runtime/device.py checks the rest, once torch is loaded: that its build can use it."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from services.config import ConfigError, EngineConfig
from services.generation_config import sampling_defaults
from services.lora_modules import LoRAModulePath
from services.model_source import ModelFormat, ModelSource, resolve_model, resolve_tokenizer
from worker_svc.formats.eagle_head import read_eagle_head
from worker_svc.formats.model_config import ModelConfig, read_model_config
from worker_svc.formats.peft_adapter import LoraAdapterError, check_peft_adapter
from worker_svc.formats.sentence_transformers import max_seq_length
from worker_svc.group.shard import Shard

# vLLM's variable, so its launch scripts carry over.
ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class CheckedModel:
    source: ModelSource
    config: ModelConfig
    max_model_len: int


def check_model(config: EngineConfig) -> CheckedModel:
    source = resolve_model(config.model, config.revision, require_tokenizer=config.tokenizer is None)
    model_config = read_model_config(source)
    if config.tokenizer is not None:
        resolve_tokenizer(config.tokenizer, config.tokenizer_revision)
    sampling_defaults(source, config.generation_config)
    if config.quantization == "gguf" and source.format is not ModelFormat.GGUF:
        raise ConfigError(f"--quantization gguf: {config.model} is not a GGUF file")
    Shard(tp_size=config.tensor_parallel_size, pp_size=config.pipeline_parallel_size).check(model_config)
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if config.convert == "classify" and not model_config.labels:
        raise ConfigError(f"--convert classify: {source.name} has no sequence-classification head (the score weights "
                          "of a ...ForSequenceClassification checkpoint), and kvfleet adds none")
    if model_config.labels and config.runner == "generate":
        raise ConfigError(f"--runner generate: {source.name} is a classifier, it only pools; use --runner pooling")
    if model_config.is_encoder:
        _check_encoder(config, source)
        # As vLLM: an encoder's inputs stop at the length it was trained on, when it says.
        max_model_len = config.max_model_len or min(limit, max_seq_length(source.path) or limit)
        if config.max_num_batched_tokens < max_model_len:
            raise ConfigError(f"--max-num-batched-tokens {config.max_num_batched_tokens}: an encoder computes each "
                              f"input whole in one step, so it must be at least --max-model-len ({max_model_len})")
    if max_model_len > limit and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "").lower() not in ("1", "true"):
        raise ConfigError(
            f"--max-model-len {max_model_len}: {source.name} has {limit} positions; use at most {limit}, or set "
            f"{ALLOW_LONG_MAX_MODEL_LEN}=1 to allow more (outputs past {limit} tokens may be wrong)"
        )
    if config.speculative is not None and config.speculative.method == "draft_model":
        check_draft(config.speculative.model, model_config)
    if config.speculative is not None and config.speculative.method in ("eagle", "eagle3"):
        read_eagle_head(config.speculative.model, config.speculative.method, model_config)
    return CheckedModel(source, model_config, max_model_len)


def _check_encoder(config: EngineConfig, source: ModelSource) -> None:
    """What an encoder (docs/pooling.md) cannot do: generate, split over ranks, offload KV it does not keep."""
    if config.runner == "generate":
        raise ConfigError(f"--runner generate: {source.name} is an encoder, it only pools; use --runner pooling")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ConfigError("an encoder model runs on one rank: drop --tensor-parallel-size and --pipeline-parallel-size")
    if config.has_kv_tiers or config.speculative_config is not None:
        raise ConfigError("an encoder keeps no KV cache and drafts no tokens: drop the --kv-offloading-*, "
                          "--kv-shared-* and --speculative-config flags")


def check_draft(model: str, target: ModelConfig) -> None:
    """The draft model exists and shares the target's vocabulary (its tokens are verified as the target's)."""
    try:
        draft = read_model_config(resolve_model(model, require_tokenizer=False))
    except (ConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"--speculative-config model {model!r}: {exc}") from exc
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-config model {model!r}: its vocabulary has {draft.vocab_size} tokens, "
                          f"the target's {target.vocab_size}; a draft model needs the target's tokenizer")


def check_device(config: EngineConfig) -> None:
    if config.device.startswith("cuda") and _cuda_driver_devices() == 0:
        raise ConfigError(f"--device {config.device}: this machine has no CUDA device (no NVIDIA driver answers); "
                          "use --device cpu")


def _cuda_driver_devices() -> int:
    """GPUs the NVIDIA driver sees, asked of the driver library itself, as torch would."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def check_lora_modules(modules: list[LoRAModulePath], config: EngineConfig, model: ModelConfig) -> None:
    """--lora-modules where no worker reads them before serving (`cluster up`): each adapter
    checked from its config and header, a bad one a ConfigError naming it."""
    if modules and not config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    for module in modules:
        try:
            check_peft_adapter(module.path, model, config.max_lora_rank)
        except LoraAdapterError as exc:
            raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from exc
