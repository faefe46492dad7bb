"""The GPU worker's path on this CPU: --attention-backend triton runs paged attention and
the fused decoder kernels through Triton's interpreter. A tiny random Llama gives
transformers' greedy tokens under preemption, prefix caching and chunked prefill, and
again when its decode steps go through the CUDA-graph buffers (padded to the ladder)."""
from __future__ import annotations

import pytest
import torch

from kvfleet import SamplingParams
from services.model_source import resolve_model
from worker_svc.attention.gpu import TritonAttentionBackend
from worker_svc.model.ops import TritonOps
from worker_svc.model.weights import load_weights
from worker_svc.runtime.cuda_graphs import DecodeGraphs

from conftest import hf_greedy, save_tiny_llama
from eagle_heads import write_eagle_head

LADDER = (1, 2, 4, 8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 7 prompts in 16 blocks of 16: some preempt; long ones chunk; three share a 40-token prefix.
PRESSURE = dict(dtype="float32", block_size=16, num_gpu_blocks_override=16, max_model_len=256,
                max_num_batched_tokens=64, enable_prefix_caching=True, enable_chunked_prefill=True,
                attention_backend="triton")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """3 query heads per KV head (a group padded in the kernels), head dim 32, 2 layers."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-triton"), vocab_size=49152, hidden_size=192,
                           intermediate_size=256, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                           max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_llama) -> tuple[list[list[int]], list[list[int]]]:
    _, hf_model = tiny_llama
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(100, 49152, (40,), generator=generator).tolist()
    prompts = []
    for i, length in enumerate((3, 17, 30, 61, 9, 90, 25)):
        own = torch.randint(100, 49152, (length,), generator=generator).tolist()
        prompts.append(shared + own if i % 3 == 1 else own)
    return prompts, [hf_greedy(hf_model, prompt, GREEDY.max_tokens) for prompt in prompts]


def _generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_triton_backend_gives_transformers_tokens(tiny_llama, prompts_and_expected, make_llm) -> None:
    path, _ = tiny_llama
    prompts, expected = prompts_and_expected
    llm = make_llm(str(path), **PRESSURE)
    worker = llm.engine.worker
    assert isinstance(worker.attention_backend, TritonAttentionBackend) and isinstance(worker.model.ops, TritonOps)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.prefix_cache_hits > 0


def test_decode_steps_replayed_through_the_graph_buffers_give_the_same_tokens(
    tiny_llama, prompts_and_expected, make_llm
) -> None:
    """On CPU a 'replay' runs the model on the static buffers, so the padding (to sizes 1,
    2, 4 or 8: no-op slots, zero-length rows) and the fixed-width tables are what is tested."""
    path, _ = tiny_llama
    prompts, expected = prompts_and_expected
    llm = make_llm(str(path), **PRESSURE)
    worker = llm.engine.worker
    worker.graphs = graphs = DecodeGraphs(worker.model, worker.attention_backend, worker.kv_caches, LADDER,
                                          worker.batch.max_blocks, worker.block_size, worker.device)
    replayed = []
    forward = graphs.forward
    graphs.forward = lambda *args: replayed.append(out := forward(*args)) or out
    assert _generate(llm, prompts) == expected
    used = [len(out) for out in replayed if out is not None]
    assert any(size not in LADDER for size in used), used  # padded batches among them
    assert any(out is None for out in replayed)  # the prompt steps ran eagerly


def test_verification_steps_replayed_through_the_graph_buffers_give_the_same_tokens(
    tiny_llama, prompts_and_expected, make_llm
) -> None:
    """A step of decodes and their drafts (and short prompt chunks) runs in graphs of 1 + k
    rows per request, each request's rows padded at their end. The target drafts for itself
    (draft_model, with graphs of its own), so every draft is accepted unless the graphs'
    verification, or the draft's replayed decodes, differ from the eager ones."""
    path, hf_model = tiny_llama
    prompts = prompts_and_expected[0][:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [hf_greedy(hf_model, prompt, params.max_tokens) for prompt in prompts]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = make_llm(str(path), **PRESSURE, speculative_config=spec)
    worker = llm.engine.worker
    worker.graphs = graphs = DecodeGraphs(worker.model, worker.attention_backend, worker.kv_caches, LADDER,
                                          worker.batch.max_blocks, worker.block_size, worker.device, spec_tokens=3)
    drafter = worker.drafter  # its own graphs: its decodes, and its run over the target's steps
    drafter.graphs = DecodeGraphs(drafter.model, drafter.backend, drafter.kv_caches, LADDER, worker.batch.max_blocks,
                                  worker.block_size, worker.device, spec_tokens=3)
    draft_replays = []
    draft_forward = drafter.graphs.forward
    drafter.graphs.forward = lambda *args: draft_replays.append(out := draft_forward(*args)) or out
    replayed = []  # (rows per request, rows, requests) of each step that replayed; None: eager
    forward = graphs.forward

    def recorded(inputs, positions, layout, row_starts):
        out = forward(inputs, positions, layout, row_starts)
        replayed.append((layout.max_query_len, len(positions), len(row_starts)) if out is not None else None)
        return out

    graphs.forward = recorded
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    verifying = [step for step in replayed if step is not None and step[0] == 4]
    assert any(rows < 4 * requests for _, rows, requests in verifying), replayed  # requests padded
    assert None in replayed  # long prompt chunks ran eagerly
    assert sum(out is not None for out in draft_replays) > len(verifying)  # the draft's decodes replayed too
    counts = llm.engine.scheduler.spec_decoding
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0


def test_an_eagle_head_s_drafts_replay_its_own_graphs(tiny_llama, prompts_and_expected, make_llm, tmp_path) -> None:
    """The EAGLE test head (tests/eagle_heads.py) drafts the newest token (the target's own
    prediction at the row before it, passed through), then repeats it: its layer's output
    projections are zero, so each further draft is its own last one again. Its forward over
    a step of decodes with their drafts (1 + k rows a request) and its further drafts (one
    row) replay the head's graphs, its embeddings and hidden states through the static
    buffers: a row's inputs mixed up there would draft something else. The tokens are
    transformers'."""
    path, _ = tiny_llama
    prompts, expected = prompts_and_expected
    config, weights = load_weights(resolve_model(str(path)), torch.float32)
    head = write_eagle_head(tmp_path, "eagle", config, weights)
    llm = make_llm(str(path), **PRESSURE, speculative_config={"method": "eagle", "model": str(head),
                                                                 "num_speculative_tokens": 3})
    worker = llm.engine.worker
    drafter = worker.drafter
    row = (torch.float32, (config.hidden_size,))
    drafter.graphs = DecodeGraphs(drafter.model, drafter.backend, drafter.kv_caches, LADDER, worker.batch.max_blocks,
                                  worker.block_size, worker.device, spec_tokens=3, inputs=(row, row))
    replayed, results = [], []
    forward, execute = drafter.graphs.forward, worker.execute

    def recorded(inputs, positions, layout, row_starts):
        out = forward(inputs, positions, layout, row_starts)
        replayed.append(layout.max_query_len if out is not None else None)
        return out

    drafter.graphs.forward = recorded
    worker.execute = lambda plan: (result := execute(plan), results.append(result))[0]
    assert _generate(llm, prompts) == expected
    assert replayed.count(1) >= 4 and {2, 3, 4} & set(replayed), replayed  # further drafts; verification steps
    drafts = [(result.sampled_token_ids[request_id][-1], tokens) for result in results
              for request_id, tokens in result.draft_token_ids.items()]
    assert sum(len(tokens) == 3 for _, tokens in drafts) >= 4
    assert all(tokens == [newest] * len(tokens) for newest, tokens in drafts), drafts
