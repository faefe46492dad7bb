"""The `kvfleet` console script."""
from __future__ import annotations

import argparse
import json
import sys

from services.cli_args import add_engine_args, engine_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet", description="LLM serving with a paged KV cache")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete prompts offline and print JSON lines")
    add_engine_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    from kvfleet import LLM, SamplingParams

    llm = LLM(**engine_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        completion = output.outputs[0]
        record = {"prompt": output.prompt, "text": completion.text, "finish_reason": completion.finish_reason}
        print(json.dumps(record), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
