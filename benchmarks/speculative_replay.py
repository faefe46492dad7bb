"""Where speculative decoding's speedup on the copy-heavy prompts goes, counted, not timed.

Greedy outputs are the same with and without speculation, so once benchmarks/speculative.py's
copy-heavy prompts have been generated plainly (one request at a time), any proposer's steps
can be replayed exactly without the model: at each position the proposer drafts from the
tokens known then, the drafts are accepted up to the first that differs from the output,
and the step emits the accepted drafts plus one token. The replay uses the scheduler's own
proposers (ngram, suffix) and gate (scheduler_svc/spec_gate.py), which cuts the drafts at
the step costs (and, for suffix, also without that cut). A step's time is priced by its rows with --step-costs (each row
count's worker time relative to a 1-row decode step, measured on the machine: the default is
the 2-core AVX2 EPYC's, docs/speculative.md), so the machine's load does not change the counts.

For each proposer: decode steps, steps with drafts, mean drafts and accepted drafts per such
step, the fraction of them with none accepted, and the speedup at the step costs and with
free verification (every row count costing a decode step). Ceilings: perfect drafts of k
tokens, and "copy oracles": at each position every earlier occurrence (in the prompt, the
output so far and, with --earlier-outputs, the previous requests' outputs) of the last m
tokens proposes what followed it, and an oracle takes the one with the longest correct run
and the draft length that costs least over the request: no proposer that copies spans after
a match of m tokens does better.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import json  # noqa: E402

from benchmarks.speculative import SPECULATIVE_CONFIGS, copy_heavy_mixed_prompts, copy_heavy_prompts  # noqa: E402
from kvfleet import LLM, SamplingParams  # noqa: E402
from scheduler_svc.request import Request  # noqa: E402
from scheduler_svc.spec_gate import SpecGate  # noqa: E402
from scheduler_svc.spec_proposer import Proposer, make_proposer  # noqa: E402
from scheduler_svc.spec_step_cost import SpecStepCosts  # noqa: E402
from services.messages import StepPlan  # noqa: E402
from services.speculative_config import parse_speculative_config  # noqa: E402

# Worker time of a one-request decode step by rows, relative to 1 row: the 2-core AVX2 EPYC,
# 2026-12-04, a ~200-token context (docs/speculative.md); counts between are interpolated.
STEP_COSTS = "1:1,2:1.09,3:1.16,4:1.29,5:1.70,6:1.75,7:1.89,8:1.88,9:2.45,13:3.2,17:4.0,25:6.5,33:6.9"
MAX_TOKENS = 128  # benchmarks/speculative.py's copy-heavy max_tokens


def parse_costs(text: str) -> list[float]:
    """'rows:cost,...' -> costs of 1..33 rows, linear between the points given."""
    points = sorted((int(rows), float(cost)) for rows, cost in (pair.split(":") for pair in text.split(",")))
    costs = []
    for rows in range(1, 34):
        (low, low_cost), (high, high_cost) = max((p for p in points if p[0] <= rows), default=points[0]), \
            min((p for p in points if p[0] >= rows), default=points[-1])
        costs.append(low_cost if high == low else low_cost + (high_cost - low_cost) * (rows - low) / (high - low))
    return costs


def replay(sequences: list[tuple[list[int], list[int]]], proposer: Proposer, num_speculative_tokens: int,
           costs: list[float], gate_costs: SpecStepCosts | None) -> dict:
    """The proposer's steps over the outputs, its drafts cut by the gate at `gate_costs`
    (None: not cut), each step priced at `costs`."""
    gate = SpecGate(None, gate_costs)
    steps, spec_steps, zero, drafted, accepted, units = 0, 0, 0, 0, 0, 0.0
    for index, (prompt, output) in enumerate(sequences):
        request = Request(f"r{index}", prompt, SamplingParams(temperature=0.0), (0,))
        done = 0
        while done < len(output):
            k = min(num_speculative_tokens, MAX_TOKENS - done - 1)  # as the scheduler asks: never past max_tokens
            proposal = proposer.propose(request, k) if k > 0 else ([], None)
            drafts = gate.choose({request.request_id: proposal}, 1).get(request.request_id, []) if proposal[0] else []
            hits = 0
            while hits < len(drafts) and done + hits < len(output) and drafts[hits] == output[done + hits]:
                hits += 1
            emitted = output[done:done + min(hits + 1, len(output) - done)]
            gate.observe(request.request_id, len(drafts), emitted)
            steps += 1
            units += costs[len(drafts)]
            if drafts:
                spec_steps, zero = spec_steps + 1, zero + (hits == 0)
                drafted, accepted = drafted + len(drafts), accepted + hits
            request.output_token_ids += emitted
            done += len(emitted)
        proposer.finish(request)
        gate.finish(request.request_id)
    tokens = sum(len(output) for _, output in sequences)
    return {"decode_steps": steps, "steps_with_drafts": spec_steps,
            "mean_drafts": round(drafted / max(1, spec_steps), 2),
            "mean_accepted": round(accepted / max(1, spec_steps), 2),
            "zero_accepted_fraction": round(zero / max(1, spec_steps), 3),
            "tokens_per_step": round(tokens / steps, 3),
            "speedup": round(tokens / units, 3), "speedup_free_verification": round(tokens / steps, 3)}


def measured(costs: list[float]) -> SpecStepCosts:
    """Step costs as the scheduler keeps them, with every row count measured at `costs`."""
    step_costs = SpecStepCosts()
    for rows, cost in enumerate(costs, 1):
        step_costs.record(StepPlan(0, num_scheduled_tokens={"r": rows},
                                   scheduled_spec_decode_tokens={"r": [0] * (rows - 1)} if rows > 1 else {}), cost)
    return step_costs


def copy_oracle(sequences: list[tuple[list[int], list[int]]], costs: list[float], min_match: int, max_drafts: int,
                earlier_outputs: bool) -> float:
    """The copy oracle's speedup (see the module's docstring)."""
    total_cost, total_tokens = 0.0, 0
    for index, (prompt, output) in enumerate(sequences):
        sources = [output_ for _, output_ in sequences[:index]] if earlier_outputs else []
        runs = [_longest_copied_run(prompt + output[:t], output[t:], sources, min_match, max_drafts)
                for t in range(len(output))]
        best = [0.0] * (len(output) + 1)  # the least cost from position t to the end
        for t in range(len(output) - 1, -1, -1):
            best[t] = min(costs[j] + best[min(len(output), t + j + 1)] for j in range(runs[t] + 1))
        total_cost, total_tokens = total_cost + best[0], total_tokens + len(output)
    return round(total_tokens / total_cost, 3)


def _longest_copied_run(context: list[int], future: list[int], sources: list[list[int]], min_match: int,
                        max_drafts: int) -> int:
    best = 0
    for source in (context, *sources):
        for m in range(min_match, min(len(context), 8) + 1):
            pattern, found = context[-m:], False
            # In the context itself an occurrence must end before its last token.
            for i in range(len(source) - m + 1 - (source is context)):
                if source[i:i + m] == pattern:
                    found, j = True, 0
                    while j < max_drafts and j < len(future) and i + m + j < len(source) and \
                            source[i + m + j] == future[j]:
                        j += 1
                    best = max(best, j)
            if not found:
                break  # no longer match either
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-costs", default=STEP_COSTS, help="rows:relative worker time, comma-separated")
    parser.add_argument("--workload", choices=("copy_heavy", "copy_heavy_mixed"), default="copy_heavy",
                        help="speculative.py's renames, or the issue's whole copy-heavy mix")
    args = parser.parse_args()
    costs = parse_costs(args.step_costs)
    llm = LLM("smollm2", dtype="float32")
    prompts = copy_heavy_prompts() if args.workload == "copy_heavy" else copy_heavy_mixed_prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    token_ids = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    sequences = [(ids, list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids))
                 for ids in token_ids]
    report: dict = {"workload": args.workload, "step_costs": args.step_costs,
                    "output_tokens": sum(len(o) for _, o in sequences)}
    configs = {**SPECULATIVE_CONFIGS, "suffix_uncut": SPECULATIVE_CONFIGS["suffix"]}
    for name, config in configs.items():
        spec = parse_speculative_config(config)
        report[name] = replay(sequences, make_proposer(spec), spec.num_speculative_tokens, costs,
                              None if name == "suffix_uncut" else measured(costs))
    for k in (3, 7):
        report[f"perfect_{k}_drafts"] = round(report["output_tokens"] / sum(
            -(-len(o) // (k + 1)) * costs[k] for _, o in sequences), 3)
        for m in (1, 2, 3):
            report[f"copy_oracle_{k}_drafts_match_{m}"] = {
                "own_tokens": copy_oracle(sequences, costs, m, k, False),
                "with_earlier_outputs": copy_oracle(sequences, costs, m, k, True),
                "with_earlier_outputs_free_verification": copy_oracle(sequences, [1.0] * 33, m, k, True)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
