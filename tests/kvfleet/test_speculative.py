"""Speculative decoding with the ngram, suffix, draft_model, eagle and eagle3 methods (docs/speculative.md)
against the same model without it: greedy tokens identical whatever the batch, suffix decoding drafting
from past outputs, stops landing inside an accepted
run truncate it, the prefix cache holds only accepted tokens, requests speculation cannot
serve decode one token at a time, vLLM's counters count, and a config that cannot work is
refused before loading."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import save_file

from gateway.cluster.fleet_stats import total
from kvfleet import LLM, SamplingParams, StructuredOutputsParams
from kvfleet.processes import free_port
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.worker_client import RemoteWorker
from services.config import ConfigError, EngineConfig
from services.messages import StepPlan
from services.model_source import resolve_model
from services.telemetry import EngineStatsCollector
from worker_svc.model.weights import load_weights
from worker_svc.runtime.sampling.logits_processors import adjusts

from conftest import assert_no_leaks
from corpus import TEXT, parity_prompts
from eagle_heads import DRAFT_VOCAB, write_eagle_head
from servers import RoleProcess

# The configuration vLLM users pass (and the check): 4 drafts from 4-gram matches.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# vLLM's suffix defaults (24 drafts at most); no drafts while 6 requests run.
SUFFIX = {"method": "suffix", "disable_by_batch_size": 6}
CODE = ("def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
        "    print(\"the total is\", total)\n    return total\n")
COPY = f"Rename the variable `total` to `result`.\n\n```python\n{CODE}```\n\nRenamed:\n\n```python\n"


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    # A pool too small for the mixed batch below: its requests are preempted (by
    # recompute) with drafts in flight and lookahead blocks held.
    return LLM("smollm2", dtype="float32", speculative_config=NGRAM, num_gpu_blocks_override=24,
               max_model_len=384)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest):
    yield
    for engine in ("spec_llm", "suffix_llm", "draft_llm", "eagle_llm", "eagle3_llm"):
        if engine in request.fixturenames:
            assert_no_leaks(request.getfixturevalue(engine))


def _tokens(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def suffix_llm() -> LLM:
    # The same small pool as spec_llm's.
    return LLM("smollm2", dtype="float32", speculative_config=SUFFIX, num_gpu_blocks_override=24,
               max_model_len=384)


def _smollm2_without_layers(directory: Path, dropped: range) -> Path:
    """A draft model built from the default one by dropping some middle layers (the rest,
    the embedding, final norm and tied LM head kept), saved as a model directory. It
    agrees with the whole model on part of the tokens only, so its drafts are often rejected."""
    config, weights = load_weights(resolve_model("smollm2"), torch.float32)
    layers = [i for i in range(config.num_hidden_layers) if i not in dropped]
    kept = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index in dropped:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{layers.index(index)}.")
        kept[name] = tensor.to(torch.float16)
    num_layers = len(layers)
    save_file(kept, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": True,
        "eos_token_id": list(config.eos_token_ids)}))
    return directory


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The draft_model config: the default model without 6 of its middle layers, 3 drafts."""
    path = _smollm2_without_layers(tmp_path_factory.mktemp("draft"), range(12, 18))
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def draft_llm(draft) -> LLM:
    # A smaller pool than spec_llm's: its mixed batch is smaller.
    return LLM("smollm2", dtype="float32", num_gpu_blocks_override=16, max_model_len=256, speculative_config=draft)


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    config, weights = load_weights(resolve_model("smollm2"), torch.float32)
    return {method: write_eagle_head(tmp_path_factory.mktemp(method), method, config, weights)
            for method in ("eagle", "eagle3")}


