"""The offline SDK end to end on the real model: chat, stopping, bad input (the examples
of README.md and docs/ run in tests/system/test_readme.py)."""
from __future__ import annotations

import pytest

from kvfleet import LLM, SamplingParams
from services.invalid_parameter import InvalidParameter


def test_output_shape_and_text_match_tokens(llm):
    [output] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    completion = output.outputs[0]
    assert output.prompt == "The capital of France is"
    assert output.prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    assert output.finished


def test_chat_uses_the_template_and_stops_at_eos(llm):
    messages = [{"role": "user", "content": "Say hello in one word."}]
    [output] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=64))
    tokenizer = llm.get_tokenizer()
    assert output.prompt_token_ids == tokenizer.apply_chat_template(messages)
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == tokenizer.eos_token_id
    assert completion.text.strip() and "<|im_end|>" not in completion.text


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [free] = llm.generate("Hello, my name is", greedy)
    stop_at = free.outputs[0].token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    [stopped] = llm.generate("Hello, my name is", params)
    completion = stopped.outputs[0]
    assert completion.token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(stop_at) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at


def test_min_tokens_defers_stop_tokens(llm):
    [free] = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    first = free.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first], min_tokens=3)
    [output] = llm.generate("Hello, my name is", params)
    assert len(output.outputs[0].token_ids) >= 3


def test_stop_strings_truncate_text(llm):
    [free] = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free.outputs[0].text  # " Alex, and I'm a professional coach. ..."
    stop = "professional"
    assert stop in text
    [output] = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    completion = output.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    [kept] = llm.generate("Hello, my name is", params)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_sampling_is_seeded_and_varied(llm):
    prompt = "Once upon a time"
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=s) for s in (1, 1, 2)]
    first, again, other = (o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False))
    assert first == again
    assert first != other


@pytest.mark.parametrize(
    "prompt, param",
    [([], "prompt"), ([1, 2, 49152], "prompt"), ([5] * 9000, "prompt")],
)
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, prompt, param):
    with pytest.raises(InvalidParameter) as error:
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=4))
    assert error.value.param == param
    [output] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(output.outputs[0].token_ids) == 4


def test_too_long_prompt_names_both_lengths(llm):
    with pytest.raises(InvalidParameter, match="maximum context length is 8192 tokens.*9000 in the prompt"):
        llm.generate([[5] * 9000])


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, param):
    with pytest.raises(InvalidParameter) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param


def test_unknown_model_is_a_clear_error():
    from services.model_source import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="never downloads"):
        LLM("meta-llama/Llama-3-8B")


def test_kv_pool_too_small_for_max_model_len_fails_at_startup():
    from worker_svc.runtime.kv_cache import KVCacheTooSmall

    with pytest.raises(KVCacheTooSmall, match="max_model_len=8192.*--max-model-len"):
        LLM("smollm2", kv_cache_memory=100 * 2**20)
    with pytest.raises(KVCacheTooSmall, match="max_model_len=2048.*--max-model-len"):
        LLM("smollm2", num_gpu_blocks_override=100, max_model_len=2048)


def test_a_pool_sized_outright_bounds_the_context_when_no_length_is_asked(caplog):
    llm = LLM("smollm2", num_gpu_blocks_override=64)
    assert llm.engine.max_model_len == 64 * 16
    assert "max_model_len lowered from the model's 8192 to 1024" in caplog.text


def test_logprobs_match_transformers_log_softmax(llm, hf_smollm2):
    import torch

    prompt = llm.get_tokenizer().encode("The capital of France is")
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=5))
    completion = output.outputs[0]
    assert len(completion.logprobs) == 3
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = logits.float().log_softmax(-1)
    for position, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
        top = expected[position].topk(5)
        assert list(entry)[:5] == top.indices.tolist()  # best first
        assert entry[token] == pytest.approx(expected[position, token].item(), abs=1e-3)
        assert token == list(entry)[0]  # greedy took the best token
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(completion.logprobs, completion.token_ids))
    )


