"""The `kvfleet` console script."""
from __future__ import annotations

import argparse
import json
import os
import sys

from services import cluster, cluster_roles, roles
from services.cli_args import add_engine_args, engine_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="LLM serving with a paged KV cache")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts offline and print JSON lines")
    add_engine_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)

    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server (embedded engine)")
    # vLLM's `vllm serve MODEL` form: a positional model overrides --model.
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model; same as --model")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--api-key", default=os.environ.get("KVFLEET_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVFLEET_API_KEY)",
    )
    serve.add_argument("--served-model-name", help="the model name clients use (default: the --model value)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds open requests get to finish after SIGTERM (default: %(default)s)")

    for name, help_text, add_args in (
        ("worker", "a worker: the model and its KV cache, serving step plans over gRPC", roles.add_worker_args),
        ("scheduler", "a scheduler: queues and block tables, driving a worker over gRPC", roles.add_scheduler_args),
        ("tokenizer", "the tokenizer service over gRPC", roles.add_tokenizer_args),
    ):
        add_args(commands.add_parser(name, help=help_text))
    gateway = commands.add_parser("gateway", help="the OpenAI-compatible HTTP server of a cluster (NATS, Redis)")
    cluster_roles.add_gateway_args(gateway)
    up = commands.add_parser("cluster", help="a whole cluster on this machine").add_subparsers(
        dest="cluster_command", required=True).add_parser("up", help="start every role, NATS and Redis; Ctrl-C stops")
    cluster.add_cluster_up_args(up)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from kvfleet import LLM, SamplingParams

    llm = LLM(**engine_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        completion = output.outputs[0]
        record = {"prompt": output.prompt, "text": completion.text, "finish_reason": completion.finish_reason}
        print(json.dumps(record), file=sys.stdout)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve_embedded

    if args.model_tag:
        args.model = args.model_tag
    serve_embedded(engine_args(args), args.host, args.port, args.api_key, args.served_model_name,
                   args.shutdown_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {
        "generate": _generate,
        "serve": _serve,
        "worker": roles.run_worker,
        "scheduler": roles.run_scheduler,
        "tokenizer": roles.run_tokenizer,
        "gateway": cluster_roles.run_gateway,
        "cluster": cluster.run_cluster_up,
    }[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