def _eagle_llm(method: str, heads: dict[str, Path]) -> LLM:
    # The draft_llm's pool: the mixed batch below preempts; and a token budget below its
    # prompts' sum: a step's last prompt is prefilled in chunks, whose rows the head runs over too.
    return LLM("smollm2", dtype="float32", num_gpu_blocks_override=16, max_model_len=256, max_num_batched_tokens=96,
               speculative_config={"method": method, "model": str(heads[method]), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def eagle_llm(eagle_heads) -> LLM:
    return _eagle_llm("eagle", eagle_heads)


@pytest.fixture(scope="module")
def eagle3_llm(eagle_heads) -> LLM:
    return _eagle_llm("eagle3", eagle_heads)


@pytest.fixture(scope="module")
def mixed_batch(llm) -> tuple[list, list[SamplingParams], list[list[int]]]:
    """Prompts, their params and the plain model's tokens: a batch too large for the
    speculative engines' pools (preemption by recompute with drafts in flight and
    lookahead blocks held), with a seeded sampled request beside, whose rows draw with each
    position's noise, and a penalized one, whose drafts are verified against each
    position's penalized logits."""
    prompts = [COPY, *parity_prompts(llm.get_tokenizer().encode(TEXT))[:9:3], COPY, COPY]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=i % 2 == 0) for i in range(4)]
    params += [SamplingParams(temperature=1.0, seed=7, max_tokens=24), SamplingParams(temperature=0.0,
               repetition_penalty=1.3, max_tokens=24)]
    return prompts, params, _tokens(llm, prompts, params)


@pytest.mark.parametrize("engine", ["spec_llm", "suffix_llm", "draft_llm"])
def test_greedy_tokens_are_identical_in_a_mixed_batch(engine, mixed_batch, request):
    spec = request.getfixturevalue(engine)
    prompts, params, plain = mixed_batch
    if engine == "draft_llm":  # its steps cost two models: three copies and a short prompt preempt in its pool
        prompts, params, plain = ([items[i] for i in (0, 1, 4, 5)] for items in mixed_batch)
    scheduler = spec.engine.scheduler
    counts, preemptions_before = scheduler.spec_decoding, scheduler.num_preemptions
    accepted_before, drafted_before = counts.num_accepted_tokens, counts.num_draft_tokens
    assert _tokens(spec, prompts, params) == plain
    assert scheduler.num_preemptions > preemptions_before
    # ... and alone (another batch shape) too; drafts were accepted all along (how many the
    # gate lets a batch verify depends on the step costs measured as it runs: 16-17 here,
    # 15 on a loaded machine), and the draft model's (it lacks 6 of the 30 layers) rejected often.
    assert _tokens(spec, [COPY], params[0]) == plain[:1]
    accepted = counts.num_accepted_tokens - accepted_before
    rejected = counts.num_draft_tokens - drafted_before - accepted
    if engine == "draft_llm":
        assert accepted >= 8 and rejected >= 16, (accepted, rejected)
    else:
        assert accepted >= 8, accepted


def test_async_scheduling_plans_no_step_ahead_of_a_request_that_may_speculate(mixed_batch, make_llm):
    """A request's drafts come from its newest token, which a step planned ahead does not
    know: while a request that may speculate runs, no step is planned ahead (a request
    planned ahead would never speculate, one left out would fall a step behind). The
    tokens are the plain ones, and the steps are timed for the gate all the same."""
    prompts, params, plain = mixed_batch
    spec = make_llm(dtype="float32", speculative_config=NGRAM, num_gpu_blocks_override=24, max_model_len=384,
                    async_scheduling=True)
    engine, counts = spec.engine, spec.engine.scheduler.spec_decoding
    assert engine.runs_ahead
    in_flight_at_submit: list[int] = []
    submit = engine.worker.submit
    engine.worker.submit = lambda plan: in_flight_at_submit.append(engine.num_plans_in_flight) or submit(plan)
    assert _tokens(spec, prompts, params) == plain
    assert counts.num_accepted_tokens >= 8 and engine.scheduler.spec_step_costs.prices(1) is not None
    assert in_flight_at_submit and 1 not in in_flight_at_submit


# Greedy output repeats its newest token here, which the test heads draft.
REPEATS = "Write the letter a forty times: aaaaaaaaaaaaaaaa"