def test_repetition_penalty_and_bad_words_match_transformers(llm, hf_smollm2):
    import torch

    prompt = llm.get_tokenizer().encode("The capital of France is Paris. The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3, bad_words=["Paris"])
    [output] = llm.generate([prompt], params)
    banned = llm.get_tokenizer().bad_words_token_ids(["Paris"])
    with torch.inference_mode():
        expected = hf_smollm2.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
            bad_words_ids=banned, pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert output.outputs[0].token_ids == expected
    assert "Paris" not in output.outputs[0].text


def test_logit_bias_and_allowed_tokens_steer_generation(llm):
    prompt = "Hello, my name is"
    [forced] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100}))
    assert forced.outputs[0].token_ids == [42, 42, 42, 42]
    [allowed] = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, allowed_token_ids=[11, 12, 13]))
    assert set(allowed.outputs[0].token_ids) <= {11, 12, 13}
    with pytest.raises(InvalidParameter) as error:
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}))
    assert error.value.param == "logit_bias"


def test_prompt_logprobs_match_transformers(dense_llm, hf_smollm2):
    """On the float32 weights transformers computes with (the default 4-bit path's int16
    activations move logprobs by about 1e-3)."""
    import torch

    prompt = dense_llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    [output] = dense_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    with torch.inference_mode():
        expected = hf_smollm2(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        token = prompt[position + 1]
        assert entry[token] == pytest.approx(expected[position, token].item(), abs=1e-3)
        assert list(entry)[:2] == expected[position].topk(2).indices.tolist()


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    prompt = list(range(1000, 1100))
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=10))
    [tail] = llm.generate([prompt[-10:]], SamplingParams(temperature=0, max_tokens=2))
    assert output.outputs[0].token_ids == tail.outputs[0].token_ids


def test_stop_string_that_begins_in_an_earlier_step(llm):
    [free] = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free.outputs[0].text  # " Alex, and I'm a professional coach. ..."
    stop = "professional coach"  # spans several tokens, so it begins steps before it completes
    [output] = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    assert output.outputs[0].text == text[: text.index(stop)]


def test_a_failed_step_ends_only_its_requests(make_llm, monkeypatch):
    from scheduler_svc.engine_core import StepFailed

    engine = make_llm(dtype="float32", max_num_seqs=1).engine  # one request per step
    engine.add_request("victim", [4, 5, 6], SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("bystander", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    real_execute = engine.worker.execute

    def failing_execute(plan):
        if "victim" in plan.num_scheduled_tokens:
            raise RuntimeError("injected")
        return real_execute(plan)

    monkeypatch.setattr(engine.worker, "execute", failing_execute)
    finished = {}
    while engine.has_work:
        try:
            finished.update({d.request_id: d.finish_reason for d in engine.step() if d.finish_reason})
        except StepFailed as error:
            assert error.request_ids == ["victim"]
            finished["victim"] = "failed"
    assert finished == {"victim": "failed", "bystander": "length"}


@pytest.mark.parametrize("kwargs, param", [({"top_k": 2**64}, "top_k"), ({"seed": 2**65}, "seed")])
def test_out_of_range_integers_are_rejected_before_the_engine(kwargs, param):
    with pytest.raises(InvalidParameter) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param


def test_logprobs_beyond_the_vocabulary_are_rejected(llm):
    with pytest.raises(InvalidParameter) as error:
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=10**6))
    assert error.value.param == "logprobs"


