"""What LoRA adapters cost a decode step: 64 running requests of the base model alone,
then spread evenly over 1, 4 and 16 adapters of rank 16 (every projection adapted), the
step times side by side in one run.

The real embedded engine (LLM with --enable-lora, --max-loras 16) runs unchanged. The
adapters are random, written as PEFT writes them. Each request has a 16-token prompt and
never stops (ignore_eos); once all 64 decode, STEPS steps are timed; the configurations
take turns for ROUNDS rounds and each keeps its median, so drift on a shared machine
falls on all alike; the fastest sample of each is reported too. Default model and
settings (4-bit weights as stored), 2 torch threads. JSON goes to
benchmarks/results/lora.json. Target (issue 44): at 4 adapters a step costs at most 1.3x
the base model's.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from kvfleet import LLM, LoRARequest, SamplingParams  # noqa: E402
from worker_svc.formats.peft_adapter import ATTENTION_MODULES, module_shapes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNNING = 64
ADAPTER_COUNTS = (0, 1, 4, 16)  # 0: the base model alone
RANK = 16
STEPS = 6
ROUNDS = 3
PROMPT = list(range(1000, 1016))


def write_adapter(llm: LLM, directory: Path, seed: int) -> None:
    """A random rank-RANK adapter of every projection of every layer, as PEFT saves one."""
    config = llm.engine.worker.model_config
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (in_features, out_features) in module_shapes(config).items():
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(module_shapes(config))}))


def step_ms(llm: LLM, loras: list[LoRARequest]) -> float:
    """The mean decode step of RUNNING requests, spread round-robin over `loras` (none: the base model)."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    engine = llm.engine
    for index in range(RUNNING):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", PROMPT, params,
                           lora_request=loras[index % len(loras)] if loras else None)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    began = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    elapsed = time.perf_counter() - began
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_work:
        engine.step()
    return elapsed / STEPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quantization", choices=["none", "gguf"], default=None,
                        help="default: the model file's (4-bit as stored for the default model)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/lora.json")
    args = parser.parse_args()
    llm = LLM("smollm2", max_model_len=1024, quantization=args.quantization, enable_lora=True,
              max_loras=max(ADAPTER_COUNTS), max_cpu_loras=max(ADAPTER_COUNTS), max_lora_rank=RANK)
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for index in range(max(ADAPTER_COUNTS)):
            write_adapter(llm, Path(root) / f"a{index}", seed=index)
            loras.append(LoRARequest(f"a{index}", index + 1, str(Path(root) / f"a{index}")))
            llm.engine.add_lora(loras[-1])
        samples: dict[int, list[float]] = {count: [] for count in ADAPTER_COUNTS}
        step_ms(llm, loras)  # warm-up: every adapter into its slot, the allocator to its sizes
        for round_index in range(ROUNDS):
            for count in ADAPTER_COUNTS:
                samples[count].append(step_ms(llm, loras[:count]))
                print(f"[{time.strftime('%H:%M:%S')}] round {round_index} adapters {count}: "
                      f"{samples[count][-1]:.1f} ms", file=sys.stderr, flush=True)
    base, base_min = statistics.median(samples[0]), min(samples[0])
    # The fastest sample too: on a shared machine others' load only ever adds time.
    rows = [{"adapters": count, "step_ms": round(statistics.median(samples[count]), 2),
             "ratio_to_base": round(statistics.median(samples[count]) / base, 3),
             "fastest_ms": round(min(samples[count]), 2), "fastest_ratio": round(min(samples[count]) / base_min, 3),
             "samples_ms": [round(sample, 2) for sample in samples[count]]} for count in ADAPTER_COUNTS]
    result = {"running_requests": RUNNING, "rank": RANK, "threads": 2, "steps_per_sample": STEPS, "rounds": ROUNDS,
              "weights": llm.engine.worker.summary()[1], "device": str(llm.engine.worker.device), "table": rows,
              "loadavg_1m": round(os.getloadavg()[0], 2), "target_ratio_at_4_adapters_max": 1.3,
              "meets_target": rows[ADAPTER_COUNTS.index(4)]["ratio_to_base"] <= 1.3}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
