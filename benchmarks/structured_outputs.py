"""Structured outputs: the decode throughput cost of xgrammar JSON-schema constraints.

One LLM (smollm2, float32, 2 torch threads) serves the same batch of 32 chat requests
("Give me <thing> as JSON.", the 20 schemas of tests/structured_schemas.py cycled)
twice per round, side by side, so that a noisy machine slows both arms alike:

- constrained: each request carries its JSON schema (greedy, stops at EOS once the
  grammar is complete, or at max_tokens);
- unconstrained: no schema, ignore_eos, and each request's max_tokens set to the number
  of tokens that request generated constrained, so both arms generate exactly the same
  tokens per request (the same batch shape at every step, only the grammar work differs).

tokens/s = generated tokens / wall time of the generate call. A prefill-excluded "decode"
figure subtracts the wall time of a max_tokens=1 run of the same prompts in the same arm
(prompt processing, the first token and per-call overhead): (tokens - 32) / (full - one).
The arms alternate order each round; the median ratio over the rounds is reported. A
warm-up compiles the 20 grammars (timed, each) and runs each arm once first. The
worker's Grammars.mask/accept/request_grammar and each step are wrapped with timers (a few
perf_counter calls a step, against steps of tens of ms) to show what the grammar work
costs per step. Outputs are parsed as JSON and validated with jsonschema.

Run with `--quick` for a sanity run (1 round, max_tokens 64); JSON goes to
benchmarks/results/structured_outputs.json.
"""
from __future__ import annotations

import os

# Before torch loads OpenMP: idle threads sleep rather than spin on the shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# LLM() applies KVFLEET_NUM_THREADS (worker_svc.kernels.cpu.threads.configure_torch_threads): 2, as the other benchmarks.
NUM_THREADS = 2
os.environ["KVFLEET_NUM_THREADS"] = str(NUM_THREADS)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The repo root before tests/: tests/kvfleet is a namespace folder that would shadow the kvfleet package.
for _path in (str(REPO / "tests"), str(REPO)):
    if _path in sys.path:
        sys.path.remove(_path)
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jsonschema  # noqa: E402
import torch  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

from kvfleet import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

