"""A step's layers in one C++ call (worker_svc/model/layer_loop.py): where the GGUF model runs
on the VNNI kernel, every step takes it, decodes alone, prompt chunks alone and both
together, and the tokens and logprobs are the layer-by-layer loop's to the bit, over
float16 and bfloat16 KV caches."""
from __future__ import annotations

import pytest

from kvfleet import LLM, SamplingParams
from worker_svc.kernels.cpu import vnni_gemm

pytestmark = pytest.mark.skipif(vnni_gemm.load() is None, reason="no AVX-512 VNNI CPU or no compiler")

PROMPTS = [list(range(1000 + 37 * i, 1000 + 37 * i + length)) for i, length in enumerate((5, 40, 130, 17))]


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 8 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [dict(step) for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])  # auto: float16 for GGUF weights
def test_steps_in_one_call_give_the_python_loops_tokens_and_logprobs_to_the_bit(kv_cache_dtype, monkeypatch):
    # Prompt chunks of 64 beside the others' decodes; no prefix caching, whose hits turn a prompt's last
    # token into a decode row (another kernel) in the runs after the first.
    llm = LLM("smollm2", dtype="float32", quantization="gguf", kv_cache_dtype=kv_cache_dtype, max_model_len=512,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    try:
        model = llm.engine.worker.model
        assert model.layer_loop is not None
        steps = []
        run = model.layer_loop.run
        monkeypatch.setattr(model.layer_loop, "run", lambda *args: steps.append(args[4]._obj.tokens) or run(*args))
        together, alone = generate(llm, PROMPTS), generate(llm, PROMPTS[:1])
        assert len(steps) >= 24 + 8 * 3 + 1 and max(steps) == 64 and 1 in steps  # chunks of 64, decodes of 1
        model.layer_loop = None  # every step layer by layer
        assert generate(llm, PROMPTS) == together and generate(llm, PROMPTS[:1]) == alone
        assert together[0] == alone[0]
    finally:
        llm.engine.worker.close()
