"""Multi-turn sessions against a small device pool, with and without KV offload tiers.

Each session is a long document (its own, as an agent's context) followed by turns: a
user message, then the model's reply, appended to the conversation, whose next turn
sends it all again. The sessions take turns round-robin, so a session's next turn comes
after every other session's: the conversations together need several times the 64-block
device pool, and a returning turn finds its blocks evicted from it. Measured, one
configuration after the other on the same workload, through the engine core (each turn
alone, its first token time-stamped as its step returns):

- `none`: no tiers: a returning turn recomputes its whole conversation;
- `disk`: `--kv-offloading-dir`;
- `host+disk`: `--kv-offloading-size` in front of the disk;
- `shared`: two replicas mounting one `--kv-shared-dir`, the second serving the even
  turns of every session, whose conversations the first computed, and the first the odd
  ones after the first turn (computed by the second).

Reported per configuration: mean and p99 TTFT of the returning turns, and the fraction of
their prompt tokens recomputed. Target: mean returning-turn TTFT with tiers at most a third
of the mean without (`disk` and `shared`). Also the load time per block from each tier
against the prefill time per block, which routing weighs (gateway/cluster/routing.py).
Run with `make bench` (or `--quick`); JSON goes to benchmarks/results/kv_tiers.json.
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
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402

TOKEN_RANGE = (1000, 40000)  # plain vocabulary ids
ENGINE = {"dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 1024}
FULL = {"sessions": 8, "turns": 4, "document": 300, "message": 64, "reply": 32}
QUICK = {"sessions": 4, "turns": 3, "document": 200, "message": 48, "reply": 16}
TARGET_RATIO_MAX = 1 / 3


@dataclass
class Session:
    tokens: list[int]  # the conversation so far
    messages: list[list[int]]  # the user messages of its turns, in order


@dataclass
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    reply: list[int] = field(default_factory=list)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_flags() -> list[str]:
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [flag for flag in wanted if flag in flags]


def make_sessions(shape: dict, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(*TOKEN_RANGE) for _ in range(n)]

    return [Session(tokens(shape["document"]), [tokens(shape["message"]) for _ in range(shape["turns"])])
            for _ in range(shape["sessions"])]


def run_turn(llm: LLM, request_id: str, prompt: list[int], reply_tokens: int) -> tuple[float, int, list[int]]:
    """One turn alone: its TTFT, the prompt tokens the caches supplied, and the reply."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    began = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft, cached, reply = None, 0, []
    while engine.has_work:
        for delta in engine.step():
            if delta.new_token_ids and ttft is None:
                ttft, cached = time.perf_counter() - began, delta.num_cached_tokens
            reply += delta.new_token_ids
    return ttft, cached, reply


def converse(replicas: list[LLM], sessions: list[Session], reply_tokens: int) -> list[TurnResult]:
    """Every session's turns, round-robin; turn t goes to replica t % len(replicas)."""
    conversations = [list(session.tokens) for session in sessions]
    results = []
    for turn in range(len(sessions[0].messages)):
        llm = replicas[turn % len(replicas)]
        for index, session in enumerate(sessions):
            prompt = conversations[index] + session.messages[turn]
            ttft, cached, reply = run_turn(llm, f"s{index}-t{turn}", prompt, reply_tokens)
            results.append(TurnResult(index, turn, len(prompt), cached, ttft, reply))
            conversations[index] = prompt + reply
    return results


def summary(results: list[TurnResult], replicas: list[LLM], began: float, load: tuple) -> dict:
    returning = [r for r in results if r.turn > 0]
    ttfts = sorted(r.ttft_s for r in returning)
    prompt = sum(r.prompt_tokens for r in returning)
    tiers = {}
    for llm in replicas:
        for tier in llm.engine.stats().kv_tiers:
            entry = tiers.setdefault(tier.medium, {"loaded_blocks": 0, "stored_blocks": 0, "load_seconds": 0.0,
                                                   "loads": 0})
            entry["loaded_blocks"] += tier.loaded_blocks
            entry["stored_blocks"] += tier.stored_blocks
            entry["load_seconds"] += tier.load_seconds.sum
            entry["loads"] += sum(tier.load_seconds.counts)
    for entry in tiers.values():
        entry["ms_per_loaded_block"] = 1000 * entry["load_seconds"] / max(1, entry["loaded_blocks"])
    return {
        "returning_turns": len(returning),
        "mean_ttft_s": statistics.mean(ttfts),
        "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "first_turn_mean_ttft_s": statistics.mean(r.ttft_s for r in results if r.turn == 0),
        "recomputed_fraction": sum(r.prompt_tokens - r.cached_tokens for r in returning) / prompt,
        "tiers": tiers,
        "seconds": time.perf_counter() - began,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
    }


def measure(name: str, engines: list[dict], sessions: list[Session], reply_tokens: int) -> tuple[dict, list]:
    replicas = [LLM("smollm2", **ENGINE, **tiers) for tiers in engines]
    for llm in replicas:  # warm-up: a prompt sharing nothing with the workload
        run_turn(llm, "warm-up", make_sessions({**QUICK, "sessions": 1}, seed=99)[0].tokens, 2)
    load, began = os.getloadavg(), time.perf_counter()
    results = converse(replicas, sessions, reply_tokens)
    report = summary(results, replicas, began, load)
    log(f"{name}: mean returning TTFT {report['mean_ttft_s'] * 1000:.0f} ms, p99 {report['p99_ttft_s'] * 1000:.0f} ms, "
        f"recomputed {report['recomputed_fraction']:.1%}, tiers {report['tiers']}")
    return report, [r.reply for r in results]


def prefill_ms_per_block(report: dict) -> float:
    """The `none` run's first turns: no cache, so the whole prompt is computed (16-token blocks)."""
    return report["first_turn_mean_ttft_s"] * 1000 / (report["first_turn_prompt_tokens"] / 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload for a sanity run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tiers.json"))
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    sessions = make_sessions(shape)
    log(f"CPU flags {cpu_flags()}, load average {os.getloadavg()}, workload {shape}")
    report: dict = {"threads": int(os.environ["KVFLEET_NUM_THREADS"]), "cpu_flags": cpu_flags(), "workload": shape,
                    "engine": ENGINE}
    with tempfile.TemporaryDirectory(prefix="kvfleet-kv-tiers-") as scratch:
        configurations = {
            "none": [{}],
            "disk": [{"kv_offloading_dir": f"{scratch}/disk"}],
            "host+disk": [{"kv_offloading_size": 0.25, "kv_offloading_dir": f"{scratch}/host-disk"}],
            "shared": [{"kv_shared_dir": f"{scratch}/shared"}] * 2,
        }
        replies = {}
        for name, engines in configurations.items():
            report[name], replies[name] = measure(name, engines, sessions, shape["reply"])
    report["none"]["first_turn_prompt_tokens"] = shape["document"] + shape["message"]
    report["prefill_ms_per_block"] = prefill_ms_per_block(report["none"])
    report["same_replies_in_every_configuration"] = all(r == replies["none"] for r in replies.values())
    for name in ("disk", "host+disk", "shared"):
        report[name]["mean_ttft_ratio_to_none"] = report[name]["mean_ttft_s"] / report["none"]["mean_ttft_s"]
    report["target_ratio_max"] = TARGET_RATIO_MAX
    report["meets_target"] = all(report[name]["mean_ttft_ratio_to_none"] <= TARGET_RATIO_MAX
                                 for name in ("disk", "shared"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
