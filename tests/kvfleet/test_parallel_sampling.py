"""n and best_of: children share the prompt's KV blocks (copy-on-write of the last one)."""
from __future__ import annotations

from kvfleet import SamplingParams


def test_n8_on_a_1000_token_prompt_holds_the_prompt_once(llm):
    engine = llm.engine
    prompt = [1000 + (i * 7919) % 30000 for i in range(1000)]
    engine.add_request("group", prompt, SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=3))
    engine.step()  # the leader computes the prompt (budget 2048) and the others fork from it
    pool = engine.scheduler.block_pool
    prompt_blocks = -(-1000 // 16)  # 63 blocks, the last one partly filled
    assert len(engine.scheduler.running) == 8
    # Shared: the 62 full blocks once; private: each child's copy of the 63rd block.
    assert pool.num_used_blocks == prompt_blocks + 7
    assert pool.num_used_blocks < 2 * prompt_blocks
    while engine.has_work:
        engine.step()


def test_n_samples_differ_are_seeded_and_greedy_ones_agree(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=11)
    [first] = llm.generate("Once upon a time", params)
    [again] = llm.generate("Once upon a time", params)
    texts = [c.text for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert texts == [c.text for c in again.outputs]
    assert len(set(texts)) > 1
    [greedy] = llm.generate("Once upon a time", SamplingParams(n=3, temperature=0, max_tokens=12))
    [single] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)


def test_best_of_returns_the_most_likely_candidates(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=8, seed=5)
    [output] = llm.generate("The weather today is", params)
    assert len(output.outputs) == 2 and [c.index for c in output.outputs] == [0, 1]
    assert output.outputs[0].logprobs is None  # ranked by logprob, which was not asked for
    with_logprobs = SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=8, seed=5, logprobs=0)
    [ranked] = llm.generate("The weather today is", with_logprobs)
    scores = [c.cumulative_logprob for c in ranked.outputs]
    assert scores == sorted(scores, reverse=True)
    assert [c.token_ids for c in ranked.outputs] == [c.token_ids for c in output.outputs]