def _watching_drafts(spec: LLM, prompts: list,
                     params: list[SamplingParams]) -> tuple[list[list[int]], int, int, set[int]]:
    """The requests' tokens, stepping the engine; after each step, every running request's
    drafts for the next are checked: the test heads repeat their first draft (their layer's
    output projections are zero). Also: how many requests' steps got drafts, how many of
    those first drafts were the request's newest token, and every token drafted: of the
    greedy requests without penalties (a sampled request's drafts are drawn, and a
    penalized one's newest token was chosen from adjusted logits, which the head does not
    see)."""
    engine, tokenizer = spec.engine, spec.get_tokenizer()
    outputs: dict[str, list[int]] = {f"watched-{i}": [] for i in range(len(prompts))}
    for request_id, prompt, param in zip(outputs, prompts, params):
        engine.add_request(request_id, tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, param)
    drafted = newest = 0
    tokens: set[int] = set()
    while engine.has_work:
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        for running in engine.scheduler.running:
            if not running.sampling_params.greedy or adjusts(running.sampling_params):
                continue
            drafts = running.draft_token_ids
            assert drafts == drafts[:1] * len(drafts), drafts
            drafted += bool(drafts)
            newest += drafts[:1] == [running.all_token_ids[-1]]
            tokens.update(drafts)
    return list(outputs.values()), drafted, newest, tokens


def test_eagle_greedy_tokens_are_identical_in_a_mixed_batch(llm, mixed_batch, eagle_llm):
    """An EAGLE head fed by the target's hidden states in the same worker: greedy tokens
    identical beside sampled, seeded and penalized requests, with preemption and chunked
    prefill; its drafts both accepted (on repeated letters) and rejected. The test head
    passes the target's last hidden state through the target's LM head: its first draft is
    the target's prediction at the row before the newest token, which is that token, every
    time. Another row, a state before the final norm or a wrong shift would draft others.
    (11 of its drafts accepted here, 7 on a loaded machine: the gate prices a batch's drafts
    at the step costs measured as it runs.)"""
    prompts, params, plain = ([items[i] for i in (0, 1, 4, 5)] for items in mixed_batch)
    repeats = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts, params, plain = [*prompts, REPEATS], [*params, repeats], [*plain, *_tokens(llm, [REPEATS], repeats)]
    scheduler = eagle_llm.engine.scheduler
    counts, preemptions_before = scheduler.spec_decoding, scheduler.num_preemptions
    accepted_before, drafted_before = counts.num_accepted_tokens, counts.num_draft_tokens
    outputs, drafted, newest, _ = _watching_drafts(eagle_llm, prompts, params)
    assert outputs == plain
    assert scheduler.num_preemptions > preemptions_before
    assert drafted >= 12 and newest == drafted, (drafted, newest)
    accepted = counts.num_accepted_tokens - accepted_before
    rejected = counts.num_draft_tokens - drafted_before - accepted
    assert accepted >= 4 and rejected >= 8, (accepted, rejected)


def test_an_eagle3_head_drafts_from_three_layers_through_its_draft_vocabulary(llm, eagle3_llm):
    """The EAGLE-3 test head reads the target's layers 2, 15 and 29 (their inputs) and passes
    the last through its own LM head over a draft vocabulary, which d2t maps back: its first
    draft, the prediction of the last layer's input, is often the newest token (ids from 150
    up sit 50 places lower in the draft vocabulary: a d2t ignored would never draft it), not
    always, and never a token its vocabulary lacks. The tokens are the plain ones."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs, drafted, newest, tokens = _watching_drafts(eagle3_llm, [REPEATS], [params])
    assert outputs == _tokens(llm, [REPEATS], params)
    assert drafted >= 6 and newest >= 3 and tokens <= set(DRAFT_VOCAB), (drafted, newest, tokens)


@pytest.mark.parametrize(("method", "layout"), [("eagle", {"tensor_parallel_size": 2}),
                                                ("eagle3", {"pipeline_parallel_size": 2})])
def test_an_eagle_head_drafts_on_a_group_s_sampling_rank(method, layout, llm, eagle_heads, make_llm):
    """On a TP/PP group the head drafts on the rank that samples, with whole copies of the
    vocabulary where it shares the target's (TP: the target's are slices; PP: the embedding
    is on the first stage). EAGLE-3's layers 2, 15 and 29 sit on both stages of PP=2: layer
    2's input comes over with the first stage's output, in order (the test head reads the
    last). The drafts are those the single-rank tests check; the tokens are the plain ones."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    spec = make_llm(dtype="float32", max_model_len=256, **layout, speculative_config={
        "method": method, "model": str(eagle_heads[method]), "num_speculative_tokens": 3})
    outputs, drafted, newest, tokens = _watching_drafts(spec, [REPEATS], [params])
    assert outputs == _tokens(llm, [REPEATS], params)
    if method == "eagle":
        assert drafted >= 6 and newest == drafted, (drafted, newest)
    else:
        assert drafted >= 6 and newest >= 3 and tokens <= set(DRAFT_VOCAB), (drafted, newest, tokens)
    counts = spec.engine.scheduler.spec_decoding
    assert counts.num_accepted_tokens > 0


