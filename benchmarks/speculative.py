"""Speculative decoding (ngram, suffix, and draft_model given a draft) against plain decoding, side by side.

Workloads, each at 1 and 8 concurrent requests, greedy, on the same weights and
threads: (a) copy-heavy, code-editing prompts ("rename this variable in the following
function") whose answers copy the prompt; (a') the issue's whole copy-heavy mix: those
renames, summaries asked to quote their source, and multi-turn chats (in the model's chat
template) whose last turn asks for an earlier answer again with a change; (b) random-token prompts, greedy (this small
model soon repeats itself on them, so drafts do match) and sampled at temperature 1
(they rarely match: what proposing costs when it finds little). For each: output tokens per
second with and without speculation, their ratio, the acceptance rate (accepted draft
tokens / draft tokens) and the mean accepted length (1 + accepted / drafts: tokens per
verification step, as vLLM reports it). Greedy outputs are checked token-identical.
The methods: ngram (two configs), suffix (vLLM's defaults) and, with --draft-model, a
draft model proposing 3 tokens.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ["KVFLEET_NUM_THREADS"] = "2"

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from kvfleet import LLM, SamplingParams  # noqa: E402

# The configuration (4 drafts from 4-gram matches), and 3 drafts from 2- to 4-gram
# matches: on a CPU whose 4-bit kernel takes rows 4 at a time, a step of 4 rows (a token and
# 3 drafts) costs far less than one of 5.
SPECULATIVE_CONFIGS = {
    "ngram_k4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "ngram_k3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # Suffix decoding with vLLM's defaults (up to 24 drafts, as the match warrants).
    "suffix": {"method": "suffix"},
}
WORKLOADS = {"copy_heavy": "copy-heavy", "copy_heavy_mixed": "copy-heavy mixed", "random": "random",
             "random_sampled": "random sampled"}
TOKEN_RANGE = (1000, 40000)  # plain vocabulary ids

FUNCTIONS = [
    ("total", "result", "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + value\n"
     "    print(\"the total is\", total)\n    return total\n"),
    ("count", "n", "def count_words(text):\n    count = 0\n    for word in text.split():\n        if word:\n"
     "            count += 1\n    return count\n"),
    ("items", "entries", "def longest(items):\n    best = None\n    for item in items:\n"
     "        if best is None or len(item) > len(best):\n            best = item\n    return best, len(items)\n"),
    ("path", "filename", "def read_lines(path):\n    with open(path) as handle:\n        lines = handle.readlines()\n"
     "    print(\"read\", len(lines), \"lines from\", path)\n    return [line.strip() for line in lines]\n"),
    ("price", "cost", "def total_price(price, quantity, tax):\n    subtotal = price * quantity\n"
     "    taxed = subtotal * (1 + tax)\n    print(\"price\", price, \"taxed\", taxed)\n    return round(taxed, 2)\n"),
    ("matrix", "grid", "def transpose(matrix):\n    rows = len(matrix)\n    cols = len(matrix[0])\n"
     "    out = [[0] * rows for _ in range(cols)]\n    for i in range(rows):\n        for j in range(cols):\n"
     "            out[j][i] = matrix[i][j]\n    return out\n"),
    ("name", "label", "def greet(name, times):\n    for _ in range(times):\n        print(\"hello\", name)\n"
     "    return \"greeted \" + name\n"),
    ("queue", "pending", "def drain(queue):\n    done = []\n    while queue:\n        job = queue.pop(0)\n"
     "        done.append(job)\n    return done\n"),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def copy_heavy_prompts() -> list[str]:
    return [f"Rename the variable `{old}` to `{new}` in the following function.\n\n```python\n{code}```\n\n"
            f"Here is the function with `{old}` renamed to `{new}`:\n\n```python\n" for old, new, code in FUNCTIONS]


PASSAGES = [
    "The city council met on Tuesday to discuss the new bicycle lanes. The lanes will run along Main Street "
    "from the station to the river. Construction starts in March and should take six weeks. The mayor said "
    "that the lanes will make the street safer for children who ride to school. Some shop owners worry that "
    "they will lose parking spaces in front of their stores. The council will vote on the final plan next month.",
    "Honey bees live in colonies of up to sixty thousand bees. Each colony has one queen, who lays all of the "
    "eggs. Worker bees collect nectar and pollen from flowers and bring it back to the hive. They turn the nectar "
    "into honey and store it in wax cells. In winter the bees stay inside and keep warm by clustering together. "
    "A healthy colony can produce more honey than it needs, which is why people keep bees.",
    "The library will change its opening hours from the first of June. On weekdays it will open at nine in the "
    "morning and close at eight in the evening. On Saturdays it will close at five. The library will stay closed "
    "on Sundays. Members can still return books at any time through the slot by the front door. The reading room "
    "upstairs will be repainted during June, so it will be closed for two weeks.",
    "Our team finished the database migration last night. All customer records were copied to the new servers "
    "without errors. The old servers will stay online for one more week in case we need to roll back. Search is "
    "now about three times faster than before. Two reports still read from the old database and will be moved on "
    "Friday. Please tell the support team if you see any missing or duplicated records.",
]

# Earlier turns of a chat: the user's request and the assistant's answer, then the request
# that asks for that answer again, changed a little.
CHATS = [
    ("Write a Python function that returns the largest number in a list.",
     "Here is a function that returns the largest number in a list:\n\n```python\ndef largest(numbers):\n"
     "    best = numbers[0]\n    for number in numbers[1:]:\n        if number > best:\n            best = number\n"
     "    return best\n```\n\nIt starts with the first number and keeps the largest one it has seen.",
     "Add a docstring to that function and show the whole function again."),
    ("Write a Python function that counts the vowels in a string.",
     "Here is a function that counts the vowels in a string:\n\n```python\ndef count_vowels(text):\n"
     "    count = 0\n    for letter in text.lower():\n        if letter in \"aeiou\":\n            count += 1\n"
     "    return count\n```\n\nIt lowers the text and counts each letter that is a vowel.",
     "Rename the function to vowel_count and show the whole function again."),
    ("Give me a short packing list for a weekend camping trip.",
     "Here is a short packing list for a weekend camping trip:\n\n1. A tent and a sleeping bag\n"
     "2. A flashlight with spare batteries\n3. Water bottles and a water filter\n4. Food for two days and a small "
     "stove\n5. A first aid kit\n6. Warm clothes and a rain jacket",
     "Repeat the list and add sunscreen at the end."),
    ("What are the steps to make a cup of tea?",
     "Here are the steps to make a cup of tea:\n\n1. Boil fresh water in a kettle.\n2. Put a tea bag in a cup.\n"
     "3. Pour the hot water over the tea bag.\n4. Let it steep for three to five minutes.\n5. Take out the tea "
     "bag and add milk or sugar if you like.",
     "Write the same steps again, but for green tea, which should steep for only two minutes."),
]


def copy_heavy_mixed_prompts(llm: LLM) -> list:
    """The issue's copy-heavy kinds: the renames, then, in the model's chat template (as
    token ids), summaries quoting their source and chats whose last turn asks for an
    earlier answer again."""
    summaries = [[{"role": "user", "content": f"Summarize the following text in a few sentences, quoting its most "
                   f"important sentences word for word.\n\n{passage}"}] for passage in PASSAGES]
    chats = [[{"role": "user", "content": ask}, {"role": "assistant", "content": answer},
              {"role": "user", "content": again}] for ask, answer, again in CHATS]
    tokenizer = llm.get_tokenizer()
    return [*copy_heavy_prompts(),
            *(tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in summaries + chats)]


def random_prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randint(*TOKEN_RANGE) for _ in range(length)] for _ in range(count)]


def run(llm: LLM, prompts: list, params: SamplingParams, concurrency: int) -> tuple[float, list[list[int]]]:
    """Wall seconds to generate every prompt's output, `concurrency` requests at a time."""
    outputs: list[list[int]] = []
    began = time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        group = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts[start:start + concurrency]]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False)]
    return time.perf_counter() - began, outputs


