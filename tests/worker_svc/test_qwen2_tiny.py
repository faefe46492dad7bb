"""A tiny random-weight Qwen2 (QKV bias) built from a transformers config matches transformers."""
from __future__ import annotations

import pytest
import torch

from kvfleet import SamplingParams

from conftest import hf_greedy


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, default_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=default_tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # default init zeroes biases; give the QKV bias real values to test
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return path, model


@pytest.fixture(scope="module")
def default_tokenizer():
    from services.model_source import resolve_model
    from tokenizer_svc.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model("smollm2"))


def test_tiny_qwen2_matches_transformers(tiny_qwen2, make_llm):
    path, hf_model = tiny_qwen2
    assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (3, 17, 40, 90, 150)]
    reference = [hf_greedy(hf_model, prompt, 24) for prompt in prompts]
    llm = make_llm(str(path), dtype="float32", block_size=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.worker.model_config.attention_bias