MODEL = "smollm2"
NUM_REQUESTS = 32
TARGETS = {"constrained_vs_unconstrained_tokens_per_s_ratio_min": 0.9}
FULL = {"rounds": 3, "max_tokens": 128}
QUICK = {"rounds": 1, "max_tokens": 64}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Timers:
    """Wall time and calls of a few worker methods, wrapped on the instances (no worker code changes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        original = getattr(obj, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - began
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(obj, name, timed)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)

    def since(self, snap: tuple[dict[str, float], dict[str, int]]) -> dict[str, dict[str, float]]:
        seconds, calls = snap
        return {label: {"seconds": round(self.seconds[label] - seconds.get(label, 0.0), 4),
                        "calls": self.calls[label] - calls.get(label, 0)}
                for label in self.seconds if self.calls[label] - calls.get(label, 0)}


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Give me {SCHEMAS[i % len(SCHEMAS)][0]} as JSON."}]
            for i in range(NUM_REQUESTS)]


def schema(i: int) -> dict[str, Any]:
    return SCHEMAS[i % len(SCHEMAS)][1]


def constrained_params(max_tokens: int) -> list[SamplingParams]:
    # No ignore_eos: a request ends when its grammar is complete (the grammar then allows only EOS).
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=schema(i)))
            for i in range(NUM_REQUESTS)]


def unconstrained_params(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


def validate(outputs: list[Any]) -> dict[str, Any]:
    parsed = valid = 0
    failures = []
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        try:
            value = json.loads(completion.text)
            parsed += 1
            jsonschema.validate(value, schema(i))
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append({"request": i, "thing": SCHEMAS[i % len(SCHEMAS)][0],
                             "finish_reason": completion.finish_reason, "tokens": len(completion.token_ids),
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                             "text_head": completion.text[:80]})
    return {"num_requests": len(outputs), "parsed_json": parsed, "valid_against_schema": valid,
            "finish_reasons": {r: sum(o.outputs[0].finish_reason == r for o in outputs)
                               for r in sorted({o.outputs[0].finish_reason for o in outputs})},
            "failures": failures}


def median_seconds(records: list[dict[str, Any]], arm: str) -> float:
    return statistics.median(rec[arm]["seconds"] for rec in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, max_tokens 64: a sanity run (~2 minutes)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/structured_outputs.json")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    rounds, max_tokens = plan["rounds"], plan["max_tokens"]
    torch.set_num_threads(NUM_THREADS)
    start_load, began_all = loadavg(), time.perf_counter()
    phases: dict[str, float] = {}

    log(f"loading {MODEL} (float32, {NUM_THREADS} torch threads); load average {start_load}")
    began = time.perf_counter()
    llm = LLM(MODEL, dtype="float32")
    phases["load"] = time.perf_counter() - began
    torch.set_num_threads(NUM_THREADS)
    worker = llm.engine.worker
    timers = Timers()
    timers.wrap(worker, "execute", "step")
    timers.wrap(worker.grammars, "mask", "mask")
    timers.wrap(worker.grammars, "accept", "accept")
    timers.wrap(worker.grammars, "request_grammar", "matcher")
    convs = conversations()

    # Cold compilation of each distinct schema (xgrammar caches by the schema's text).
    compile_s = []
    for thing, spec in SCHEMAS:
        began = time.perf_counter()
        llm.engine.compile_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=spec)))
        compile_s.append((thing, time.perf_counter() - began))
    phases["compile_grammars"] = sum(s for _, s in compile_s)
    log(f"compiled {len(SCHEMAS)} schemas in {phases['compile_grammars']:.2f}s "
        f"(first, with the compiler's construction: {compile_s[0][1]:.2f}s)")

    def run(params: list[SamplingParams]) -> tuple[float, list[Any], dict[str, Any]]:
        assert torch.get_num_threads() == NUM_THREADS, "something changed the torch thread count"
        before, snap = loadavg(), timers.snapshot()
        began = time.perf_counter()
        outputs = llm.chat(convs, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        return seconds, outputs, {"seconds": round(seconds, 3), "loadavg_before": before, "loadavg_after": loadavg(),
                                  "worker": timers.since(snap)}

    log("warm-up: the constrained batch (first run after compilation), then the unconstrained one")
    first_s, warm_out, warm_info = run(constrained_params(max_tokens))
    lengths = [len(o.outputs[0].token_ids) for o in warm_out]
    total_tokens = sum(lengths)
    unconstrained_s, _, _ = run(unconstrained_params(lengths))
    run(constrained_params(1))
    run(unconstrained_params([1] * NUM_REQUESTS))
    phases["warm_up"] = first_s + unconstrained_s
    log(f"warm-up: constrained {first_s:.1f}s ({total_tokens} tokens, lengths {min(lengths)}-{max(lengths)}), "
        f"unconstrained {unconstrained_s:.1f}s")

    arms: dict[str, Callable[[], tuple[float, list[Any], dict[str, Any]]]] = {
        "constrained": lambda: run(constrained_params(max_tokens)),
        "unconstrained": lambda: run(unconstrained_params(lengths)),
        "constrained_1tok": lambda: run(constrained_params(1)),
        "unconstrained_1tok": lambda: run(unconstrained_params([1] * NUM_REQUESTS)),
    }
    records: list[dict[str, Any]] = []
    validity = None
    same_lengths = True
    began = time.perf_counter()
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))  # alternate so drift hits both alike
        record: dict[str, Any] = {"order": order}
        for name in order:
            seconds, outputs, info = arms[name]()
            got = [len(o.outputs[0].token_ids) for o in outputs]
            info["generated_tokens"] = sum(got)
            if name == "constrained":
                same_lengths &= got == lengths  # greedy on the same batch: should repeat exactly
                validity = validate(outputs)
            elif name == "unconstrained":
                assert got == lengths, "an unconstrained request stopped early"
            record[name] = info
        full = {arm: record[arm]["generated_tokens"] / record[arm]["seconds"] for arm in ("constrained", "unconstrained")}
        decode = {arm: (record[arm]["generated_tokens"] - NUM_REQUESTS)
                  / (record[arm]["seconds"] - record[f"{arm}_1tok"]["seconds"])
                  for arm in ("constrained", "unconstrained")}
        record["tokens_per_s"] = {k: round(v, 2) for k, v in full.items()}
        record["decode_tokens_per_s"] = {k: round(v, 2) for k, v in decode.items()}
        record["ratio"] = round(full["constrained"] / full["unconstrained"], 4)
        record["decode_ratio"] = round(decode["constrained"] / decode["unconstrained"], 4)
        records.append(record)
        log(f"round {r + 1}/{rounds}: constrained {full['constrained']:.1f} tok/s "
            f"({record['constrained']['seconds']:.2f}s), unconstrained {full['unconstrained']:.1f} tok/s "
            f"({record['unconstrained']['seconds']:.2f}s), ratio {record['ratio']:.3f}, "
            f"decode-only ratio {record['decode_ratio']:.3f}; load {loadavg()}")
    phases["rounds"] = time.perf_counter() - began

    def median(key: str, arm: str | None = None) -> float:
        return statistics.median(rec[key][arm] if arm else rec[key] for rec in records)

    # Grammar work per decode step of the constrained arm, and the steps' own time in both arms.
    def per_round(arm: str, label: str, field: str) -> float:
        return statistics.median(rec[arm]["worker"].get(label, {}).get(field, 0) for rec in records)

    steps = per_round("constrained", "step", "calls")
    grammar = {label: per_round("constrained", label, "seconds") for label in ("mask", "accept", "matcher")}
    grammar_s = sum(grammar.values())
    extra_s = statistics.median(rec["constrained"]["seconds"] - rec["unconstrained"]["seconds"] for rec in records)
    cost = {
        "constrained_steps": steps,
        "unconstrained_steps": per_round("unconstrained", "step", "calls"),
        "seconds_per_round": {k: round(v, 4) for k, v in grammar.items()},
        "mask_ms_per_step": round(1000 * grammar["mask"] / max(1, per_round("constrained", "mask", "calls")), 3),
        "accept_ms_per_step": round(1000 * grammar["accept"] / max(1, per_round("constrained", "accept", "calls")), 3),
        "matcher_ms_per_request": round(1000 * grammar["matcher"] / NUM_REQUESTS, 3),
        "step_ms_constrained": round(1000 * per_round("constrained", "step", "seconds") / max(1, steps), 2),
        "step_ms_unconstrained": round(1000 * per_round("unconstrained", "step", "seconds")
                                       / max(1, per_round("unconstrained", "step", "calls")), 2),
        "grammar_share_of_constrained_wall": round(grammar_s / median_seconds(records, "constrained"), 4),
        "median_constrained_minus_unconstrained_s": round(extra_s, 3),
    }

    ratio, decode_ratio = median("ratio"), median("decode_ratio")
    target = TARGETS["constrained_vs_unconstrained_tokens_per_s_ratio_min"]
    result = {
        "workload": {"quick": args.quick, "model": MODEL, "dtype": "float32", "num_requests": NUM_REQUESTS,
                     "schemas": len(SCHEMAS), "max_tokens_constrained": max_tokens, "rounds": rounds,
                     "api": "LLM.chat, greedy", "prompt": "Give me <thing> as JSON.",
                     "generated_tokens_per_arm": total_tokens, "lengths": lengths,
                     "prefix_caching": llm.config.enable_prefix_caching, "max_num_seqs": llm.config.max_num_seqs},
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg": {"start": start_load, "end": loadavg()},  # per run: inside each round's records
        "phase_seconds": {k: round(v, 2) for k, v in phases.items()},
        "compile": {"first_s_including_compiler_construction": round(compile_s[0][1], 3),
                    "per_schema_s": {thing: round(s, 4) for thing, s in compile_s},
                    "first_constrained_run_s": round(first_s, 3), "first_run_worker": warm_info["worker"]},
        "constrained_lengths_repeat_across_rounds": same_lengths,
        "rounds": records,
        "median": {
            "constrained_tokens_per_s": round(median("tokens_per_s", "constrained"), 2),
            "unconstrained_tokens_per_s": round(median("tokens_per_s", "unconstrained"), 2),
            "ratio": round(ratio, 4),
            "constrained_decode_tokens_per_s": round(median("decode_tokens_per_s", "constrained"), 2),
            "unconstrained_decode_tokens_per_s": round(median("decode_tokens_per_s", "unconstrained"), 2),
            "decode_ratio": round(decode_ratio, 4),
        },
        "grammar_cost": cost,
        "validity": validity,
        "targets": TARGETS,
        "meets_targets": ratio >= target,
        "decode_ratio_meets_target": decode_ratio >= target,
        "total_seconds": round(time.perf_counter() - began_all, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["median"]
    arm_lines = "".join(f"  {arm:<13} {m[f'{arm}_tokens_per_s']:7.2f} tok/s  "
                        f"(decode only {m[f'{arm}_decode_tokens_per_s']:.2f})\n"
                        for arm in ("constrained", "unconstrained"))
    print(f"structured outputs, {NUM_REQUESTS} requests x {rounds} round(s), {total_tokens} tokens per arm:\n"
          f"{arm_lines}"
          f"  ratio {ratio:.3f} (decode only {decode_ratio:.3f}); target >= {target}: "
          f"{'met' if ratio >= target else 'NOT met'}\n"
          f"  grammar: mask {cost['mask_ms_per_step']} ms/step, accept {cost['accept_ms_per_step']} ms/step, "
          f"step {cost['step_ms_constrained']} vs {cost['step_ms_unconstrained']} ms\n"
          f"  valid JSON: {validity['parsed_json']}/{NUM_REQUESTS} parse, "
          f"{validity['valid_against_schema']}/{NUM_REQUESTS} validate; "
          f"load average {start_load} -> {result['loadavg']['end']}\n"
          f"  written to {args.out}")



if __name__ == "__main__":
    main()
