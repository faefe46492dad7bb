"""Where a decode step's time goes, at 1, 16, 64 and 256 running requests: the model's
own compute (the forward and the LM head) against everything around it (scheduling,
the plan, input preparation, sampling, the scheduler's update, detokenization).

The real embedded engine (LLM: EngineCore, the in-process Worker, the OutputProcessor)
runs unchanged; the benchmark only wraps its functions with timers. Each request has a
16-token prompt and never stops (ignore_eos); once every request is decoding, STEPS
steps are timed. Default model and settings (float32; --quantization gguf for the
4-bit path), 2 torch threads. JSON goes to benchmarks/results/step_overhead.json. Target (issue 15): the
overhead under 10% of the step at every size.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402
from tokenizer_svc.text_output import OutputProcessor  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (1, 16, 64, 256)
STEPS = 8
PROMPT = list(range(1000, 1016))


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - began

        setattr(owner, name, timed)


def measure(llm: LLM, size: int, timers: Timers) -> dict[str, Any]:
    processor = OutputProcessor(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for index in range(size):
        request_id = f"r{size}-{index}"
        processor.add_request(request_id, None, PROMPT, params)
        llm.engine.add_request(request_id, PROMPT, params)
    while llm.engine.scheduler.waiting or any(
            not r.output_token_ids for r in llm.engine.scheduler.running):
        processor.process(llm.engine.step(), llm.engine.abort_request)
    timers.seconds.clear()
    began = time.perf_counter()
    for _ in range(STEPS):
        with_time(timers, "detokenize", lambda: processor.process(timed_step(llm, timers), llm.engine.abort_request))
    wall = time.perf_counter() - began
    for request_id in list(llm.engine.scheduler.requests):
        llm.engine.abort_request(request_id)
    phases = {phase: seconds / STEPS * 1e3 for phase, seconds in timers.seconds.items()}
    step_ms = wall / STEPS * 1e3
    model_ms = phases["forward"] + phases["lm_head"]
    return {"running": size, "step_ms": round(step_ms, 2), "model_ms": round(model_ms, 2),
            "overhead_ms": round(step_ms - model_ms, 2), "overhead_share": round(1 - model_ms / step_ms, 4),
            "phases_ms": {phase: round(ms, 3) for phase, ms in sorted(phases.items())},
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def with_time(timers: Timers, phase: str, fn: Callable[[], Any]) -> Any:
    """`phase` gets fn's time less what the phases inside it already counted."""
    inner_before = sum(timers.seconds.values())
    began = time.perf_counter()
    result = fn()
    inner = sum(timers.seconds.values()) - inner_before
    timers.seconds[phase] += time.perf_counter() - began - inner
    return result


def timed_step(llm: LLM, timers: Timers) -> list:
    return with_time(timers, "other (sampling, plan and result glue)", llm.engine.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 and 16 running requests only")
    parser.add_argument("--quantization", choices=["none", "gguf"], default="none")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/step_overhead.json")
    args = parser.parse_args()
    llm = LLM("smollm2", max_model_len=1024, quantization=args.quantization)
    timers = Timers()
    engine, worker = llm.engine, llm.engine.worker
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "update", "scheduler_update")
    timers.wrap(worker.batch, "prepare", "prepare_inputs")
    timers.wrap(worker.attention_backend, "build_metadata", "attention_metadata")
    timers.wrap(worker.model, "forward", "forward")
    timers.wrap(worker.model, "compute_logits", "lm_head")
    rows = []
    for size in SIZES[:2] if args.quick else SIZES:
        rows.append(measure(llm, size, timers))
        print(f"[{time.strftime('%H:%M:%S')}] {rows[-1]}", file=sys.stderr, flush=True)
    result = {"threads": 2, "steps_per_size": STEPS, "weights": worker.summary()[1], "table": rows,
              "target_overhead_share_max": 0.10,
              "meets_target": all(row["overhead_share"] < 0.10 for row in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
