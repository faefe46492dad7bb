"""Section 5: speculative decoding (n-gram, the configuration vLLM users pass) on the engine
section's random-weight Llama-3-8B-shaped model, in bfloat16 with CUDA graphs.

(a) What a verification step costs: the worker's graphs replayed (through their public
forward, host copies included) for B requests of 1 + k rows at a context of 8 x the
profile's single prompt (1024 tokens on the GPU), against the same B requests decoding one
row each. With acceptance a per draft, speculation pays while (1 - a^(k+1)) / (1 - a)
tokens a step outweigh that ratio: the number that says what speculation can gain on this
GPU, whatever the drafts.

(b) Tokens/s against plain decoding on random-token prompts, greedy, at 1 and 8 requests
(on the GPU; 1 and 2 in the dry run):
random weights copy nothing on purpose, so this measures what proposing and verifying
cost when little is accepted (the issue's bound: at most 5% slower), with the acceptance
seen. Copy-heavy text needs trained weights, which the GPU machine cannot carry. Whether
the greedy tokens equal plain decoding's is reported, not a target: this model's default
initialisation leaves its logits nearly flat, so bfloat16 rounding that differs between a
verification row and a decode row may flip a choice (the parity section checks identity
where a wide initialisation makes the top logit clear).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import CPU_LADDER, Profile, free_device, target, time_calls
from benchmarks.gpu.models import random_llama, random_prompts, save_checkpoint
from kvfleet import SamplingParams
from kvfleet.llm import LLM
from worker_svc.attention.backend import BatchLayout
from worker_svc.runtime.cuda_graphs import DecodeGraphs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def _checkpoint(profile: Profile, workdir: Path) -> Path:
    """The engine section's checkpoint when it ran before this one, else the same model built here."""
    path = workdir / "engine-llama"
    if not (path / "config.json").is_file():
        model = random_llama(profile.engine_model, profile.engine_dtype, profile.device, seed=3)
        save_checkpoint(model, path)
        del model
        free_device()
    return path


def _llm(path: Path, profile: Profile, context: int, speculative: bool) -> LLM:
    # On a CPU the KV budget is given in blocks (4 GiB by default would be zeroed for nothing).
    blocks = max(profile.spec_concurrency) * -(-(context + profile.single_new_tokens) // profile.block_size) + 8
    cpu = {"num_gpu_blocks_override": blocks} if profile.device.type == "cpu" else {}
    llm = LLM(str(path), dtype=str(profile.engine_dtype).removeprefix("torch."), device=profile.device.type,
              attention_backend="triton", max_model_len=context + profile.single_new_tokens + 8,
              block_size=profile.block_size, max_num_seqs=max(profile.spec_concurrency),
              speculative_config=NGRAM if speculative else None, **cpu)
    worker = llm.engine.worker
    if profile.device.type == "cpu":  # as the parity section: the graph buffers, run eagerly
        worker.graphs = DecodeGraphs(worker.model, worker.attention_backend, worker.kv_caches, CPU_LADDER,
                                     worker.batch.max_blocks, worker.block_size, worker.device,
                                     NGRAM["num_speculative_tokens"] if speculative else 0)
    return llm


def _step_ms(graphs: DecodeGraphs, profile: Profile, requests: int, rows: int, context: int,
             num_blocks: int, vocab: int) -> float:
    """One step of `requests` requests of `rows` rows each, their keys `context` long, replayed."""
    device, block_size = profile.device, profile.block_size
    width = -(-(context + rows) // block_size)
    tables = (torch.arange(requests * width, device=device, dtype=torch.int32) % num_blocks).view(requests, width)
    layout = BatchLayout(torch.full((requests,), rows, dtype=torch.int32, device=device),
                         torch.full((requests,), context + rows, dtype=torch.int32, device=device), tables,
                         torch.full((requests * rows,), -1, dtype=torch.long, device=device), block_size, rows)
    ids = torch.randint(1, vocab, (requests * rows,), device=device)
    positions = torch.arange(context, context + rows, device=device).repeat(requests)
    starts = list(range(0, requests * rows, rows))
    assert graphs.forward((ids,), positions, layout, starts) is not None, "no graph covers the step"
    times = time_calls(lambda: graphs.forward((ids,), positions, layout, starts), device, profile.warmup,
                       profile.iters)
    return 1e3 * statistics.median(times)


def _tokens_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    began = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    return sum(map(len, tokens)) / seconds, tokens


def run(profile: Profile, workdir: Path) -> dict[str, Any]:
    path = _checkpoint(profile, workdir)
    context, new_tokens = 8 * profile.single_prompt_len, profile.single_new_tokens
    vocab = profile.engine_model["vocab_size"]
    k = NGRAM["num_speculative_tokens"]
    rates: dict[str, dict[int, float]] = {"plain": {}, "ngram": {}}
    outputs: dict[str, dict[int, list[list[int]]]] = {"plain": {}, "ngram": {}}
    steps: dict[int, dict[str, float]] = {}
    counts = None
    for engine in ("ngram", "plain"):
        llm = _llm(path, profile, context, engine == "ngram")
        worker = llm.engine.worker
        if engine == "ngram":
            for requests in profile.spec_concurrency:
                decode, verify = (_step_ms(worker.graphs, profile, requests, rows, context, worker.num_blocks, vocab)
                                  for rows in (1, 1 + k))
                steps[requests] = {"decode_ms": decode, "verify_ms": verify, "ratio": verify / decode}
        for requests in profile.spec_concurrency:
            prompts = random_prompts([context] * requests, vocab, seed=11 + requests)
            _tokens_per_s(llm, prompts[:1], 4)  # warm-up: kernels compiled, nothing timed
            rates[engine][requests], outputs[engine][requests] = _tokens_per_s(llm, prompts, new_tokens)
        if engine == "ngram":
            spec = llm.engine.scheduler.spec_decoding
            counts = {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                      "accepted_tokens": spec.num_accepted_tokens}
        worker.close()
        del llm, worker
        free_device()
    ratios = {requests: rates["ngram"][requests] / rates["plain"][requests] for requests in profile.spec_concurrency}
    identical = outputs["ngram"] == outputs["plain"]
    acceptance = counts["accepted_tokens"] / counts["draft_tokens"] if counts["draft_tokens"] else 0.0
    return {
        "config": NGRAM, "context": context, "new_tokens": new_tokens, "verification_steps": steps,
        "tokens_per_s": rates, "ratios": ratios, "identical": identical, "acceptance_rate": acceptance,
        "counts": counts,
        "notes": [f"a step of {requests} requests x {1 + k} rows costs {step['ratio']:.2f}x one of {requests} "
                  f"decodes ({step['verify_ms']:.2f} / {step['decode_ms']:.2f} ms) at a {context}-token context"
                  for requests, step in steps.items()]
        + [f"ngram / plain tokens/s at {requests} requests: {ratio:.2f}x (acceptance {acceptance:.2f})"
           for requests, ratio in ratios.items()],
        "targets": [target(f"ngram / plain tokens/s, random tokens, {requests} requests", ratio, ">= 0.95", ratio >= 0.95)
           for requests, ratio in ratios.items()],
    }
