"""Beam search equals transformers' num_beams search on the same weights, in vLLM's output shape."""
from __future__ import annotations

import math

import pytest
import torch

from kvfleet import BeamSearchParams
from services.beam_search import BeamSearchOutput, BeamSearchSequence

PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite season is autumn because"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_search_matches_transformers(llm, hf_smollm2, prompt):
    token_ids = llm.get_tokenizer().encode(prompt)
    [output] = llm.beam_search([token_ids], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    with torch.inference_mode():
        expected = hf_smollm2.generate(
            torch.tensor([token_ids]), num_beams=3, max_new_tokens=10, do_sample=False, early_stopping=False,
            pad_token_id=0,
        )[0].tolist()
    assert output.sequences[0].tokens == expected  # prompt + generated, as both vLLM and transformers give
    assert len(output.sequences) == 3
    scores = [s.cum_logprob for s in output.sequences]  # one length for all: score order is logprob order
    assert scores == sorted(scores, reverse=True)


def test_output_has_vllms_shape(llm):
    """vLLM's BeamSearchOutput.sequences[i]: tokens (prompt + generated), text of those tokens,
    cum_logprob the sum of the chosen tokens' logprobs, one logprobs dict per generated token."""
    tokenizer = llm.get_tokenizer()
    prompt = "The capital of France is"
    prompt_ids = tokenizer.encode(prompt)
    width, max_tokens = 4, 6
    outputs = llm.beam_search([prompt, {"prompt": prompt}], BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    assert len(outputs) == 2
    # Text and dict prompts are the same search (logprobs may differ in the last bits: the
    # second search reads its prompt from the prefix cache).
    assert [s.tokens for s in outputs[0].sequences] == [s.tokens for s in outputs[1].sequences]
    output = outputs[0]
    assert isinstance(output, BeamSearchOutput)
    assert len(output.sequences) == width
    assert len({tuple(s.tokens) for s in output.sequences}) == width
    eos = llm.engine.eos_token_ids
    for sequence in output.sequences:
        assert isinstance(sequence, BeamSearchSequence)
        assert sequence.tokens[: len(prompt_ids)] == prompt_ids
        generated = sequence.tokens[len(prompt_ids):]
        assert sequence.text == tokenizer.decode(sequence.tokens)
        assert sequence.text.startswith(prompt)
        assert len(sequence.logprobs) == len(generated)
        assert all(len(top) >= 2 * width for top in sequence.logprobs)  # the round's candidates
        assert sequence.cum_logprob == pytest.approx(sum(top[t] for top, t in zip(sequence.logprobs, generated)))
        assert sequence.stop_reason is None
        if sequence.finish_reason == "stop":
            assert generated[-1] in eos
        else:
            assert (sequence.finish_reason, len(generated)) == ("length", max_tokens)

    def score(s: BeamSearchSequence) -> float:
        return s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop"))

    scores = [score(s) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert all(math.isfinite(s) for s in scores)


def test_eos_ends_a_beam_and_is_ranked_without_it():
    """The search on a scripted model: EOS finishes a beam, whose score leaves the EOS out."""
    from services.beam_search import beam_search

    eos = 9
    # Token 1 is likely, then EOS is very likely after it; token 2 goes on cheaply.
    table = {(): {1: -0.1, 2: -0.5}, (1,): {eos: -0.01, 3: -3.0}, (2,): {4: -0.2, 5: -0.3}}

    def next_tokens(prompts: list[list[int]], _params) -> list[dict[int, float]]:
        return [table.get(tuple(p[1:]), {6: -1.0, 7: -2.0}) for p in prompts]

    output = beam_search([0], BeamSearchParams(beam_width=2, max_tokens=3), (eos,), next_tokens)
    best = output.sequences[0]
    assert (best.tokens, best.finish_reason, best.stop_reason) == ([0, 1, eos], "stop", None)
    assert best.cum_logprob == pytest.approx(-0.11)
    assert [len(s.logprobs) for s in output.sequences] == [len(s.tokens) - 1 for s in output.sequences]
    assert {s.finish_reason for s in output.sequences[1:]} == {"length"}
    assert len(output.sequences) == 2
