"""A step's layers in one C++ call (worker_svc/model/layer_loop.py): where the GGUF model runs
on the VNNI kernel, every step takes it (decodes alone, prompt chunks alone and both
together); on the AVX2 int16 kernel, the steps of up to INT16_MAX_ROWS rows that kernel
takes. The tokens and logprobs are the layer-by-layer loop's to the bit, over float16 and
bfloat16 KV caches."""
from __future__ import annotations

import pytest

from kvfleet import LLM, SamplingParams
from worker_svc.kernels.cpu import int16_gemm, vnni_gemm
from worker_svc.model.q4_linear import INT16_MAX_ROWS

KERNELS = {"vnni": vnni_gemm.load() is not None, "avx2_int16": int16_gemm.load() is not None}

PROMPTS = [list(range(1000 + 37 * i, 1000 + 37 * i + length)) for i, length in enumerate((5, 40, 130, 17))]


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 8 * i, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [dict(step) for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])  # auto: float16 for GGUF weights
def test_steps_in_one_call_give_the_python_loops_tokens_and_logprobs_to_the_bit(kernel, kv_cache_dtype, monkeypatch):
    if not KERNELS[kernel]:
        pytest.skip(f"the {kernel} kernel does not run on this CPU")
    if kernel != "vnni":
        monkeypatch.setattr(vnni_gemm, "load", lambda: None)  # the layers take the AVX2 kernels, as without VNNI
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
        if kernel == "vnni":  # every step: chunks of 64, decodes of 4 and fewer
            assert len(steps) >= 24 + 8 * 3 + 1 and max(steps) == 64 and 1 in steps
        else:  # the steps of the last 3 requests decoding, then 2, then 1
            assert len(steps) >= 3 * 8 + 24 and set(steps) == set(range(1, INT16_MAX_ROWS + 1))
        model.layer_loop = None  # every step layer by layer
        assert generate(llm, PROMPTS) == together and generate(llm, PROMPTS[:1]) == alone
        # On VNNI every step takes one kernel, so a request's tokens do not depend on its batch (on AVX2,
        # steps of more rows than the int16 kernel takes run the float32 ones).
        assert together[0] == alone[0] or kernel != "vnni"
    finally:
        llm.engine.worker.close()
