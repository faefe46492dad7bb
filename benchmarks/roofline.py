"""Single-stream decode against this machine's memory-bandwidth roofline (issue 46, item 3).

One request's decode step reads every weight once (the 4-bit projections as kvfleet
stores them, 0.625 bytes a weight; the tied 8-bit LM head, 1.0625; the norms) and the
request's whole KV cache, so bytes per token / read bandwidth bounds its tokens/s:

    roofline(context) = bandwidth / (weight bytes + context x KV bytes per token)

- **Bandwidth**: a plain read, `torch.sum` over a 512 MiB float32 tensor (32x the 16 MiB
  L3 here, so every byte comes from DRAM; its pages touched first), on one thread and on
  two, best of 5. A vectorized reduction streams its input with no writes, what a
  memory-bound GEMV wants; it is what the issue calls "a plain read".
- **Bytes**: taken from the model as the engine loaded it with `--quantization gguf`
  (`weight_bytes`), the KV from the engine's cache dtype (float16 by default for GGUF).
- **Decode**: a greedy request of `context` random vocabulary tokens, then
  `--new-tokens` tokens (ignore_eos), driven step by step; the rate is taken between
  its first and last token, so prefill is left out, and compared with the roofline at
  the mean context it decoded at. Contexts 128, 1024 and 4096; `--rounds` runs each
  and keeps every round's rate (the headline is the best).
- **TTFT**: a 512-token prompt's time from `add_request` to its first token, median of 3
  (prefix caching off, so each prefills in full).
- **The 1-row 4-bit GEMM per layer shape** (the kernel a 1-row step takes: the AVX-512
  VNNI one where it runs, else the AVX2 int16 one, else the float32 one): every projection of all 30 layers in
  decode's order (so the 66 MB of codes stream from DRAM, as in a step, not from L3),
  each call timed, on one thread (as a 1-token step runs) and two (the kernels' pool
  polling, as in a larger step); bytes read / time per shape, and the LM head's 8-bit
  kernel the same way.

kvfleet runs steps of up to 8 tokens on one thread (worker_svc/kernels/cpu/threads.py), so
single-stream decode is judged against the one-thread roofline as well as the
two-thread one. 2 threads, OMP_WAIT_POLICY=PASSIVE, `/proc/loadavg` logged before and
after. JSON goes to benchmarks/results/roofline.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
NUM_THREADS = 2
os.environ["KVFLEET_NUM_THREADS"] = str(NUM_THREADS)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from roofline_bytes import DecodeBytes, kv_bytes_per_token, weight_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONTEXTS = (128, 1024, 4096)
TTFT_PROMPT = 512
TOKEN_RANGE = (1000, 40000)  # plain vocabulary ids, as offline_throughput.py draws them
READ_BYTES = 512 << 20
SHAPE_NAMES = {(960, 576): "qkv", (576, 576): "o", (3072, 576): "gate_up", (576, 1536): "down"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes/s of torch.sum over READ_BYTES of float32 on `threads` threads, best of `repeats`."""
    data = torch.ones(READ_BYTES // 4)  # written once: its pages are faulted in before timing
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data.sum()
        best = min(_timed(data.sum) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return READ_BYTES / best


def _timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def drive(engine: Any, prompt: list[int], new_tokens: int, tag: str) -> dict[str, Any]:
    """One greedy request stepped to its end: TTFT and the decode rate between its first and last token."""
    from kvfleet import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    began = time.perf_counter()
    engine.add_request(tag, prompt, params)
    stamps: list[float] = []
    tokens = 0
    while engine.has_work:
        delivered = sum(len(delta.new_token_ids) for delta in engine.step())
        if delivered:
            tokens += delivered
            stamps.append(time.perf_counter())
    result: dict[str, Any] = {"ttft_ms": round((stamps[0] - began) * 1e3, 1), "tokens": tokens}
    if tokens > 1:
        result["decode_tokens_per_s"] = round((tokens - 1) / (stamps[-1] - stamps[0]), 2)
    return result


def _one_row_call(layer: torch.nn.Module, name: str) -> tuple[str, int, Any]:
    """(name, bytes read, call(threads)) of the kernel a 1-row step of `layer` (a Q4Linear or
    the Q8Linear head) takes: the AVX-512 VNNI one over its panels where it runs, else the
    AVX2 int16 one where it built, else the float32 one."""
    x, out = torch.randn(1, layer.in_features), torch.empty(1, layer.out_features)
    k, n = layer.in_features, layer.out_features
    if layer.panels is not None:
        weights, function = layer.panels, layer.vnni._functions[type(layer.panels)]
        return name, weights.panels.nbytes, lambda t: function(
            x.data_ptr(), k, weights.panels.data_ptr(), None, out.data_ptr(), 1, k, n, t, 1)
    projection = hasattr(layer, "packed")  # a 4-bit projection, else the 8-bit head; only the former takes a bias
    if projection:
        codes, scales, kernel16 = layer.packed.codes, layer.packed.scale_offsets, layer.int16 and layer.int16.q4_function
    else:
        codes, scales, kernel16 = layer.blocks.codes, layer.blocks.scales, layer.int16 and layer.int16.q8_function
    bias = [None] if projection else []
    nbytes = codes.nbytes + scales.nbytes
    if kernel16:
        return name, nbytes, lambda t: kernel16(x.data_ptr(), k, codes.data_ptr(), scales.data_ptr(), *bias,
                                                out.data_ptr(), 1, k, n, t)
    return name, nbytes, lambda t: layer.kernel._function(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), *bias,
                                                          out.data_ptr(), 1, k, n, t)


def gemm_bandwidth(model: torch.nn.Module, passes: int = 5) -> dict[str, Any]:
    """The 1-row kernels' bytes read per second, per layer shape, on one and two threads."""
    from worker_svc.kernels.cpu.threads import step_threads
    from worker_svc.model.q4_linear import Q4Linear
    from worker_svc.model.q8_linear import Q8Linear

    q4 = [m for m in model.modules() if isinstance(m, Q4Linear)]
    head = next(m for m in model.modules() if isinstance(m, Q8Linear))
    calls = [_one_row_call(layer, SHAPE_NAMES.get((layer.out_features, layer.in_features),
                                                  f"{layer.out_features}x{layer.in_features}")) for layer in q4]
    calls.append(_one_row_call(head, "lm_head_q8"))
    result: dict[str, Any] = {}
    for threads in (1, NUM_THREADS):
        # Two threads as a larger step runs them: the pool's helpers polling between calls.
        with step_threads(torch.device("cpu"), 1 if threads == 1 else 64):
            seconds: dict[str, list[float]] = {}
            for _ in range(passes + 1):  # the first pass warms up
                this_pass: dict[str, float] = {}
                for name, _, call in calls:
                    began = time.perf_counter()
                    call(threads)
                    this_pass[name] = this_pass.get(name, 0.0) + time.perf_counter() - began
                for name, spent in this_pass.items():
                    seconds.setdefault(name, []).append(spent)
        total_bytes: dict[str, int] = {}
        for name, nbytes, _ in calls:
            total_bytes[name] = total_bytes.get(name, 0) + nbytes
        result[f"{threads}_threads"] = {
            name: {"calls_per_pass": sum(1 for n, _, _ in calls if n == name), "mb_read": round(total_bytes[name] / 1e6, 2),
                   "ms_median": round(statistics.median(s[1:]) * 1e3, 3),
                   "gb_per_s": round(total_bytes[name] / statistics.median(s[1:]) / 1e9, 2)}
            for name, s in seconds.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded at each context")
    parser.add_argument("--rounds", type=int, default=2, help="runs at each context")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/roofline.json")
    args = parser.parse_args()
    from kvfleet import LLM

    torch.set_num_threads(NUM_THREADS)
    result: dict[str, Any] = {"machine": {"cpu_flags": sorted(_cpu_flags()), "processor": platform.processor(),
                                          "threads": NUM_THREADS}, "loadavg_before": loadavg()}
    log(f"load average {result['loadavg_before']}")
    bandwidth = {threads: read_bandwidth(threads) for threads in (1, NUM_THREADS)}
    result["read_gb_per_s"] = {f"{t}_threads": round(b / 1e9, 2) for t, b in bandwidth.items()}
    log(f"plain read: {result['read_gb_per_s']}")

    llm = LLM("smollm2", quantization="gguf", enable_prefix_caching=False, max_model_len=max(args.contexts) + 512,
              seed=0)
    worker = llm.engine.worker
    config = worker.model_config
    kinds = weight_bytes(worker.model)
    element = torch.empty(0, dtype=worker.kv_dtype).element_size()
    decode_bytes = DecodeBytes(sum(kinds.values()), kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, element))
    result["bytes"] = {**kinds, "weights_total": decode_bytes.weights, "kv_dtype": str(worker.kv_dtype),
                       "kv_per_context_token": decode_bytes.kv_per_token}
    log(f"bytes per token: {result['bytes']}")

    result["gemm_1_row"] = gemm_bandwidth(worker.model)
    log(f"1-row GEMM: {json.dumps(result['gemm_1_row'])}")

    rng = random.Random(0)
    engine = llm.engine
    drive(engine, [rng.randint(*TOKEN_RANGE) for _ in range(64)], 8, "warm-up")
    decode = []
    for context in args.contexts:
        runs = [drive(engine, [rng.randint(*TOKEN_RANGE) for _ in range(context)], args.new_tokens,
                      f"decode-{context}-{r}") for r in range(args.rounds)]
        rate = max(run["decode_tokens_per_s"] for run in runs)
        mean_context = context + args.new_tokens / 2
        entry = {"context": context, "new_tokens": args.new_tokens,
                 "decode_tokens_per_s_rounds": [run["decode_tokens_per_s"] for run in runs],
                 "decode_tokens_per_s": rate, "bytes_per_token": round(decode_bytes.per_token(mean_context))}
        for threads, b in bandwidth.items():
            roof = decode_bytes.roofline(b, mean_context)
            entry[f"roofline_{threads}_threads_tokens_per_s"] = round(roof, 1)
            entry[f"share_of_roofline_{threads}_threads"] = round(rate / roof, 3)
        decode.append(entry)
        log(f"context {context}: {entry}")
    result["single_stream_decode"] = decode
    ttfts = [drive(engine, [rng.randint(*TOKEN_RANGE) for _ in range(TTFT_PROMPT)], 1, f"ttft-{i}")["ttft_ms"]
             for i in range(3)]
    result["ttft_512_prompt_ms"] = {"runs": ttfts, "median": statistics.median(ttfts)}
    log(f"TTFT of a {TTFT_PROMPT}-token prompt: {result['ttft_512_prompt_ms']}")
    result["loadavg_after"] = loadavg()
    log(f"load average {result['loadavg_after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _cpu_flags() -> set[str]:
    wanted = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return wanted & set(line.split(":", 1)[1].split())
    return set()


if __name__ == "__main__":
    main()