def test_structured_outputs_check_each_draft_against_the_grammar(llm, spec_llm):
    """Prompt lookup drafts the code the prompt holds, which the regex (no digits) partly
    forbids: each draft is checked against the grammar before it is verified, so the tokens
    are the plain ones under the same grammar (an unchecked draft, `0` after `total = `, is
    the model's argmax and would be accepted), a sampled request stays inside the regex, and
    the allowed drafts are still accepted."""
    code = r"(def|    )[a-z_ =\(\):\n+]+"  # a bounded repetition ({10,200}) took xgrammar 1.7 s to compile
    # Seeded, so that the sampled request's path, and the drafts it accepts, are the same every run.
    params = [SamplingParams(temperature=temperature, seed=5, max_tokens=32,
                             structured_outputs=StructuredOutputsParams(regex=code)) for temperature in (0.0, 0.8)]
    counts = spec_llm.engine.scheduler.spec_decoding
    accepted_before = counts.num_accepted_tokens
    greedy, sampled = spec_llm.generate([COPY, COPY], params, use_tqdm=False)
    assert list(greedy.outputs[0].token_ids) == _tokens(llm, [COPY], params[0])[0]
    assert re.fullmatch(r"(def|    )[a-z_ =\(\):\n+]*", sampled.outputs[0].text), sampled.outputs[0].text
    assert counts.num_accepted_tokens - accepted_before >= 12


def _recording(calls: list, method: Callable) -> Callable:
    """`method`, each of its results also appended to `calls`."""
    def record(*args: object) -> object:
        calls.append(result := method(*args))
        return result
    return record


def test_suffix_drafts_from_past_outputs(llm, suffix_llm, monkeypatch):
    """A prompt asked again (a retry, an agent's loop) is drafted from the first answer,
    kept in the global tree: nearly every draft accepted, the same tokens. The steps' worker
    times reach the step costs that price the drafts (scheduler_svc/spec_step_cost.py)."""
    prompt = "Write a short poem about the sea."
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    scheduler = suffix_llm.engine.scheduler
    counts, speculation = scheduler.spec_decoding, scheduler.speculation
    # What was proposed and chosen, for the failure's message (it failed once in CI with no draft verified).
    proposed: list[tuple[list[int], list[float]]] = []
    chosen: list[dict[str, list[int]]] = []
    monkeypatch.setattr(speculation.proposer, "propose", _recording(proposed, speculation.proposer.propose))
    monkeypatch.setattr(speculation.gate, "choose", _recording(chosen, speculation.gate.choose))
    plain = _tokens(llm, [prompt], params)
    rates = []
    for _ in range(2):
        before = counts.num_draft_tokens, counts.num_accepted_tokens
        assert _tokens(suffix_llm, [prompt], params) == plain
        rates.append((counts.num_accepted_tokens - before[1]) / max(1, counts.num_draft_tokens - before[0]))
    prices = scheduler.spec_step_costs.prices(4)
    assert rates[0] < 0.5 < 0.9 < rates[1], (
        f"rates {rates}; drafts proposed {[len(drafts) for drafts, _ in proposed]}, chosen "
        f"{[sum(map(len, drafts.values())) for drafts in chosen]}; the gate's prior {speculation.gate.prior}; "
        f"prices {prices}")
    assert prices is not None and all(0 < seconds < 10 for seconds in prices), prices


