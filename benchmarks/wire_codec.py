"""What carrying one step's messages between processes costs: a StepPlan to the worker,
its StepResult back, and a gateway's batch of token deltas over NATS, each encoded to
msgpack and decoded back into its Struct (services/transport/rpc.py's codec), as the
roles do every step. Decode steps (one new token per request) at 64 and 256 running
requests, a prefill step (512-token prompts), and a 64-delta batch. Best of 5 runs,
in microseconds per round trip. JSON goes to benchmarks/results/wire_codec.json.
"""
from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from services.messages import CachedRequestData, NewRequestData, StepPlan, StepResult, TokenDelta
from services.sampling_params import SamplingParams
from services.scheduler_messages import StepOutputs
from services.transport.rpc import encode

REPO = Path(__file__).resolve().parents[1]
SIZES = (64, 256)
PROMPT_TOKENS = 512


def request_ids(count: int) -> list[str]:
    return [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(count)]


def decode_plan(ids: list[str]) -> StepPlan:
    """A decode step: each request's new token, and a new block every 16th one."""
    cached = [CachedRequestData(r, [1000 + i] if i % 16 == 0 else [], 300 + i, [42 + i]) for i, r in enumerate(ids)]
    return StepPlan(100, cached_requests=cached, num_scheduled_tokens=dict.fromkeys(ids, 1),
                    worker_instance_id="w" * 32, scheduler_instance_id="s" * 32)


def prefill_plan(ids: list[str]) -> StepPlan:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, stop=["\n\n"])
    new = [NewRequestData(r, list(range(1000, 1000 + PROMPT_TOKENS)), PROMPT_TOKENS,
                          list(range(i * 32, i * 32 + 32)), 0, params) for i, r in enumerate(ids)]
    return StepPlan(0, new_requests=new, num_scheduled_tokens=dict.fromkeys(ids, PROMPT_TOKENS),
                    worker_instance_id="w" * 32, scheduler_instance_id="s" * 32)


def step_result(ids: list[str]) -> StepResult:
    return StepResult(100, sampled_token_ids={r: [1234 + i] for i, r in enumerate(ids)})


def delta_batch(ids: list[str]) -> StepOutputs:
    return StepOutputs([TokenDelta(r, [1234 + i]) for i, r in enumerate(ids)], "s" * 32, 7)


def best_us(work: Callable[[], object], repeat: int) -> float:
    work()
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeat):
            work()
        best = min(best, (time.perf_counter() - began) / repeat)
    return best * 1e6


def measure(name: str, message: msgspec.Struct, repeat: int) -> dict[str, object]:
    decode = msgspec.msgpack.Decoder(type(message)).decode
    payload = encode(message)
    assert decode(payload) == message
    return {"message": name, "round_trip_us": round(best_us(lambda: decode(encode(message)), repeat), 1),
            "bytes": len(payload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/wire_codec.json")
    args = parser.parse_args()
    rows = []
    for size in SIZES:
        ids = request_ids(size)
        rows.append(measure(f"decode StepPlan, {size} requests", decode_plan(ids), 2000))
        rows.append(measure(f"prefill StepPlan, {size} requests", prefill_plan(ids), 200))
        rows.append(measure(f"StepResult, {size} requests", step_result(ids), 2000))
    rows.append(measure("StepOutputs, 64 deltas", delta_batch(request_ids(64)), 2000))
    for row in rows:
        print(f"{row['message']:34s} {row['round_trip_us']:9.1f} us {row['bytes']:8d} bytes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
