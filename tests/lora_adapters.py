"""Random PEFT LoRA adapters for the default model, saved as PEFT saves them, and the
oracle: transformers with the adapter merged into the weights (`merge_and_unload()`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import hf_greedy


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    target_modules: tuple[str, ...]
    alpha: float
    use_rslora: bool = False
    seed: int = 0


# Three adapters of different ranks and target modules, one with rsLoRA's scaling.
SPECS = {
    "attn8": AdapterSpec(8, ("q_proj", "k_proj", "v_proj", "o_proj"), alpha=16, seed=1),
    "mlp4": AdapterSpec(4, ("gate_proj", "up_proj", "down_proj"), alpha=8, seed=2),
    "all16": AdapterSpec(16, ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), alpha=8, use_rslora=True,
                         seed=3),
}


def save_adapter(hf_model, spec: AdapterSpec, directory: Path, std: float = 0.05) -> Path:
    """Writes a random adapter of `spec` for `hf_model` (left untouched) into `directory`:
    A and B both non-zero, so it changes the model's tokens."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        use_rslora=spec.use_rslora, lora_dropout=0.0, bias="none")
    model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(directory)
    return directory


# The parity prompts and length: few and short, each oracle token costs a transformers forward.
TEXTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 6


def merged_greedy(hf_model, directory: Path | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens with the adapter in `directory` merged (None: the base model)."""
    if directory is None:
        return [hf_greedy(hf_model, prompt, new_tokens) for prompt in prompts]
    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), directory).merge_and_unload().eval()
    return [hf_greedy(merged, prompt, new_tokens) for prompt in prompts]


def references(hf_model, directories: dict[str, Path], prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Each adapter's oracle tokens for `prompts`, and the base model's (under None); every
    adapter must change some of the base model's, or it would test nothing."""
    wanted = {name: merged_greedy(hf_model, directory, prompts, NEW_TOKENS)
              for name, directory in {None: None, **directories}.items()}
    assert all(wanted[name] != wanted[None] for name in directories), wanted
    return wanted