def test_penalties_bans_and_biases_adjust_each_verified_position(llm, spec_llm):
    """Each verified position is adjusted as its token decoded alone would be: the drafts
    before it count as output (penalties, bad words, min_tokens), so the greedy tokens are
    the plain ones, alone and together, and drafts pass. (On the repeated letters, a draft
    counted as output makes the small frequency penalty end the run where plain decoding
    does: not counted, 25 drafts passed and the run went on.)"""
    result = llm.get_tokenizer().encode(" result")
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.15),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=1.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=35, logit_bias={result[0]: 2.0}),
        SamplingParams(temperature=0.0, max_tokens=40, bad_words=[" result + value"]),
        SamplingParams(temperature=0.0, max_tokens=60, frequency_penalty=0.05, ignore_eos=True),
    ]
    prompts = [COPY] * 4 + [REPEATS]
    plain = _tokens(llm, prompts, params)
    counts = spec_llm.engine.scheduler.spec_decoding
    accepted_before = counts.num_accepted_tokens
    for prompt, one, expected in zip(prompts, params, plain):
        assert _tokens(spec_llm, [prompt], one) == [expected]
    assert _tokens(spec_llm, prompts, params) == plain
    assert counts.num_accepted_tokens - accepted_before >= 8


def test_seeded_requests_speculate_and_emit_their_plain_tokens(llm, spec_llm):
    """A seeded row draws plain sampling's token at its position and accepts a draft equal
    to it: the tokens are the plain engine's, alone and beside other seeded requests."""
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=40, ignore_eos=True) for seed in (3, 4)]
    plain = _tokens(llm, [COPY] * 2, params)
    counts = spec_llm.engine.scheduler.spec_decoding
    accepted_before = counts.num_accepted_tokens
    assert _tokens(spec_llm, [COPY], params[0]) == plain[:1]
    assert _tokens(spec_llm, [COPY] * 2, params) == plain
    assert counts.num_accepted_tokens - accepted_before >= 8


def test_a_worker_role_over_grpc_verifies_the_drafts_in_the_step_they_ride_in(llm):
    """The cluster's path: the scheduler's engine and a worker role over gRPC. The drafts
    ride in the step plan and come back verified in its result: one ExecuteStep a step,
    no round trip of their own; the tokens are the plain ones."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = [llm.get_tokenizer().encode(prompt) for prompt in (COPY, REPEATS)]
    plain = _tokens(llm, [{"prompt_token_ids": p} for p in prompts], params)
    port = free_port()
    worker = RoleProcess("worker", "--dtype", "float32", "--max-model-len", "384", "--port", str(port))
    try:
        remote = RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=120)
        core = EngineCore(EngineConfig(speculative_config=json.dumps(NGRAM), max_model_len=384), remote)
        plans: list[StepPlan] = []
        execute = remote.execute
        remote.execute = lambda plan: plans.append(plan) or execute(plan)
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {"0": [], "1": []}
        steps = 0
        while core.has_work:
            steps += 1
            for delta in core.step():
                tokens[delta.request_id] += delta.new_token_ids
        assert [tokens["0"], tokens["1"]] == plain
        assert len(plans) == steps and sum(bool(plan.scheduled_spec_decode_tokens) for plan in plans) >= 4
        assert core.scheduler.spec_decoding.num_accepted_tokens >= 8
    finally:
        worker.kill()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_draft_model_drafts_on_a_group_s_sampling_rank(layout, llm, draft, make_llm):
    """A draft model is a whole model of its own, needing no collective: on a TP/PP group
    it runs on the rank that samples, over the step's tokens, and the others never see it.
    The tokens are one rank's; drafts are accepted and rejected."""
    prompts, params = [COPY, REPEATS], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = _tokens(llm, prompts, params)
    spec = make_llm(dtype="float32", max_model_len=256, speculative_config=draft, **layout)
    assert _tokens(spec, prompts, params) == plain
    counts = spec.engine.scheduler.spec_decoding
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def test_a_held_back_request_gets_one_draft_from_the_draft_model(llm, draft_llm):
    """A request whose drafts the gate holds back is drafted only its first token (the one
    the gate judges it by), not k: the plan names it in draft_probes. Started held back
    (a prior of 0), the requests speculate again once their first drafts pass, and are
    drafted 3 tokens then; the tokens are the plain ones."""
    engine = draft_llm.engine
    prompts, params = [COPY, REPEATS], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = _tokens(llm, prompts, params)
    execute, steps = engine.worker.execute, []
    engine.worker.execute = lambda plan: (result := execute(plan), steps.append((plan, result)))[0]
    gate, prior = engine.scheduler.speculation.gate, engine.scheduler.speculation.gate.prior
    gate.prior = 0.0
    try:
        assert _tokens(draft_llm, prompts, params) == plain
    finally:
        engine.worker.execute, gate.prior = execute, prior
    probed = [len(drafts) for plan, result in steps for request_id, drafts in result.draft_token_ids.items()
              if request_id in plan.draft_probes]
    full = [len(drafts) for plan, result in steps for request_id, drafts in result.draft_token_ids.items()
            if request_id not in plan.draft_probes]
    assert probed and set(probed) == {1}, probed
    assert full.count(3) >= 4, full


