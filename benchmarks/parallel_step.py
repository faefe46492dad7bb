"""What splitting the default model over a worker group costs per decode step on this
2-core CPU: TP=1 (2 threads) against TP=2 and PP=2 (2 processes of 1 thread each, gloo),
at 1, 16 and 64 running requests, side by side in one run. A pipeline keeps PP plans in
flight, each with a share of the requests, so its "step" is a micro-batch: the table
gives the time of a decode round (every running request one token) instead.

A 2-core machine cannot gain from splitting a 135M model; the point is the cost of
the communication the design adds, measured on the leader (rank 0): per step, the
plan broadcast, the outcome broadcast, TP's all-reduces and logits gather, PP's
hidden-state hand-off (with the time spent in each, waiting for the other rank
included). Each request has a 16-token prompt and never stops; once all decode,
ROUNDS rounds are timed. JSON goes to benchmarks/results/parallel_step.json.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import msgspec  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (1, 16, 64)
ROUNDS = 8
PROMPT = list(range(1000, 1016))
LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
           "pp2_one_plan_in_flight": {"pipeline_parallel_size": 2}}


def measure(llm: LLM, size: int) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for index in range(size):
        engine.add_request(f"r{size}-{index}", PROMPT, params)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    counts = engine.worker.group.counts
    counts.clear()
    began = time.perf_counter()
    tokens = steps = 0
    while tokens < ROUNDS * size:
        tokens += sum(len(delta.new_token_ids) for delta in engine.step())
        steps += 1
    wall = time.perf_counter() - began
    per_round = {kind: {"calls": counts.calls[kind] / ROUNDS, "bytes": round(counts.bytes[kind] / ROUNDS),
                        "ms": round(counts.seconds[kind] / ROUNDS * 1e3, 3)} for kind in sorted(counts.calls)}
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    engine.step()  # hands the aborts to the worker
    return {"running": size, "round_ms": round(wall / ROUNDS * 1e3, 2), "plans_per_round": steps / ROUNDS,
            "tokens_per_s": round(tokens / wall, 1), "comm_per_round": per_round,
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/parallel_step.json")
    args = parser.parse_args()
    table: dict[str, list[dict[str, Any]]] = {}
    for name, layout in LAYOUTS.items():
        world = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
        os.environ["KVFLEET_NUM_THREADS"] = str(2 // world)  # the same 2 cores whatever the layout
        llm = LLM("smollm2", max_model_len=1024, **layout)
        if name == "pp2_one_plan_in_flight":  # the pipeline without overlap: a stage idles while the other works
            llm.engine.description = msgspec.structs.replace(llm.engine.description, max_plans_in_flight=1)
        table[name] = [measure(llm, size) for size in SIZES]
        llm.engine.worker.close()
        del llm
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {table[name]}", file=sys.stderr, flush=True)
    ratios = {name: [round(row["round_ms"] / base["round_ms"], 2) for row, base in zip(rows, table["tp1"])]
              for name, rows in table.items() if name != "tp1"}
    result = {"sizes": SIZES, "rounds_per_size": ROUNDS, "table": table, "round_time_vs_tp1": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"round_time_vs_tp1": ratios, "round_ms": {n: [r["round_ms"] for r in rows]
                                                                for n, rows in table.items()}}, indent=2))


if __name__ == "__main__":
    main()
