"""The `kvfleet` console script. Building the parser imports no role: each command
imports its own process's code when it runs, so `--help` answers at once and a role
process loads only its own room (the scheduler, gateway and tokenizer never torch).

A setting that cannot work ends the command with one line naming it, and exit code 2,
as early as it can be known: flag values at once, the rest before anything loads.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import NoReturn

from gateway.main import add_gateway_args
from kvfleet.cluster_up import add_cluster_up_args
from kvfleet.run_batch import add_run_batch_args, run_batch
from planner.main import add_planner_args
from scheduler_svc.main import add_scheduler_args
from services.cli_args import (
    VLLM_FLAGS_NOT_SUPPORTED,
    add_api_server_count_arg,
    add_chat_template_arg,
    add_engine_args,
    add_http_args,
    engine_args,
    http_ignored,
)
from services.config import ConfigError, EngineConfig
from services.telemetry import configure_logging
from tokenizer_svc.main import add_tokenizer_args
from worker_svc.main import add_worker_args

# command: (help, add its flags, "module:function" that runs it)
_ROLES = {
    "worker": ("a worker: the model and its KV cache, serving step plans over gRPC", add_worker_args,
               "worker_svc.main:run_worker"),
    "scheduler": ("a scheduler: queues and block tables, driving a worker over gRPC", add_scheduler_args,
                  "scheduler_svc.main:run_scheduler"),
    "tokenizer": ("the tokenizer service over gRPC", add_tokenizer_args, "tokenizer_svc.main:run_tokenizer"),
    "gateway": ("the OpenAI-compatible HTTP server of a cluster (NATS, Redis)", add_gateway_args,
                "gateway.main:run_gateway"),
    "planner": ("sizes the prefill, decode or combined replica pools from latency targets, through the Kubernetes "
                "API", add_planner_args, "planner.main:run_planner"),
}


logger = logging.getLogger("kvfleet")


class _Parser(argparse.ArgumentParser):
    """Errors in one line that names the command (argparse prints its whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvfleet", description="LLM serving with a paged KV cache")
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
    add_http_args(serve)
    add_chat_template_arg(serve)
    add_api_server_count_arg(serve, "HTTP server processes: 1, the one the engine runs in (several: `kvfleet cluster "
                             "up --api-server-count N`)")

    batch = commands.add_parser("run-batch", help="answer an OpenAI batch file (chat and completions lines) offline, "
                                "as vLLM's run-batch; takes serve's flags")
    add_engine_args(batch)
    add_http_args(batch)
    add_chat_template_arg(batch)
    add_run_batch_args(batch)

    for name, (help_text, add_args, _) in _ROLES.items():
        add_args(commands.add_parser(name, help=help_text))
    up = commands.add_parser("cluster", help="a whole cluster on this machine").add_subparsers(
        dest="cluster_command", required=True).add_parser("up", help="start every role, NATS and Redis; Ctrl-C stops")
    add_cluster_up_args(up)
    # Each command's own parser, to report its errors under its own name.
    for command in [*commands.choices.values(), up]:
        command.set_defaults(command_parser=command)
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
    from kvfleet.serve import serve_embedded

    serve_embedded(args)
    return 0


def _cluster_up(args: argparse.Namespace) -> int:
    from kvfleet.cluster_up import run_cluster_up

    return run_cluster_up(args)


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    command: _Parser = args.command_parser
    if unknown:
        for name in (argument.split("=")[0] for argument in unknown):
            if name in VLLM_FLAGS_NOT_SUPPORTED:
                command.error(f"{name}: {VLLM_FLAGS_NOT_SUPPORTED[name]}")
        command.error(f"unrecognized arguments: {' '.join(unknown)} (see {command.prog} --help)")
    if getattr(args, "model_tag", None):  # vLLM's `vllm serve MODEL` form
        args.model = args.model_tag
    try:
        _check(args)
        if args.command in _ROLES:
            module, function = _ROLES[args.command][2].split(":")
            return getattr(importlib.import_module(module), function)(args)
        return {"generate": _generate, "serve": _serve, "run-batch": run_batch, "cluster": _cluster_up}[args.command](args)
    except ConfigError as exc:
        command.error(str(exc))


def _check(args: argparse.Namespace) -> None:
    """The flags' values, before the command does anything; and a log line for each
    flag accepted for vLLM's sake that changes nothing."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:  # as vLLM refuses it
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser to read the model's tool calls")
    if args.command == "serve" and args.api_server_count > 1:
        raise ConfigError(f"--api-server-count {args.api_server_count}: `kvfleet serve` answers HTTP in the one "
                          "process its engine runs in; for several HTTP processes on one port, run `kvfleet cluster "
                          f"up --api-server-count {args.api_server_count}` (gateways in front of the engine)")
    if args.command in ("serve", "generate", "run-batch") and getattr(args, "kv_transfer_config", None):
        raise ConfigError("--kv-transfer-config: prefill/decode disaggregation needs replicas of the cluster's roles "
                          "(kvfleet worker and scheduler, or cluster up): another replica's worker fetches the KV, "
                          "and `kvfleet serve` runs its engine in process (docs/disaggregation.md)")
    notes = EngineConfig(**engine_args(args)).ignored() if hasattr(args, "model") else []
    if hasattr(args, "disable_log_requests"):
        notes += http_ignored(args)
    if notes:
        configure_logging()
        for note in notes:
            logger.info("%s", note)


if __name__ == "__main__":
    sys.exit(main())