def test_no_drafts_while_disable_by_batch_size_requests_run(suffix_llm):
    """vLLM's disable_by_batch_size: no step with 6 requests running verifies drafts; with
    fewer, the same answers draft from one another's outputs (in how many steps depends on
    the step costs measured as they run: the gate prices each step's drafts)."""
    engine, scheduler = suffix_llm.engine, suffix_llm.engine.scheduler
    prompt = suffix_llm.get_tokenizer().encode("Name three colours of the sea.")
    for i, max_tokens in enumerate([6, 6, 6, 6, 12, 24, 32]):
        engine.add_request(f"batch-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True))
    drafted_when = {"at 6 or more": 0, "fewer": 0}
    while engine.has_work:
        running, before = len(scheduler.running), scheduler.spec_decoding.num_drafts
        engine.step()
        drafted_when["at 6 or more" if running >= 6 else "fewer"] += scheduler.spec_decoding.num_drafts - before
    assert drafted_when["at 6 or more"] == 0 and drafted_when["fewer"] >= 1, drafted_when


def test_logprobs_of_accepted_tokens_are_the_plain_ones(llm, spec_llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    [plain], [spec] = (llm.generate([COPY], params, use_tqdm=False) for llm in (llm, spec_llm))
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    for mine, theirs in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert list(mine) == list(theirs)
        # A verify step's rows go through the 4-bit kernels and attention several at a time, over
        # the float16 cache GGUF weights get by default: they round apart from a one-row decode's
        # (at most 0.003 measured on an AVX2 CPU, 0.006 on an AVX-512 one).
        assert all(mine[t] == pytest.approx(theirs[t], abs=1e-2) for t in mine)


def _inside_a_run(spec_llm: LLM) -> tuple[list[int], int]:
    """The greedy output of COPY, and the index of a token that arrived inside a run of
    accepted tokens (not first in its step's delta), whose first occurrence it is."""
    engine = spec_llm.engine
    prompt = spec_llm.get_tokenizer().encode(COPY)
    engine.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=60))
    output, candidates = [], []
    while engine.has_work:
        for delta in engine.step():
            candidates += [len(output) + i for i, token in enumerate(delta.new_token_ids)
                           if i and token not in output + delta.new_token_ids[:i]]
            output += delta.new_token_ids
    assert candidates, "no run of accepted tokens"
    return output, candidates[len(candidates) // 2]


def test_stops_inside_an_accepted_run_truncate_it(llm, spec_llm):
    output, index = _inside_a_run(spec_llm)
    stop_token = output[index]
    stop_text = llm.get_tokenizer().decode(output[index - 1:index + 1])
    cases = [SamplingParams(temperature=0.0, max_tokens=index + 1),
             SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0.0, max_tokens=60, stop=[stop_text])]
    for params in cases:
        [plain], [spec] = (model.generate([COPY], params, use_tqdm=False) for model in (llm, spec_llm))
        got, want = spec.outputs[0], plain.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
    assert plain.outputs[0].token_ids[: index + 1] == output[: index + 1]


