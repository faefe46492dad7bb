"""Section 4: the engine's speed on a random-weight Llama-3-8B-shaped model (bfloat16).

(a) One request's decode rate against the weight-bandwidth roofline: a decode step
reads every weight once (all but the embedding table, of which it reads a row), so
copy bandwidth / those bytes is the most tokens a second one sequence can get. The
rate is taken between its first and last token, so the prompt's prefill is left out.

(b) Offline throughput on a mixed workload, kvfleet against transformers' generate()
on static batches, in the same run. transformers pads each batch's prompts on the
left to the longest and generates the batch's longest output for every member (a
static batch cannot let a short request leave early), so it computes more tokens than
it delivers: only each request's own output tokens count as useful, on both sides.
Time is short, so transformers runs the workload's first `hf_requests`; kvfleet runs
those too (the like-for-like ratio; same lengths, fresh prompt tokens, so nothing comes
from its prefix cache) and the whole workload (the target's ratio, where
kvfleet has the whole batch to fill its steps with).

kvfleet is driven as LLM.generate drives it (engine steps, outputs detokenized) but
with a time cap: past it the run stops, is marked incomplete, and reports the tokens
it had. The checkpoint is written once from transformers' model, which then runs its
share and is freed before kvfleet loads, so the two never hold the GPU together.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.common import Profile, copy_bandwidth, free_device, synchronize, target
from benchmarks.gpu.models import random_llama, random_prompts, save_checkpoint
from kvfleet import SamplingParams
from kvfleet.llm import LLM
from tokenizer_svc.text_output import OutputProcessor

Workload = list[tuple[list[int], int]]  # (prompt, output tokens) per request
WORKLOAD_SEED = 7


def _workload(profile: Profile, vocab_size: int) -> Workload:
    generator = torch.Generator().manual_seed(WORKLOAD_SEED)
    count = profile.workload_requests
    prompt_lens = torch.randint(profile.workload_prompt_range[0], profile.workload_prompt_range[1] + 1, (count,),
                                generator=generator).tolist()
    outputs = torch.randint(profile.workload_output_range[0], profile.workload_output_range[1] + 1, (count,),
                            generator=generator).tolist()
    return list(zip(random_prompts(prompt_lens, vocab_size, seed=WORKLOAD_SEED + 1), outputs))


def _fresh_tokens(workload: Workload, vocab_size: int) -> Workload:
    """The same requests' lengths with other prompt tokens: run after the whole workload,
    the original prompts would be found in kvfleet's prefix cache."""
    prompts = random_prompts([len(prompt) for prompt, _ in workload], vocab_size, seed=WORKLOAD_SEED + 2)
    return [(prompt, out) for prompt, (_, out) in zip(prompts, workload)]


def _transformers(model: Any, workload: Workload, batch_size: int, cap_s: float) -> dict[str, Any]:
    device = model.device
    with torch.inference_mode():
        model.generate(torch.ones(1, 4, dtype=torch.long, device=device), max_new_tokens=2, do_sample=False)  # warm-up
        synchronize(device)
        began = time.perf_counter()
        done = useful = computed = 0
        for start in range(0, len(workload), batch_size):
            if time.perf_counter() - began > cap_s:
                break
            batch = workload[start : start + batch_size]
            width, new = max(len(prompt) for prompt, _ in batch), max(out for _, out in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=new,
                           min_new_tokens=new)
            synchronize(device)
            done += len(batch)
            useful += sum(out for _, out in batch)
            computed += len(batch) * new
        seconds = time.perf_counter() - began
    return {"requests": done, "batch_size": batch_size, "completed": done == len(workload), "seconds": seconds,
            "useful_tokens": useful, "generated_tokens_with_padding": computed, "useful_tokens_per_s": useful / seconds}


def _drive(llm: LLM, workload: Workload, tag: str, cap_s: float) -> dict[str, Any]:
    """Runs `workload` to completion or for `cap_s`, whichever comes first; "stamps" are
    (time, tokens) of each step that delivered tokens."""
    engine = llm.engine
    processor = OutputProcessor(llm.get_tokenizer())
    began = time.perf_counter()
    for index, (prompt, out) in enumerate(workload):
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        engine.add_request(f"{tag}-{index}", prompt, params)
        processor.add_request(f"{tag}-{index}", None, prompt, params)
    tokens, finished, stamps = 0, 0, []
    while engine.has_work and time.perf_counter() - began < cap_s:
        deltas = engine.step()
        delivered = sum(len(delta.new_token_ids) for delta in deltas)
        if delivered:
            tokens += delivered
            stamps.append((time.perf_counter(), delivered))
        finished += len(processor.process(deltas, engine.abort_request))
    seconds = time.perf_counter() - began
    completed = not engine.has_work
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_work:  # hands the aborts to the worker
        engine.step()
    return {"requests": len(workload), "finished": finished, "completed": completed, "seconds": seconds,
            "useful_tokens": tokens, "useful_tokens_per_s": tokens / seconds, "stamps": stamps}


