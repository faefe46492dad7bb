"""Random-weight Llama checkpoints for the GPU check, built on the spot: the GPU machine
has no network and cannot carry a model, and random weights serve both parity (the
same weights in both engines) and speed (only the shapes matter).

A model directory needs a tokenizer.json for kvfleet to load it, even when every
prompt is token ids (it detokenizes the outputs). The smollm2 package that the tests
take theirs from is not on the GPU machine, so a word-level tokenizer with one word
per token id ("t0", "t1", ...) is built here instead: it covers the whole vocabulary,
so any sampled id detokenizes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks.gpu.common import default_dtype


def random_llama(fields: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int) -> LlamaForCausalLM:
    """A Llama with transformers' own random initialisation, made directly on `device` in
    `dtype` (on a GPU an 8B model initialises in seconds there, minutes on the host)."""
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config)
    # Never stop at EOS: every request generates its full length in both engines.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def save_checkpoint(model: LlamaForCausalLM, directory: Path) -> Path:
    """The model as a HF directory kvfleet loads: safetensors weights, config, tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(model.config.vocab_size, directory)
    return directory


def save_tokenizer(vocab_size: int, directory: Path) -> None:
    vocab = {f"t{index}": index for index in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(directory)


def random_prompts(lengths: list[int] | tuple[int, ...], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (length,), generator=generator).tolist() for length in lengths]