def measure(plain: LLM, specs: dict[str, LLM], name: str, prompts: list, params: SamplingParams,
            concurrency: int, rounds: int) -> dict:
    """Plain decoding and each speculative engine on the same prompts, alternated `rounds`
    times (this machine is shared: alternating spreads its load over all of them); tokens/s
    over all rounds, and each round's."""
    load = os.getloadavg()
    engines = {"plain": plain, **specs}
    seconds: dict[str, list[float]] = {config: [] for config in engines}
    tokens: dict[str, int] = dict.fromkeys(engines, 0)
    outputs: dict[str, list[list[int]]] = {}
    before = {config: _counts(spec) for config, spec in specs.items()}
    for _ in range(rounds):
        for config, llm in engines.items():
            took, outputs[config] = run(llm, prompts, params, concurrency)
            seconds[config].append(took)
            tokens[config] += sum(map(len, outputs[config]))
    rate = {config: tokens[config] / sum(seconds[config]) for config in engines}
    result: dict = {"concurrency": concurrency, "requests": len(prompts), "rounds": rounds,
                    "output_tokens_per_round": tokens["plain"] // rounds, "plain_tokens_per_s": rate["plain"],
                    "plain_round_seconds": seconds["plain"]}
    for config, spec in specs.items():
        drafts, draft_tokens, accepted = (now - then for now, then in zip(_counts(spec), before[config]))
        result[config] = {
            "tokens_per_s": rate[config],
            "speedup": rate[config] / rate["plain"],
            # Round 1 alone: in later rounds suffix's global tree holds the same prompts' earlier
            # outputs (its use case, repeated requests, but not a comparison with the others).
            # Earlier measurements of the same run feed that tree too (the engines are shared:
            # the mix holds the renames; see "measured_before").
            "first_round_speedup": seconds["plain"][0] / seconds[config][0],
            "round_seconds": seconds[config],
            "identical": outputs[config] == outputs["plain"] if params.temperature == 0 else None,
            "acceptance_rate": accepted / max(1, draft_tokens),
            "mean_accepted_length": 1 + accepted / max(1, drafts),
            "verification_steps_with_drafts": drafts,
        }
    result["loadavg_before"], result["loadavg_after"] = load, os.getloadavg()
    log(f"{name} x{concurrency}: {result}")
    return result