def _single_request(llm: LLM, profile: Profile, vocab_size: int, bytes_per_token: int, bandwidth: float,
                    cap_s: float) -> dict[str, Any]:
    warm, timed = random_prompts([profile.single_prompt_len] * 2, vocab_size, seed=9)  # two: no prefix-cache hit
    _drive(llm, [(warm, 8)], "warm-up", cap_s)
    run = _drive(llm, [(timed, profile.single_new_tokens)], "single", cap_s)
    (first, _), (last, _) = run["stamps"][0], run["stamps"][-1]
    rate = (run["useful_tokens"] - 1) / (last - first)
    roofline = bandwidth / bytes_per_token
    return {"prompt_len": len(timed), "new_tokens": run["useful_tokens"], "completed": run["completed"],
            "decode_tokens_per_s": rate, "ms_per_token": 1e3 / rate, "roofline_tokens_per_s": roofline,
            "bytes_read_per_token": bytes_per_token, "fraction_of_roofline": rate / roofline}


def run(profile: Profile, workdir: Path) -> dict[str, Any]:
    device, dtype = profile.device, profile.engine_dtype
    timings: dict[str, float] = {}
    began = time.perf_counter()
    model = random_llama(profile.engine_model, dtype, device, seed=3)
    synchronize(device)
    timings["build_model_s"] = time.perf_counter() - began
    config = model.config
    path = save_checkpoint(model, workdir / "engine-llama")
    timings["save_checkpoint_s"] = time.perf_counter() - began - timings["build_model_s"]
    workload = _workload(profile, config.vocab_size)
    subset = workload[: profile.hf_requests]
    hf = _transformers(model, subset, profile.hf_batch_size, profile.hf_cap_s)
    del model
    free_device()

    started = time.perf_counter()
    longest = profile.workload_prompt_range[1] + profile.workload_output_range[1]
    # On a CPU the KV budget is given in blocks (4 GiB by default would be zeroed for nothing).
    cpu_blocks = {"num_gpu_blocks_override": 4 * -(-longest // profile.block_size)} if device.type == "cpu" else {}
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), device=device.type, attention_backend="triton",
              async_scheduling=True,
              max_model_len=longest, block_size=profile.block_size, **cpu_blocks)
    timings["kvfleet_start_s"] = time.perf_counter() - started
    worker = llm.engine.worker
    embedding_bytes = config.vocab_size * config.hidden_size * dtype.itemsize
    bandwidth = copy_bandwidth(profile)
    single = _single_request(llm, profile, config.vocab_size, worker.weights_bytes - embedding_bytes, bandwidth,
                             profile.engine_cap_s)
    full = _drive(llm, workload, "full", profile.engine_cap_s)
    same = _drive(llm, _fresh_tokens(subset, config.vocab_size), "subset", profile.engine_cap_s / 2)
    graphs, weights_bytes = worker.graphs is not None, worker.weights_bytes
    worker.close()
    del llm, worker
    free_device()

    for result in (full, same):
        del result["stamps"]
    ratio, like_for_like = (result["useful_tokens_per_s"] / hf["useful_tokens_per_s"] for result in (full, same))
    fraction = single["fraction_of_roofline"]
    return {
        "model": {**profile.engine_model, "dtype": str(dtype).removeprefix("torch."),
                  "weights_bytes": weights_bytes},
        "copy_bandwidth_GBps": bandwidth / 1e9, "cuda_graphs_captured": graphs, "timings": timings,
        "single_request": single,
        "workload": {"requests": len(workload), "prompt_lens": list(profile.workload_prompt_range),
                     "output_lens": list(profile.workload_output_range), "seed": WORKLOAD_SEED,
                     "prompt_tokens": sum(len(prompt) for prompt, _ in workload),
                     "output_tokens": sum(out for _, out in workload)},
        "transformers_subset": hf, "kvfleet_full": full, "kvfleet_subset": same,
        "throughput_ratio_full_vs_transformers_subset": ratio,
        "throughput_ratio_same_subset": like_for_like,
        "notes": [
            f"single request: {single['decode_tokens_per_s']:.1f} tokens/s, roofline "
            f"{single['roofline_tokens_per_s']:.1f}",
            f"kvfleet {full['useful_tokens_per_s']:.0f} useful tokens/s on {full['requests']} requests"
            f"{'' if full['completed'] else ' (capped)'}; on the first {same['requests']}: kvfleet "
            f"{same['useful_tokens_per_s']:.0f}, transformers {hf['useful_tokens_per_s']:.0f} ({hf['requests']} run)",
        ],
        "targets": [
            target("single-request decode / weight-bandwidth roofline", fraction, ">= 0.7", fraction >= 0.7),
            target("kvfleet useful tokens/s (whole workload) / transformers' (subset)", ratio, ">= 5", ratio >= 5),
        ],
    }
