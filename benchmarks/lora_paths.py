"""The LoRA deltas' two CPU paths side by side in one process: lora.py's workload (64
running requests of rank-16 adapters over every projection, 2 torch threads, 4-bit weights
as stored) with the C++ SGMV kernel and with torch's matmuls (KVFLEET_LORA_KERNEL=0's path),
alternated with the base model alone in each round, so that a shared machine's drift falls
on all alike.

lora.py judges the target by wall time, which a loaded machine makes meaningless; this also
reports the process's CPU time per step, which others' load inflates far less, and the share
of each step's wall time spent in the deltas (LoraStep.add). JSON on stdout.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora as workload  # noqa: E402  (benchmarks/lora.py: the same adapters, prompt and step count)

from kvfleet import LLM, LoRARequest, SamplingParams  # noqa: E402
from worker_svc.model.lora import LoraStep  # noqa: E402

CONFIGS = ((0, "base"), (4, "kernel"), (4, "torch"), (16, "kernel"), (16, "torch"))


class DeltaClock:
    """Wall time spent in LoraStep.add, whichever path it takes."""

    def __init__(self) -> None:
        self.spent = 0.0
        add = LoraStep.add

        def timed(step: LoraStep, *args: object, **kwargs: object) -> object:
            began = time.perf_counter()
            try:
                return add(step, *args, **kwargs)
            finally:
                self.spent += time.perf_counter() - began
        LoraStep.add = timed  # type: ignore[method-assign]


def timed_steps(llm: LLM, loras: list[LoRARequest], clock: DeltaClock) -> tuple[float, float, float]:
    """lora.py's step_ms, returning (wall ms, process CPU ms) per step and the deltas' share of the wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    engine = llm.engine
    for index in range(workload.RUNNING):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", workload.PROMPT, params,
                           lora_request=loras[index % len(loras)] if loras else None)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    clock.spent = 0.0
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(workload.STEPS):
        engine.step()
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_work:
        engine.step()
    return wall / workload.STEPS * 1e3, cpu / workload.STEPS * 1e3, clock.spent / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM("smollm2", max_model_len=1024, enable_lora=True, max_loras=16, max_cpu_loras=16,
              max_lora_rank=workload.RANK)
    context = llm.engine.worker.lora.context
    kernel = context.cpu_kernel
    if kernel is None:
        sys.exit("the C++ LoRA kernel is not built here (no compiler, no AVX2/FMA, or KVFLEET_LORA_KERNEL=0)")
    clock = DeltaClock()
    samples: dict[tuple[int, str], list[tuple[float, float, float]]] = {config: [] for config in CONFIGS}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for index in range(16):
            workload.write_adapter(llm, Path(root) / f"a{index}", seed=index)
            loras.append(LoRARequest(f"a{index}", index + 1, str(Path(root) / f"a{index}")))
            llm.engine.add_lora(loras[-1])
        timed_steps(llm, loras, clock)  # warm-up: every adapter into its slot
        for _ in range(args.rounds):
            for count, path in CONFIGS:
                context.cpu_kernel = None if path == "torch" else kernel
                samples[count, path].append(timed_steps(llm, loras[:count], clock))
                print(f"[{time.strftime('%H:%M:%S')}] {count} {path}: {samples[count, path][-1][0]:.1f} ms",
                      file=sys.stderr, flush=True)
            loads.append(os.getloadavg()[0])
    base_wall = statistics.median(s[0] for s in samples[0, "base"])
    base_cpu = statistics.median(s[1] for s in samples[0, "base"])
    rows = [{"adapters": count, "path": path,
             "wall_ms": round(statistics.median(s[0] for s in samples[count, path]), 1),
             "wall_ratio": round(statistics.median(s[0] for s in samples[count, path]) / base_wall, 3),
             "cpu_ms": round(statistics.median(s[1] for s in samples[count, path]), 1),
             "cpu_ratio": round(statistics.median(s[1] for s in samples[count, path]) / base_cpu, 3),
             "delta_share_of_wall": [round(s[2], 3) for s in samples[count, path]]} for count, path in CONFIGS]
    print(json.dumps({"rank": workload.RANK, "running_requests": workload.RUNNING, "rounds": args.rounds,
                      "loadavg_1m": [round(load, 2) for load in loads], "table": rows}, indent=2))


if __name__ == "__main__":
    main()
