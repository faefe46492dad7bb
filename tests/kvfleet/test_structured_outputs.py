"""Structured outputs through the SDK on the real model: every kind of constraint holds,
a constraint that allows everything changes nothing, the grammar state survives
preemption (recompute and swap), parallel samples, chunked prefill and prefix-cache
hits, and an invalid constraint is refused naming its field, before any work."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_schemas import SCHEMAS

from kvfleet import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from services.invalid_parameter import InvalidParameter

from conftest import assert_no_leaks

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = ["crimson", "teal", "ochre", "violet"]
# Python's spelling of the EBNF below, to check the outputs with.
GRAMMAR = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]{0,2}'
GRAMMAR_RE = r"\([1-9][0-9]{0,2}([+*][1-9][0-9]{0,2}){0,3}\)"
# Tight enough for a cramped cache: 8 blocks of 16 tokens.
CRAMPED = dict(dtype="float32", num_gpu_blocks_override=8, max_model_len=128)


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_json_schemas_hold(llm) -> None:
    # All twenty go through both servers (tests/system/test_structured_outputs_served.py); here a few.
    chosen = SCHEMAS[:: len(SCHEMAS) // 4]
    conversations = [_chat(f"Give me {what} as JSON.") for what, _ in chosen]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
              for _, schema in chosen]
    for (what, schema), output in zip(chosen, llm.chat(conversations, params, use_tqdm=False)):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (what, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    [output] = llm.chat(_chat("Give me a person with a name and an age as JSON."), SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    assert isinstance(json.loads(output.outputs[0].text), dict)
    assert_no_leaks(llm)


def test_regex_choice_and_grammar_hold_when_sampled(llm) -> None:
    constraints = {
        "regex": (StructuredOutputsParams(regex=PHONE), lambda text: re.fullmatch(PHONE, text)),
        "choice": (StructuredOutputsParams(choice=COLORS), lambda text: text in COLORS),
        "grammar": (StructuredOutputsParams(grammar=GRAMMAR), lambda text: re.fullmatch(GRAMMAR_RE, text)),
    }
    for name, (constraint, holds) in constraints.items():
        params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=60, structured_outputs=constraint)
        [output] = llm.chat(_chat(f"Answer with a {name}."), params, use_tqdm=False)
        texts = [completion.text for completion in output.outputs]
        assert all(holds(text) for text in texts), (name, texts)
        assert len(set(texts)) > 1 or name != "regex", texts  # sampled, not one forced path


def test_a_constraint_that_allows_everything_changes_nothing(llm) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=40)
    allowing = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[\s\S]*"))
    prompts = ["Hello, my name is", "The three primary colors are"]
    [a, b] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in (free, allowing)]
    assert a == b


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(llm, make_llm, preemption_mode: str) -> None:
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                         "maxItems": 12}}, "required": ["items"]}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [f"List {n} numbers as JSON:" for n in range(3, 9)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    cramped = make_llm(**CRAMPED, preemption_mode=preemption_mode, swap_space=0.01)
    outputs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert_no_leaks(cramped)


def test_chunked_prefill_and_prefix_hits_keep_the_constraint(make_llm) -> None:
    llm = make_llm(dtype="float32", max_num_batched_tokens=32, enable_prefix_caching=True)
    prompt = "Here is a long preamble that spans several prefill chunks. " * 6 + "Pick a color:"
    params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=COLORS))
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert llm.engine.scheduler.prefix_cache_hits > 0
    assert first.outputs[0].text in COLORS and second.outputs[0].text == first.outputs[0].text


def test_with_a_reasoning_end_the_grammar_starts_after_it(llm) -> None:
    [free] = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    thought = free.outputs[0].token_ids[:4]  # stands in for "...</think>": the last two tokens end it
    constraint = StructuredOutputsParams(choice=COLORS, reasoning_end_token_ids=tuple(thought[2:]))
    [output] = llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=constraint), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids[:4] == thought  # unconstrained until the marker
    reasoning = llm.get_tokenizer().decode(thought)
    assert completion.text.startswith(reasoning) and completion.text[len(reasoning):] in COLORS


@pytest.mark.parametrize(("constraint", "message"), [
    (dict(regex="(unclosed"), "parenthesis"),
    (dict(grammar="root ::= missing_rule"), "missing_rule"),
    (dict(json='{"type": "no-such-type"}'), "no-such-type"),
    (dict(json="{not json"), "JSON"),
])
def test_an_invalid_constraint_is_refused_naming_its_field(llm, constraint: dict, message: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(InvalidParameter, match=message) as raised:
        llm.generate("x", params, use_tqdm=False)
    assert raised.value.param == "structured_outputs"
    assert_no_leaks(llm)


def test_structural_tags_in_vllms_and_xgrammars_formats(llm) -> None:
    answer = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}
    structure = {"begin": "<answer>", "schema": answer, "end": "</answer>"}
    legacy = {"type": "structural_tag", "structures": [structure], "triggers": ["<answer>"]}
    native = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                                  "content": {"type": "json_schema", "json_schema": structure["schema"]}}}
    for tag in (legacy, native):
        params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(
            structural_tag=json.dumps(tag), disable_any_whitespace=True))
        [output] = llm.generate("<answer>", params, use_tqdm=False)
        text = output.outputs[0].text
        if tag is native:  # the whole output is the tag
            assert text.startswith("<answer>")
            assert isinstance(json.loads(text[len("<answer>"):].split("</answer>")[0])["a"], int)
    with pytest.raises(InvalidParameter, match="structural_tag"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag='{"type": 1}')),
                     use_tqdm=False)


def test_params_name_exactly_one_constraint_and_keep_the_old_spelling() -> None:
    for kwargs in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}):
        with pytest.raises(InvalidParameter, match="structured_outputs"):
            StructuredOutputsParams(**kwargs)
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert old.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
