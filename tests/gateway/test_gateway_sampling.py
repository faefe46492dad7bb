"""vLLM's sampling parameters through the OpenAI API, end to end with the official client:
n and best_of, seeds, the extra fields, echo and prompt logprobs, truncation, beam
search, and the 400s that name the field at fault. The offline SDK on the same
weights is the reference. The server and engine are test_gateway's fixtures.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvfleet import LLM, BeamSearchParams, SamplingParams
from services.outputs import RequestOutput

from corpus import CHAT, PROMPTS
from test_gateway import (  # noqa: F401  (fixtures)
    MODEL,
    ServerThread,
    Stack,
    _engine_idle_after_each_test,
    client,
    llm,
    server,
    stack,
    wait_until_idle,
)


def sdk(llm: LLM, prompt: list[int], **params) -> RequestOutput:
    [output] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params), use_tqdm=False)
    return output


def chat_ids(stack: Stack) -> list[int]:
    return stack.tokenizer.apply_chat_template(CHAT)


# -- n, best_of, seeds -----------------------------------------------------------------


def test_n_completions_whole_and_streamed_match_the_sdk(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=1.0, n=3, seed=7)
    whole = client.completions.create(**args)
    expected = sdk(llm, stack.tokenizer.encode(PROMPTS[4]), n=3, seed=7, temperature=1.0, max_tokens=6)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [c.text for c in expected.outputs]
    assert len({c.text for c in whole.choices}) > 1  # each choice samples on its own seed
    assert whole.usage.completion_tokens == 3 * 6  # every choice counts; the prompt once
    assert whole.usage.prompt_tokens == len(stack.tokenizer.encode(PROMPTS[4]))
    streamed = ["", "", ""]
    for chunk in client.completions.create(**args, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in whole.choices]


def test_n_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=1.0, n=2, seed=3)
    whole = client.chat.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 10
    content, reasons, roles = ["", ""], [None, None], [0, 0]
    for chunk in client.chat.completions.create(**args, stream=True):
        choice = chunk.choices[0]
        roles[choice.index] += choice.delta.role == "assistant"
        content[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert roles == [1, 1]
    assert content == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices] == ["length", "length"]


def test_best_of_returns_the_sdks_ranked_choices(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = stack.tokenizer.encode(PROMPTS[6])
    expected = sdk(llm, prompt, n=2, best_of=4, seed=5, temperature=1.0, max_tokens=6, logprobs=0)
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL, prompt=prompt, n=2, best_of=4, seed=5, temperature=1.0, max_tokens=6, stream=stream
        )
        chunks = list(response) if stream else [response]
        texts = ["", ""]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text for c in expected.outputs]


def test_a_seed_gives_the_same_text_in_any_batch(server: ServerThread, stack: Stack, llm: LLM) -> None:
    seeded = dict(prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=1234)
    expected = sdk(llm, stack.tokenizer.encode(PROMPTS[1]), seed=1234, temperature=1.0, max_tokens=8).outputs[0].text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as aclient:
            alone = await aclient.completions.create(model=MODEL, **seeded)
            others = [aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=1.0, n=2)
                      for p in PROMPTS[2:6]]
            batch = await asyncio.gather(aclient.completions.create(model=MODEL, **seeded), *others)
            return [alone.choices[0].text, batch[0].choices[0].text]

    assert asyncio.run(run()) == [expected, expected]


def test_disconnecting_aborts_every_choice(server: ServerThread, stack: Stack) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "n": 3, "stream": True}
    with httpx.Client() as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept: dropping this generator would close the response
        assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 2.0
        while stack.engine.stats().num_requests_running < 3:  # the other two fork from the first
            assert time.monotonic() < deadline, stack.engine.stats()
            time.sleep(0.01)
    wait_until_idle(stack.engine)


# -- vLLM's extra fields ---------------------------------------------------------------


def test_top_k_min_p_and_penalties_reach_the_sampler(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=8)
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    for narrow in ({"top_k": 1}, {"min_p": 1.0}):  # both leave only the most likely token
        assert client.completions.create(**args, temperature=1.5, extra_body=narrow).choices[0].text == greedy
    # A counting prompt repeats tokens, so every penalty changes what a seeded draw picks.
    counting = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=1.0, seed=5)
    plain = client.completions.create(**counting).choices[0].text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        text = client.completions.create(**counting, extra_body=penalty).choices[0].text
        expected = sdk(llm, stack.tokenizer.encode("1, 2, 3, 4,"), temperature=1.0, seed=5, max_tokens=8, **penalty)
        assert text == expected.outputs[0].text != plain


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI, stack: Stack) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    free = client.completions.create(**args, logprobs=0).choices[0]
    stop_id = stack.tokenizer.encode(free.logprobs.tokens[2], add_special_tokens=False)[0]
    stopped = client.completions.create(**args, extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop_id
    assert stopped.usage.completion_tokens == 3
    only = client.completions.create(**args, logprobs=0, extra_body={"allowed_token_ids": [stop_id]})
    assert set(only.choices[0].logprobs.tokens) == {free.logprobs.tokens[2]}
    stop = free.text[3:6]
    kept = client.completions.create(**args, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free.text[: free.text.index(stop) + len(stop)]
    # Without min_tokens the chat ends at EOS early; with it, EOS is out of reach until then.
    short = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    at_least = short.usage.completion_tokens + 4
    longer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=64, temperature=0, extra_body={"min_tokens": at_least}
    )
    assert longer.usage.completion_tokens >= at_least


def test_echo_with_logprobs_leads_with_the_prompt(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = stack.tokenizer.encode(PROMPTS[2])
    args = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**args).choices[0]
    expected = sdk(llm, prompt, temperature=0, max_tokens=4, prompt_logprobs=2)
    logprobs = whole.logprobs
    assert whole.text.startswith(PROMPTS[2]) and len(logprobs.tokens) == len(prompt) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected_prompt = [entry[token] for entry, token in zip(expected.prompt_logprobs[1:], prompt[1:])]
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected_prompt, abs=1e-4)
    # As vLLM: each token's own logprob, then the 2 most likely (3 where the token is not among them).
    assert all(top[token] == logprob and 2 <= len(top) <= 3
               for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]))
    streamed_tokens, streamed_text = [], ""
    for chunk in client.completions.create(**args, stream=True):
        streamed_text += chunk.choices[0].text
        streamed_tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert (streamed_text, streamed_tokens) == (whole.text, logprobs.tokens)


def test_prompt_logprobs_in_vllms_shape(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = stack.tokenizer.encode(PROMPTS[3])
    expected = sdk(llm, prompt, temperature=0, max_tokens=2, prompt_logprobs=1).prompt_logprobs
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    got = completion.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for entry, want, token in zip(got[1:], expected[1:], prompt[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token], abs=1e-4)
        assert entry[str(token)]["decoded_token"] == stack.tokenizer.decode([token], skip_special_tokens=False)
        assert [e["rank"] for e in entry.values()][0] == 1
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat_ids(stack))


def test_truncate_prompt_tokens_keeps_the_tail(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = stack.tokenizer.encode(" ".join(PROMPTS))
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 6}
    )
    assert response.usage.prompt_tokens == 6
    tail = stack.tokenizer.decode(prompt[-6:])
    assert response.choices[0].text == tail + sdk(llm, prompt[-6:], temperature=0, max_tokens=5).outputs[0].text


def test_beam_search_equals_the_sdks(client: openai.OpenAI, stack: Stack, llm: LLM) -> None:
    prompt = stack.tokenizer.encode(PROMPTS[0])
    [beams] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    expected = [stack.tokenizer.decode(beam.tokens[len(prompt):]) for beam in beams.sequences]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=3, extra_body={"use_beam_search": True}
    )
    assert [c.text for c in response.choices] == expected
    two = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=2, best_of=3, extra_body={"use_beam_search": True}
    )
    assert [c.text for c in two.choices] == expected[:2]  # width best_of, the n best returned
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, stream=True, extra_body={"use_beam_search": True}
    ))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_cache_salt_user_and_response_format_are_accepted(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0, user="someone",
        response_format={"type": "text"}, extra_body={"cache_salt": "tenant-a"},
    )
    assert response.usage.completion_tokens == 3


def test_completions_take_structured_outputs_and_guided_json(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for extra in ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, {"guided_json": schema}):
        response = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=20, temperature=0,
                                              extra_body=extra)
        assert json.loads(response.choices[0].text).keys() == {"n"}


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": "nope"}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"seed": 2**64}, "seed"),
        ({"user": 5}, "user"),
        ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "length_penalty": 50}, "length_penalty"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "use_beam_search": True}, "guided_regex"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_field(client: openai.OpenAI, extra: dict, param: str) -> None:
    body = {"max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body=body)
    assert caught.value.param == param and caught.value.message


def test_context_overflow_states_the_lengths(client: openai.OpenAI, stack: Stack) -> None:
    limit, prompt_len = stack.core.max_model_len, len(chat_ids(stack))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=limit)
    assert caught.value.param == "max_completion_tokens"
    assert f"maximum context length is {limit} tokens" in caught.value.message
    assert f"{limit + prompt_len} tokens ({prompt_len} in the messages, {limit} in the completion)" in (
        caught.value.message)


def test_non_finite_numbers_are_400(server: ServerThread) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "temperature": NaN}}'
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"


# -- the model's generation config ------------------------------------------------------


def test_generation_config_defaults_fill_what_a_request_leaves_unset(
    client: openai.OpenAI, stack: Stack, llm: LLM
) -> None:
    """--generation-config auto: the model's recommended sampling defaults apply where a
    request sets nothing, and its max_new_tokens caps max_tokens, as in vLLM."""
    prompt = PROMPTS[4]
    greedy = sdk(llm, stack.tokenizer.encode(prompt), temperature=0.0, max_tokens=3).outputs[0].text
    stack.tokenizer.sampling_defaults = {"temperature": 0.0, "max_tokens": 3}
    try:
        unset = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10)
        assert (unset.choices[0].text, unset.usage.completion_tokens) == (greedy, 3)
        chat = client.chat.completions.create(model=MODEL, messages=CHAT)
        assert chat.usage.completion_tokens == 3
        # What the request sets wins: temperature 1 with a seed is the SDK's seeded sample.
        sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=1.0, seed=3)
        expected = sdk(llm, stack.tokenizer.encode(prompt), temperature=1.0, seed=3, max_tokens=3)
        assert sampled.choices[0].text == expected.outputs[0].text
    finally:
        stack.tokenizer.sampling_defaults = {}