def _counts(spec: LLM) -> tuple[int, int, int]:
    counts = spec.engine.scheduler.spec_decoding
    return counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a sanity run")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of each engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    parser.add_argument("--draft-model", help="also measure the draft_model method with this draft (3 drafts)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="measure only these workloads (a shorter run on a shared machine)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8], help="concurrent requests to measure")
    parser.add_argument("--configs", nargs="+", choices=SPECULATIVE_CONFIGS, default=list(SPECULATIVE_CONFIGS),
                        help="measure only these speculative configurations")
    args = parser.parse_args()
    configs = {name: SPECULATIVE_CONFIGS[name] for name in args.configs}
    if args.draft_model:
        configs["draft_model_k3"] = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 3}
    rng = random.Random(0)
    plain = LLM("smollm2", dtype="float32")
    specs = {name: LLM("smollm2", dtype="float32", speculative_config=config) for name, config in configs.items()}
    copy_prompts = copy_heavy_prompts()[: 2 if args.quick else None]
    noise = random_prompts(rng, 8, 64)[: 2 if args.quick else None]
    copy_params = SamplingParams(temperature=0.0, max_tokens=128)
    noise_params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    sampled_params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    for llm in (plain, *specs.values()):  # warm-up
        llm.generate(copy_prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    mixed_prompts = copy_heavy_mixed_prompts(plain)[:: 8 if args.quick else 1]
    workloads = {"copy_heavy": (copy_prompts, copy_params), "copy_heavy_mixed": (mixed_prompts, copy_params),
                 "random": (noise, noise_params),
                 "random_sampled": (noise, sampled_params)}
    report = {
        "threads": int(os.environ["KVFLEET_NUM_THREADS"]),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "speculative_configs": configs,
        "cpu_count": os.cpu_count(),
    }
    earlier: list[str] = []
    for name in args.workloads:
        prompts, params = workloads[name]
        report[name] = []
        for concurrency in args.concurrency:
            result = measure(plain, specs, WORKLOADS[name], prompts, params, concurrency, args.rounds)
            # What these engines ran before, whose outputs suffix's tree holds: its round 1
            # is on unseen prompts only when this is empty.
            result["measured_before"] = list(earlier)
            report[name].append(result)
            earlier.append(f"{name} x{concurrency}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