def test_embeddings_match_transformers_beside_generation(dense_llm, hf_smollm2):
    """Two dozen prompts of 1 to 100 tokens pooled (LAST, normalized) in the same steps as
    greedy generations, the long ones in chunks: each vector is transformers' normalized last
    hidden state, and the generations are transformers' tokens still."""
    import torch

    from kvfleet import PoolingParams

    from conftest import hf_greedy
    from corpus import TEXT

    tokens = dense_llm.get_tokenizer().encode(TEXT)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89] * 2 + [4, 16, 40, 100]
    prompts = [tokens[i * 7:i * 7 + n] for i, n in enumerate(lengths)]
    generated = {f"gen-{i}": tokens[11 + i * 40:31 + i * 40] for i in range(2)}
    engine = dense_llm.engine
    for request_id, prompt in generated.items():
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"emb-{i}", prompt, SamplingParams(pooling=PoolingParams()))
    vectors, outputs, mixed_steps = {}, {request_id: [] for request_id in generated}, 0
    while engine.has_work:
        deltas = engine.step()
        mixed_steps += any(d.pooled for d in deltas) and any(d.new_token_ids for d in deltas)
        for delta in deltas:
            if delta.pooled is not None:
                assert delta.finish_reason == "stop" and not delta.new_token_ids
                vectors[delta.request_id] = torch.tensor(delta.pooled)
            else:
                outputs[delta.request_id] += delta.new_token_ids
    assert mixed_steps, "no step both pooled and sampled"
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            hidden = hf_smollm2.model(torch.tensor([prompt])).last_hidden_state[0, -1]
            cosine = torch.nn.functional.cosine_similarity(vectors[f"emb-{i}"], hidden, dim=0).item()
            assert cosine >= 0.999, (len(prompt), cosine)
            assert vectors[f"emb-{i}"].norm().item() == pytest.approx(1.0, abs=1e-5)
    for request_id, prompt in generated.items():
        assert outputs[request_id] == hf_greedy(hf_smollm2, prompt, 4)


def test_embed_api_dimensions_and_lengths(dense_llm):
    from kvfleet import PoolingParams

    outputs = dense_llm.embed(["Hello, my name is", [1, 2, 3]], use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outputs] == [576, 576]
    assert outputs[0].prompt_token_ids == dense_llm.get_tokenizer().encode("Hello, my name is")
    [raw] = dense_llm.embed([[1, 2, 3]], PoolingParams(normalize=False), use_tqdm=False)
    norm = sum(x * x for x in raw.outputs.embedding) ** 0.5
    assert [x / norm for x in raw.outputs.embedding] == pytest.approx(outputs[1].outputs.embedding, abs=1e-5)
    with pytest.raises(InvalidParameter) as error:
        dense_llm.embed([[1] * (dense_llm.engine.max_model_len + 1)], use_tqdm=False)
    assert error.value.param == "input" and "maximum context length" in str(error.value)
    long = [1] * (dense_llm.engine.max_model_len + 1)
    [cut] = dense_llm.embed([long], truncate_prompt_tokens=5, use_tqdm=False)
    assert cut.prompt_token_ids == [1] * 5


def test_generation_only_model_refuses_pooling(llm):
    with pytest.raises(ValueError, match="pooling model"):
        llm.embed("Hello")


def test_mean_pooling_over_prefill_chunks_matches_transformers(make_llm, hf_smollm2):
    """MEAN pooling sums each chunk's rows as a long prompt is prefilled in several steps:
    the mean of transformers' last hidden states, normalized."""
    import torch

    from conftest import DENSE
    from corpus import TEXT

    llm = make_llm(**DENSE, pooler_config='{"pooling_type": "MEAN"}', max_num_batched_tokens=32)
    tokens = llm.get_tokenizer().encode(TEXT)
    prompts = [tokens[:20], tokens[30:75], tokens[80:150]]  # up to 3 chunks each, sharing steps
    outputs = llm.embed(prompts, use_tqdm=False)
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            mean = hf_smollm2.model(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            cosine = torch.nn.functional.cosine_similarity(torch.tensor(output.outputs.embedding), mean, dim=0)
            assert cosine.item() >= 0.999, (len(prompt), cosine.item())
