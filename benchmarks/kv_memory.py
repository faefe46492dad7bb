"""KV memory management under load: prefix caching (TTFT) and chunked prefill (ITL).

Each effect is measured side by side in one run, on the same weights and threads,
as a ratio against the engine with the feature off. Requests are driven open-loop
through the engine core: they arrive on a schedule, whatever the engine is doing,
and every step's new tokens are time-stamped as they come out.

- Prefix caching: 32 requests share a 1,500-token system prompt, each with its own
  question, arriving every ARRIVAL_GAP_S. Target: mean TTFT with caching <= 0.25x without.
- Chunked prefill: 8 requests are decoding when a 1,800-token prompt arrives. Target:
  p99 inter-token latency of the 8 with chunking (budget 256) <= 0.5x without chunking
  (the whole prompt in one step).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402

TOKEN_RANGE = (1000, 40000)  # plain vocabulary ids
ARRIVAL_GAP_S = 0.25


@dataclass
class Arrival:
    at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


@dataclass
class Trace:
    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def drive(llm: LLM, arrivals: list[Arrival]) -> list[Trace]:
    """Submit each request at its arrival time and stamp every token as its step returns.
    A step returns several requests' tokens at once; they share that stamp."""
    engine = llm.engine
    traces = [Trace(arrival.at) for arrival in arrivals]
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at)
    start = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(pending) or engine.has_work:
        now = time.perf_counter() - start
        while next_arrival < len(pending) and arrivals[pending[next_arrival]].at <= now:
            index = pending[next_arrival]
            params = SamplingParams(temperature=0.0, max_tokens=arrivals[index].max_tokens, ignore_eos=True)
            engine.add_request(str(index), arrivals[index].prompt, params)
            next_arrival += 1
        if not engine.has_work:
            time.sleep(max(0.0, arrivals[pending[next_arrival]].at - now))
            continue
        deltas = engine.step()
        stamp = time.perf_counter() - start
        for delta in deltas:
            traces[int(delta.request_id)].token_times += [stamp] * len(delta.new_token_ids)
    return traces


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(n)]


def prefix_caching(rng: random.Random, num_requests: int, system_len: int) -> dict:
    system = random_tokens(rng, system_len)
    arrivals = [Arrival(i * ARRIVAL_GAP_S, system + random_tokens(rng, 20), 4) for i in range(num_requests)]
    results = {}
    for enabled in (True, False):
        llm = LLM("smollm2", dtype="float32", enable_prefix_caching=enabled)
        drive(llm, arrivals[:1])  # warm-up with a prompt sharing nothing cached afterwards
        llm.engine.scheduler.block_pool.reset_prefix_cache()
        load = os.getloadavg()
        began = time.perf_counter()
        traces = drive(llm, arrivals)
        ttfts = [t.ttft for t in traces]
        stats = llm.engine.stats()
        results["caching" if enabled else "no_caching"] = {
            "mean_ttft_s": statistics.mean(ttfts),
            "p50_ttft_s": statistics.median(ttfts),
            "max_ttft_s": max(ttfts),
            "seconds": time.perf_counter() - began,
            "prefix_cache_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
        }
        log(f"prefix caching {enabled}: {results['caching' if enabled else 'no_caching']}")
        del llm
    results["ratio_mean_ttft"] = results["caching"]["mean_ttft_s"] / results["no_caching"]["mean_ttft_s"]
    results["target_max"] = 0.25
    return results


def chunked_prefill(rng: random.Random, long_len: int, num_running: int, running_tokens: int) -> dict:
    max_model_len = 2048
    arrivals = [Arrival(0.0, random_tokens(rng, 32), running_tokens) for _ in range(num_running)]
    results = {}
    for chunked in (True, False):
        budget = 256 if chunked else max_model_len
        llm = LLM("smollm2", dtype="float32", enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                  max_model_len=max_model_len, enable_prefix_caching=False)
        drive(llm, arrivals[:1])  # warm-up
        # The long prompt arrives once the running requests are a few tokens into decoding.
        probe = drive(llm, arrivals)
        decode_started = statistics.median(t.token_times[min(8, running_tokens - 1)] for t in probe)
        workload = arrivals + [Arrival(decode_started, random_tokens(rng, long_len), 1)]
        load = os.getloadavg()
        traces = drive(llm, workload)
        latencies = sorted(x for t in traces[:num_running] for x in t.inter_token_latencies)
        results["chunked" if chunked else "unchunked"] = {
            "max_num_batched_tokens": budget,
            "p50_itl_s": latencies[len(latencies) // 2],
            "p99_itl_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "max_itl_s": latencies[-1],
            "long_prompt_ttft_s": traces[-1].ttft,
            "loadavg_before": load,
            "loadavg_after": os.getloadavg(),
        }
        log(f"chunked prefill {chunked}: {results['chunked' if chunked else 'unchunked']}")
        del llm
    results["ratio_p99_itl"] = results["chunked"]["p99_itl_s"] / results["unchunked"]["p99_itl_s"]
    results["target_max"] = 0.5
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload for a sanity run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_memory.json"))
    args = parser.parse_args()
    rng = random.Random(0)
    report = {
        "threads": int(os.environ["KVFLEET_NUM_THREADS"]),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "prefix_caching": prefix_caching(rng, 8 if args.quick else 32, 300 if args.quick else 1500),
        "chunked_prefill": chunked_prefill(rng, 600 if args.quick else 1800, 8, 48),
    }
    report["meets_targets"] = (
        report["prefix_caching"]["ratio_mean_ttft"] <= 0.25 and report["chunked_prefill"]["ratio_p99_itl"] <= 0.5
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
