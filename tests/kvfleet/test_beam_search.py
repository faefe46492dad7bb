"""Beam search equals transformers' num_beams search on the same weights."""
from __future__ import annotations

import pytest
import torch

from kvfleet import BeamSearchParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite season is autumn because"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_search_matches_transformers(llm, hf_smollm2, prompt):
    token_ids = llm.get_tokenizer().encode(prompt)
    [output] = llm.beam_search([token_ids], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    with torch.inference_mode():
        expected = hf_smollm2.generate(
            torch.tensor([token_ids]), num_beams=3, max_new_tokens=10, do_sample=False, early_stopping=False,
            pad_token_id=0,
        )[0, len(token_ids):].tolist()
    assert output.beams[0].token_ids == expected
    assert len(output.beams) == 3
    scores = [b.cumulative_logprob for b in output.beams]
    assert scores == sorted(scores, reverse=True)
