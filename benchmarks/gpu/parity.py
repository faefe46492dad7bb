"""Section 2: kvfleet's greedy tokens against transformers' on a small random Llama, in
float32, through the Triton backend with decode steps replayed from CUDA graphs.

The prompts are long enough to be prefilled in chunks, two in three share a
prefix (prefix-cache hits: chunks after cached blocks), and fewer sequences may run
than there are prompts, so decode batches shrink and grow through the ladder's padded
sizes. On a GPU the worker captures its graphs itself; on a CPU, where it would not,
they are attached as tests/worker_svc/test_triton_engine.py does, so that the static
buffers and their padding still run (eagerly). Random weights drawn wide (0.2) make
the top logit clear, so that float32 rounding differences between two correct engines
do not flip a greedy choice. Then the same prompts twice more: through the offload
tiers, and with speculative drafts verified in graphs of 1 + k rows per request.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import CPU_LADDER, Profile, free_device, target
from benchmarks.gpu.models import random_llama, random_prompts, save_checkpoint
from kvfleet import SamplingParams
from kvfleet.llm import LLM
from worker_svc.runtime.cuda_graphs import DecodeGraphs

MAX_NUM_SEQS = 4  # below the prompt count: requests wait, and decode batches take odd sizes


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompts(profile: Profile, vocab_size: int) -> list[list[int]]:
    shared = random_prompts([2 * profile.block_size + 3], vocab_size, seed=1)[0]
    own = random_prompts(profile.parity_prompt_lens, vocab_size, seed=2)
    return [shared + tokens if index % 3 else tokens for index, tokens in enumerate(own)]


def run(profile: Profile, workdir: Path) -> dict[str, Any]:
    device = profile.device
    model = random_llama(profile.parity_model, torch.float32, device, seed=0)
    vocab_size = model.config.vocab_size
    path = save_checkpoint(model, workdir / "parity-llama")
    prompts = _prompts(profile, vocab_size)
    new_tokens = profile.parity_new_tokens
    expected = [hf_greedy(model, prompt, new_tokens) for prompt in prompts]
    del model
    free_device()

    longest = max(map(len, prompts)) + new_tokens
    blocks = sum(-(-(len(prompt) + new_tokens) // profile.block_size) for prompt in prompts)
    llm = LLM(str(path), dtype="float32", device=device.type, attention_backend="triton",
              max_model_len=longest, block_size=profile.block_size, num_gpu_blocks_override=blocks,
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=max(2 * profile.block_size, longest // 4),
              enable_prefix_caching=True, enable_chunked_prefill=True)
    worker = llm.engine.worker
    captured = worker.graphs is not None
    if device.type == "cpu":
        worker.graphs = DecodeGraphs(worker.model, worker.attention_backend, worker.kv_caches, CPU_LADDER,
                                     worker.batch.max_blocks, worker.block_size, worker.device)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    scheduler = llm.engine.scheduler
    prefix_hits = scheduler.prefix_cache_hits
    llm.engine.worker.close()
    del llm, worker
    free_device()

    tiers = _offload_tiers(path, profile, prompts, expected, workdir)
    speculative = _speculative(path, profile, prompts, expected)
    mismatches = [
        {"prompt": index, "first_difference": next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
         if len(mine) == len(theirs) else min(len(mine), len(theirs)), "kvfleet": mine, "transformers": theirs}
        for index, (mine, theirs) in enumerate(zip(got, expected)) if mine != theirs
    ]
    exact = not mismatches
    targets = [target("greedy tokens equal transformers'", exact, "all prompts", exact),
               target("greedy tokens equal with blocks from the offload tiers", tiers["exact"], "all prompts",
                      tiers["exact"]),
               target("greedy tokens equal with drafts verified in CUDA graphs", speculative["exact"],
                      "all prompts, every draft accepted", speculative["exact"] and speculative["all_accepted"])]
    if device.type == "cuda":
        targets.append(target("decode CUDA graphs captured", captured, "true", captured))
    return {
        "prompt_lens": list(map(len, prompts)), "new_tokens": new_tokens, "exact": exact,
        "matching_prompts": len(prompts) - len(mismatches), "mismatches": mismatches,
        "cuda_graphs_captured": captured, "graphs": "captured" if captured else f"CPU buffers, ladder {CPU_LADDER}",
        "prefix_cache_hits": prefix_hits, "offload_tiers": tiers,
        "speculative": speculative, "targets": targets,
        "notes": [f"{len(prompts) - len(mismatches)}/{len(prompts)} prompts give transformers' {new_tokens} tokens; "
                  f"decode graphs: {'captured' if captured else 'CPU buffers'}"],
    }


def _speculative(path: Path, profile: Profile, prompts: list[list[int]], expected: list[list[int]]
                 ) -> dict[str, Any]:
    """The same prompts with the model drafting 3 tokens for itself (draft_model), so every
    draft is accepted unless verifying differs from decoding: decodes with their drafts
    replay graphs of 4 rows per request (worker_svc/runtime/cuda_graphs.py), and the draft
    replays graphs of its own."""
    new_tokens = profile.parity_new_tokens
    longest = max(map(len, prompts)) + new_tokens
    llm = LLM(str(path), dtype="float32", device=profile.device.type, attention_backend="triton",
              max_model_len=longest, block_size=profile.block_size, max_num_seqs=MAX_NUM_SEQS,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})
    worker = llm.engine.worker
    drafter = worker.drafter
    if profile.device.type == "cpu":
        for owner, model, backend, kv_caches in ((worker, worker.model, worker.attention_backend, worker.kv_caches),
                                                 (drafter, drafter.model, drafter.backend, drafter.kv_caches)):
            owner.graphs = DecodeGraphs(model, backend, kv_caches, CPU_LADDER, worker.batch.max_blocks,
                                        worker.block_size, worker.device, spec_tokens=3)
    widths = worker.graphs.widths if worker.graphs is not None else ()
    draft_graphs = drafter.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    got = [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]
    counts = llm.engine.scheduler.spec_decoding
    worker.close()
    del llm, worker, drafter
    free_device()
    return {"exact": got == expected, "graph_rows_per_request": list(widths), "draft_graphs": draft_graphs,
            "draft_tokens": counts.num_draft_tokens, "accepted_tokens": counts.num_accepted_tokens,
            "all_accepted": counts.num_accepted_tokens == counts.num_draft_tokens > 0}


def _offload_tiers(path: Path, profile: Profile, prompts: list[list[int]], expected: list[list[int]],
                   workdir: Path) -> dict[str, Any]:
    """The same prompts, twice, through a pool that holds one of them at a time, over host
    memory (pinned, on a GPU) in front of a disk tier: the second round's prompts come
    back from the tiers (docs/kv_connector.md)."""
    new_tokens = profile.parity_new_tokens
    longest = max(map(len, prompts)) + new_tokens
    llm = LLM(str(path), dtype="float32", device=profile.device.type, attention_backend="triton",
              max_model_len=longest, block_size=profile.block_size,
              num_gpu_blocks_override=-(-longest // profile.block_size) + 1, max_num_seqs=MAX_NUM_SEQS,
              kv_offloading_size=0.01, kv_offloading_dir=str(workdir / "kv-tier"))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rounds = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
              for _ in range(2)]
    stats = llm.engine.stats()
    llm.engine.worker.close()
    del llm
    free_device()
    return {"exact": all(got == expected for got in rounds),
            "loaded_blocks": {tier.medium: tier.loaded_blocks for tier in stats.kv_tiers},
            "external_prefix_cache_hits": stats.external_prefix_cache_hits}
