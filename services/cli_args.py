"""Every kvfleet command-line flag, defined once with vLLM's names, and the groups each
command takes: `serve` and `cluster up` take the engine and HTTP groups, the roles
take the engine, listen and cluster groups they need. Building a parser imports no
role, so `kvfleet <command> --help` answers at once."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from services.config import EngineConfig
from services.registry import DEFAULT_TTL_S

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256

_ENGINE_HELP = {
    "model": "alias (smollm2), a .gguf file, or a HuggingFace model directory",
    "dtype": "auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16",
    "device": "auto, cpu or cuda",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (the per-step token budget)",
    "max_model_len": "context length; defaults to the model's",
    "num_gpu_blocks_override": "KV blocks to allocate, ignoring the memory budget",
    "kv_cache_memory": "bytes of KV cache on CPU",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "enable_prefix_caching": "reuse the KV of cached prompt prefixes",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes",
    "preemption_mode": "recompute or swap, when KV blocks run out",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "seed": "engine seed",
}

# The gateway's parsers by name (gateway/tool_parsers; tests/gateway checks the lists agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")

def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(EngineConfig):
        flag, help_text = f"--{f.name.replace('_', '-')}", f"{_ENGINE_HELP[f.name]} (default: %(default)s)"
        kind = str(f.type).split(" ")[0]
        if kind == "bool":  # --enable-x / --no-enable-x, as in vLLM
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind], default=f.default,
                                help=help_text)


def engine_args(namespace: argparse.Namespace) -> dict:
    return {f.name: getattr(namespace, f.name) for f in fields(EngineConfig)}


def engine_argv(namespace: argparse.Namespace) -> list[str]:
    """The engine flags of `namespace` as a command line, for the roles `cluster up` starts."""
    argv = []
    for f in fields(EngineConfig):
        flag, value = f"--{f.name.replace('_', '-')}", getattr(namespace, f.name)
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """--model alone, for the roles that need no other engine flag."""
    parser.add_argument("--model", default="smollm2", help=f"{_ENGINE_HELP['model']} (default: %(default)s)")


def add_shutdown_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight work gets to finish after SIGTERM (default: %(default)s)")


def add_http_args(parser: argparse.ArgumentParser, port: int = 8000) -> None:
    """The OpenAI server's flags: `serve`, `cluster up` and `gateway`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=port, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: $KVFLEET_API_KEY)")
    parser.add_argument("--served-model-name", help="the model name clients use (default: the --model value)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 before they are read (default: %(default)s)")
    parser.add_argument("--max-sequences-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                        help="most sequences one request may fan out to: prompts x n (or best_of) "
                        "(default: %(default)s)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="how the model writes tool calls, to turn its text into tool_calls")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split <think>...</think> reasoning into reasoning_content")
    add_shutdown_arg(parser)


def gateway_argv(namespace: argparse.Namespace) -> list[str]:
    """The request limits and chat flags of `namespace` as a command line, for the gateway `cluster up` starts."""
    argv = [f"--max-request-body-bytes={namespace.max_request_body_bytes}",
            f"--max-sequences-per-request={namespace.max_sequences_per_request}"]
    if namespace.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    for flag in ("tool_call_parser", "reasoning_parser"):
        if getattr(namespace, flag):
            argv.append(f"--{flag.replace('_', '-')}={getattr(namespace, flag)}")
    return argv


def add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    """A gRPC role's address, metrics port and drain time."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=port,
                        help="port to listen on; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port; 0 turns it off (default: %(default)s)")
    add_shutdown_arg(parser)


def add_lease_ttl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S,
                        help="seconds a dead process stays listed in the registry (default: %(default)s)")


def add_registry_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--redis-url", required=required, help="the registry, e.g. redis://127.0.0.1:6379/0")
    add_lease_ttl_arg(parser)
    parser.add_argument("--advertise-address", help="host:port other roles dial (default: --host:--port)")


def add_nats_arg(parser: argparse.ArgumentParser, required: bool, help_text: str) -> None:
    parser.add_argument("--nats-url", required=required, help=help_text)
