"""The persistent batch: a request's block table and sampling settings are written once;
a step uploads only what is new in it, however much context the requests hold."""
from __future__ import annotations

import torch

from kvfleet import SamplingParams
from services.messages import StepPlan
from worker_svc.runtime.batch import InputBatch, RequestState

BLOCK = 16


def _state(num_tokens: int, num_computed: int, **params) -> RequestState:
    return RequestState(list(range(num_tokens)), num_tokens, num_computed, SamplingParams(**params), None)


def _reference_slots(tables: list[list[int]], starts: list[int], counts: list[int]) -> list[int]:
    return [tables[i][pos // BLOCK] * BLOCK + pos % BLOCK
            for i, (start, count) in enumerate(zip(starts, counts)) for pos in range(start, start + count)]


def test_a_decode_step_uploads_its_tokens_and_rows_not_the_block_tables() -> None:
    batch = InputBatch(max_blocks_per_request=64, block_size=BLOCK, device=torch.device("cpu"))
    requests, tables = {}, {}
    for i, context in enumerate((900, 40, 500)):  # long contexts: 57, 3 and 32 blocks
        num_blocks = -(-(context + 1) // BLOCK)
        tables[f"r{i}"] = list(range(100 * i, 100 * i + num_blocks))
        requests[f"r{i}"] = _state(context + 1, context, temperature=0.5 * i, top_k=i)
        batch.add(requests[f"r{i}"], tables[f"r{i}"])
    plan = StepPlan(step_id=1, num_scheduled_tokens={"r0": 1, "r1": 1, "r2": 1})

    batch.uploaded_bytes = 0
    inputs = batch.prepare(plan, requests)
    # Per request: its row, count and length, its token with its position and request, its sample
    # row and sampling row; 8 bytes each.
    assert batch.uploaded_bytes == 3 * 8 * 8
    starts = [900, 40, 500]
    assert inputs.positions.tolist() == starts
    assert inputs.layout.slot_mapping.tolist() == _reference_slots(list(tables.values()), starts, [1, 1, 1])
    assert inputs.layout.seq_lens.tolist() == [901, 41, 501] and inputs.layout.max_query_len == 1
    width = inputs.layout.block_tables.shape[1]
    assert width == 57 and inputs.layout.block_tables[1, :3].tolist() == tables["r1"]
    assert inputs.sampling.temperature.tolist() == [0.0, 0.5, 1.0] and inputs.sampling.top_k.tolist() == [0, 1, 2]

    # A plan's delta appends one block id: 4 bytes, the rest of the table stays where it is.
    for state in requests.values():
        state.num_computed_tokens += 1
        state.token_ids.append(7)
    batch.uploaded_bytes = 0
    batch.append_blocks(requests["r1"].row, [555])
    assert batch.uploaded_bytes == 4
    assert batch.block_table[requests["r1"].row, :4].tolist() == tables["r1"] + [555]


def test_a_temperature_past_float32_is_inf_not_an_error() -> None:
    batch = InputBatch(max_blocks_per_request=4, block_size=BLOCK, device=torch.device("cpu"))
    state = _state(5, 0, temperature=1e308)  # valid JSON, valid SamplingParams: no step may fail on it
    batch.add(state, [0])
    assert batch.temperature[state.row] == float("inf")


def test_rows_are_reused_and_the_batch_grows_past_its_first_rows() -> None:
    batch = InputBatch(max_blocks_per_request=4, block_size=BLOCK, device=torch.device("cpu"))
    states = [_state(5, 0) for _ in range(100)]
    for i, state in enumerate(states):
        batch.add(state, [i % 50, 50 + i % 50])
    assert sorted(state.row for state in states) == list(range(100))
    freed = states[10].row
    batch.remove(states[10])
    newcomer = _state(3, 0, temperature=2.0)
    batch.add(newcomer, [9])
    assert newcomer.row == freed
    assert batch.block_table[freed, :1].tolist() == [9] and batch.temperature[freed] == 2.0
    # A reused row's stale ids beyond its own count are never read: the step's width and slots stop at its length.
    requests = {"new": newcomer, "old": states[11]}
    inputs = batch.prepare(StepPlan(step_id=2, num_scheduled_tokens={"new": 3, "old": 5}), requests)
    assert inputs.layout.slot_mapping.tolist() == _reference_slots([[9], [11, 61]], [0, 0], [3, 5])
    assert inputs.sample_request_ids == ["new", "old"] and inputs.sample_rows.tolist() == [2, 7]


def test_a_worker_decode_step_uploads_bytes_in_proportion_to_its_requests(make_llm) -> None:
    """Through the real worker: after the prompts, every decode step of 4 requests holding
    hundreds of tokens each uploads the same few bytes, however long their contexts grow."""
    llm = make_llm(max_model_len=1024, dtype="float32")
    worker, engine = llm.engine.worker, llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", list(range(100 + i, 400 + i)), SamplingParams(max_tokens=40, ignore_eos=True))
    uploads = []
    while engine.has_work:
        worker.batch.uploaded_bytes = 0
        engine.step()
        uploads.append(worker.batch.uploaded_bytes)
    # The prompts' step, 39 decode steps, and the plan that only tells the worker they finished.
    prompts, decodes, finish = uploads[0], uploads[1:-1], uploads[-1]
    assert len(decodes) == 39 and prompts > 4 * 300 * 8 and finish == 0, str(uploads)
    # 8 numbers per request, and 4 bytes for each block id a plan appends: the 4 requests
    # cross a block boundary together 3 times.
    assert min(decodes) == 4 * 8 * 8 and sum(decodes) == 39 * 4 * 8 * 8 + 3 * 4 * 4, str(uploads)