def test_the_prefix_cache_holds_only_accepted_tokens(llm, spec_llm):
    """A second request over the first's prompt and output reads its cached blocks: they
    must hold the accepted tokens' KV, not a rejected draft's."""
    # Earlier tests cached COPY's blocks: a block computed again is not indexed twice, and the
    # small pool may evict the old one meanwhile, so start from an empty cache.
    spec_llm.engine.scheduler.block_pool.reset_prefix_cache()
    [first] = spec_llm.generate([COPY], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    more = llm.get_tokenizer().encode("\n\nNow rename `value` to `item` too:\n\n```python\n")
    follow_up = {"prompt_token_ids": [*first.prompt_token_ids, *first.outputs[0].token_ids, *more]}
    params = SamplingParams(temperature=0.0, max_tokens=24)
    [plain], [spec] = (model.generate([follow_up], params, use_tqdm=False) for model in (llm, spec_llm))
    assert spec.num_cached_tokens > len(first.prompt_token_ids) + 16  # blocks of the first's output
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids


def test_sampled_requests_run_and_counters_are_vllms(spec_llm):
    before = spec_llm.engine.stats().spec_decoding
    outputs = spec_llm.generate([COPY] * 3, SamplingParams(temperature=0.7, max_tokens=48), use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outputs)
    stats = spec_llm.engine.stats()
    spec = stats.spec_decoding
    assert spec.num_drafts > before.num_drafts and spec.num_draft_tokens > before.num_draft_tokens
    assert len(spec.num_accepted_tokens_per_pos) == 4
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens <= spec.num_draft_tokens
    # An accepted draft at position i was preceded by accepted ones at every earlier position.
    assert spec.num_accepted_tokens_per_pos == sorted(spec.num_accepted_tokens_per_pos, reverse=True)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(spec_llm.engine, "smollm2"))
    text = generate_latest(registry).decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="smollm2"}} {float(spec.num_drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="smollm2"}} {float(spec.num_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="smollm2"}} {float(spec.num_accepted_tokens)}' in text
    first = spec.num_accepted_tokens_per_pos[0]
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="smollm2",position="0"}} {float(first)}'
            in text)
    # A cluster's gateway sums its replicas.
    fleet = total([stats, stats]).spec_decoding
    assert fleet.num_drafts == 2 * spec.num_drafts
    assert fleet.num_accepted_tokens_per_pos == [2 * n for n in spec.num_accepted_tokens_per_pos]


@pytest.mark.parametrize(("config", "engine_args", "message"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, {},
     "method 'medusa': kvfleet implements ngram, suffix, draft_model, eagle, eagle3 only"),
    ({"method": "eagle", "num_speculative_tokens": 2}, {}, "method 'eagle' needs \"model\": the directory of an EAGLE head"),
    ({"method": "mtp", "num_speculative_tokens": 1}, {}, "the Llama and Qwen2 models kvfleet serves have none"),
    ({"method": "eagle3", "model": "/no/such/head", "num_speculative_tokens": 2}, {},
     "model '/no/such/head': no config.json there"),
    ({"method": "ngram"}, {}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "eagle_head": "x"}, {}, "eagle_head: not supported"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, {},
     "prompt_lookup_min 5 is more than prompt_lookup_max 3"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, {},
     "suffix_decoding_min_token_prob 2: give a number between 0.0 and 1.0"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 64}, {}, "num_speculative_tokens 64: at most 32"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "method 'draft_model' needs \"model\""),
    ({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2}, {},
     "model '/no/such/draft': model '/no/such/draft' is not a known alias"),
])
def test_a_config_that_cannot_work_is_refused_before_loading(config, engine_args, message):
    with pytest.raises(ConfigError, match="--speculative-config") as refused:
        LLM("smollm2", speculative_config=config, **engine_args)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("method", "head", "message"), [
    ("eagle", "eagle3", "fc.weight is 576x1728; an eagle head for a target of hidden size 576 has 576x1152: it is an "
                        "EAGLE-3 head (use method 'eagle3')"),
    ("eagle3", "eagle", "it is an EAGLE head (use method 'eagle')"),
])
def test_an_eagle_head_that_does_not_fit_is_refused_before_loading(method, head, message, eagle_heads):
    with pytest.raises(ConfigError, match="--speculative-config model") as refused:
        LLM("smollm2", speculative_config={"method": method, "model": str(eagle_heads[head]),
                                           "num_speculative_tokens": 2})
    assert message in str(refused.value) and "\n" not in str(refused.value)
